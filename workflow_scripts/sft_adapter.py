from clemprm.workflow import job_settings, setup_job, tracking_run

setup_job(snakemake)

from clemprm.stages import sft  # noqa: E402  (after setup_job: offline mode is read at import)

sft.train_sft(job_settings(snakemake), snakemake.input.data, snakemake.output.adapter, snakemake.output.metrics,
              snakemake.config["cache_dir"], on_failure=snakemake.config["on_failure"],
              tracking=tracking_run(snakemake))
