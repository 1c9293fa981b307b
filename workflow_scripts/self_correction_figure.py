from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.evaluation import report  # noqa: E402

report.self_correction_figure(snakemake.input.summary, snakemake.input.score_metrics, snakemake.output[0])
