from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.stages import labels  # noqa: E402

labels.gather_soft_labels(snakemake.params.settings, snakemake.input.branch_points, list(snakemake.input.shards),
                          snakemake.output[0], on_failure=snakemake.config["on_failure"])
