from clemprm.workflow import job_settings, setup_job, tracking_run

setup_job(snakemake)

from clemprm.modes import probability_search  # noqa: E402
from clemprm.stages import prm  # noqa: E402  (after setup_job: offline mode is read at import)

prm.train_prm(job_settings(snakemake), snakemake.input.labels, snakemake.output.adapter, snakemake.output.metrics,
              snakemake.config["cache_dir"], sft_adapter=snakemake.input.sft_adapter,
              on_failure=snakemake.config["on_failure"], tracking=tracking_run(snakemake),
              answers_path=snakemake.input.answers, probabilities=probability_search(snakemake.config["eval"]))
