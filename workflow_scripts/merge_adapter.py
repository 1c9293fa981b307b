from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.stages import merge  # noqa: E402  (after setup_job: offline mode is read at import)

merge.merge_and_verify(snakemake.wildcards.name, snakemake.params.task, snakemake.params.settings,
                       snakemake.input.adapter, snakemake.input.data, snakemake.output[0],
                       snakemake.config["cache_dir"])
