from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import branch_points  # noqa: E402  (after setup_job: offline mode is read at import)

branch_points.branch_points(job_settings(snakemake), snakemake.input.adapter, snakemake.output.episodes,
                            snakemake.output.branch_points, snakemake.config["cache_dir"],
                            on_failure=snakemake.config["on_failure"])
