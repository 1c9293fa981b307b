from clemprm.workflow import job_settings, setup_job, tracking_run

setup_job(snakemake)

from clemprm.rl import trainer  # noqa: E402  (after setup_job: offline mode is read at import)

trainer.train_rl(job_settings(snakemake), snakemake.input.get("sft_adapter") or None, snakemake.output.adapter,
                 snakemake.output.metrics, snakemake.config["cache_dir"], states=snakemake.input.get("states") or None,
                 on_failure=snakemake.config["on_failure"], tracking=tracking_run(snakemake))
