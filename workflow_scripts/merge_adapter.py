from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import merge  # noqa: E402  (after setup_job: offline mode is read at import)

merge.merge_and_verify(snakemake.wildcards.name, snakemake.params.task, job_settings(snakemake),
                       snakemake.input.adapter, snakemake.input.data, snakemake.output[0],
                       snakemake.config["cache_dir"])
