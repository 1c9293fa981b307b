from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.evaluation import evaluate  # noqa: E402  (after setup_job: offline mode is read at import)

# the mode (the rule's wildcard) and the files its row of clemprm.modes.MODES reads, by name
inputs = {name: path for name, path in snakemake.input.items() if name != "instance_list"}
evaluate.evaluate_mode(snakemake.wildcards.mode, job_settings(snakemake), snakemake.output.episodes,
                       snakemake.config["cache_dir"], on_failure=snakemake.config["on_failure"],
                       clembench_dir=snakemake.output.clembench, **inputs)
