from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.evaluation import evaluate  # noqa: E402

evaluate.summarize_eval(job_settings(snakemake), list(snakemake.input.modes), snakemake.output[0],
                        upstream_paths=list(snakemake.input.upstream),
                        prm_metrics_path=next(iter(snakemake.input.prm_metrics), None))
