from clemprm.workflow import setup_job, tracking_run

setup_job(snakemake)

from clemprm.stages import prm  # noqa: E402  (after setup_job: offline mode is read at import)

prm.train_prm(snakemake.params.settings, snakemake.input.labels, snakemake.output.adapter, snakemake.output.metrics,
              snakemake.config["cache_dir"], sft_adapter=snakemake.input.sft_adapter,
              on_failure=snakemake.config["on_failure"], tracking=tracking_run(snakemake),
              episode_paths=list(snakemake.input.episodes))
