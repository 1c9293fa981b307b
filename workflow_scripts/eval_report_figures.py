from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.evaluation import report  # noqa: E402

report.report_figures(snakemake.input.summary, snakemake.input.soft_labels, snakemake.input.prm_metrics,
                      snakemake.input.sft_metrics, dict(snakemake.output.items()))
