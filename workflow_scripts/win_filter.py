from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm import stages  # noqa: E402

stages.win_filter(snakemake.params.settings, snakemake.input[0], snakemake.output[0])
