from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm import evaluation  # noqa: E402  (after setup_job: offline mode is read at import)

# the rule's name is the mode (greedy_base, greedy_sft, greedy_rl, random_of_n, best_of_n, beam_search,
# best_of_n_implicit, greedy_merged, *_logprob, self_correct)
evaluation.evaluate_mode(snakemake.rule, snakemake.params.settings, snakemake.output[0], snakemake.config["cache_dir"],
                         sft_adapter=snakemake.input.get("sft_adapter"), prm_adapter=snakemake.input.get("prm_adapter"),
                         merged_model=snakemake.input.get("merged_model"), rl_adapter=snakemake.input.get("rl_adapter"),
                         on_failure=snakemake.config["on_failure"], score_adapter=snakemake.input.get("score_adapter"))
