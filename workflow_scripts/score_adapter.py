from clemprm.workflow import job_settings, setup_job, tracking_run

setup_job(snakemake)

from clemprm.rl import score  # noqa: E402  (after setup_job: offline mode is read at import)

score.train_score(job_settings(snakemake), snakemake.input.sft_adapter, snakemake.output.adapter,
                  snakemake.output.metrics, snakemake.config["cache_dir"], tracking=tracking_run(snakemake))
