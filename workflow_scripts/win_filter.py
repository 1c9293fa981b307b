from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.stages import rollouts  # noqa: E402

rollouts.win_filter(snakemake.params.settings, snakemake.input[0], snakemake.output[0])
