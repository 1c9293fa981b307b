# Stage 3b: online RL of the SFT policy on the train split, one job per algorithm of rl.algorithms (grpo, prime),
# side by side -> results/rl/<algorithm>/adapter/ (a PEFT adapter folder; PRIME's implicit PRM in its prm/
# sub-folder) and results/rl/<algorithm>/metrics.json (per-step metrics); eval mode greedy_rl_<algorithm> plays it.


rule rl_adapter:
    input:
        # a playpen-data instance list is an input file when set (its content then triggers reruns)
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
    output:
        adapter=directory("results/rl/{algorithm}/adapter"),
        metrics="results/rl/{algorithm}/metrics.json",
    wildcard_constraints:
        algorithm="|".join(config["rl"]["algorithms"]),
    params:
        # the rl section with this job's algorithm (rl.prime only for prime): a PRIME setting reruns PRIME alone
        settings=lambda wc: rl_params(config, wc.algorithm),
    log:
        "results/logs/rl_adapter/{algorithm}.log",
    benchmark:
        "results/benchmarks/rl_adapter/{algorithm}.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/rl_adapter.py"
