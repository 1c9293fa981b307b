from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import rollouts  # noqa: E402  (after setup_job: offline mode is read at import)

rollouts.base_rollouts(job_settings(snakemake), snakemake.output.episodes, snakemake.config["cache_dir"],
                       on_failure=snakemake.config["on_failure"], clembench_dir=snakemake.output.get("clembench"))
