from clemprm.workflow import job_settings, setup_job, tracking_run

setup_job(snakemake)

from clemprm.stages import prm  # noqa: E402  (after setup_job: offline mode is read at import)

prm.train_prm(job_settings(snakemake), snakemake.input.labels, snakemake.output.adapter, snakemake.output.predictions,
              snakemake.config["cache_dir"], sft_adapter=snakemake.input.sft_adapter,
              tracking=tracking_run(snakemake), answers_path=snakemake.input.answers)
