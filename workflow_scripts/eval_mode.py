from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.evaluation import evaluate  # noqa: E402  (after setup_job: offline mode is read at import)

# the mode: the rule's name (greedy_base, greedy_sft, random_of_n, best_of_n, beam_search, best_of_n_implicit,
# greedy_merged, *_logprob, self_correct), or its params' mode (greedy_rl_<algorithm>, one rule for every algorithm)
evaluate.evaluate_mode(snakemake.params.get("mode", snakemake.rule), snakemake.params.settings, snakemake.output[0],
                       snakemake.config["cache_dir"],
                       sft_adapter=snakemake.input.get("sft_adapter"), prm_adapter=snakemake.input.get("prm_adapter"),
                       merged_model=snakemake.input.get("merged_model"), rl_adapter=snakemake.input.get("rl_adapter"),
                       on_failure=snakemake.config["on_failure"], score_adapter=snakemake.input.get("score_adapter"))
