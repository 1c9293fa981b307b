from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import labels  # noqa: E402  (after setup_job: offline mode is read at import)

labels.soft_labels_shard(job_settings(snakemake), snakemake.input.branch_points, snakemake.input.adapter,
                         int(snakemake.wildcards.shard), int(snakemake.wildcards.shards), snakemake.output[0],
                         snakemake.config["cache_dir"], snakemake.threads)
