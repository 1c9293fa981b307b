# Stage 3b: online RL (GRPO or PRIME, rl.algorithm) of the SFT policy on the train split -> a PEFT adapter folder (for
# PRIME with the implicit PRM in its prm/ sub-folder) and per-step metrics; eval mode greedy_rl plays it.


rule rl_adapter:
    input:
        # a playpen-data instance list is an input file when set (its content then triggers reruns)
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
    output:
        adapter=directory("results/rl/adapter"),
        metrics="results/rl/metrics.json",
    params:
        settings=sections(config, "seed", "model", "games", "rl"),
    log:
        "results/logs/rl_adapter.log",
    benchmark:
        "results/benchmarks/rl_adapter.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/rl_adapter.py"
