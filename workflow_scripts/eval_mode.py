from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm import evaluation  # noqa: E402  (after setup_job: offline mode is read at import)

# the rule's name is the mode (greedy_base, greedy_sft, random_of_n, best_of_n, beam_search, *_logprob)
evaluation.evaluate_mode(snakemake.rule, snakemake.params.settings, snakemake.output[0], snakemake.config["cache_dir"],
                         sft_adapter=snakemake.input.get("sft_adapter"), prm_adapter=snakemake.input.get("prm_adapter"),
                         on_failure=snakemake.config["on_failure"])
