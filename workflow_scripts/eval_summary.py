from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.evaluation import evaluate  # noqa: E402

evaluate.summarize_eval(snakemake.params.settings, list(snakemake.input.modes), snakemake.output[0],
                        upstream_paths=list(snakemake.input.upstream),
                        prm_metrics_path=next(iter(snakemake.input.prm_metrics), None))
