from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import labels  # noqa: E402

labels.gather_soft_labels(job_settings(snakemake), snakemake.input.branch_points, list(snakemake.input.shards),
                          snakemake.output[0], on_failure=snakemake.config["on_failure"])
