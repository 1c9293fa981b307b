from clemprm.workflow import setup_job, tracking_run

setup_job(snakemake)

from clemprm.stages import sft  # noqa: E402  (after setup_job: offline mode is read at import)

sft.train_sft(snakemake.params.settings, snakemake.input.data, snakemake.output.adapter, snakemake.output.metrics,
              snakemake.config["cache_dir"], on_failure=snakemake.config["on_failure"],
              tracking=tracking_run(snakemake))
