from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import prm_evaluation  # noqa: E402

prm_evaluation.measure_prm(job_settings(snakemake), snakemake.input.labels, snakemake.input.predictions,
                           snakemake.output.metrics, on_failure=snakemake.config["on_failure"],
                           probabilities=snakemake.params.probabilities)
