from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm import evaluation  # noqa: E402

evaluation.summarize_eval(snakemake.params.settings, list(snakemake.input.modes), snakemake.output[0],
                          prm_metrics_path=snakemake.input.prm_metrics)
