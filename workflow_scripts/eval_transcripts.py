from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.evaluation import transcript  # noqa: E402

transcript.write_transcripts(list(snakemake.input.modes), snakemake.output[0])
