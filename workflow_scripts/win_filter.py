from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import rollouts  # noqa: E402

rollouts.win_filter(job_settings(snakemake), snakemake.input[0], snakemake.output[0])
