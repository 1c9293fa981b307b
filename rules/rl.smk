# Stage 3b: online RL of the SFT policy on the train split, one job per algorithm of rl.algorithms (grpo, prime),
# side by side -> results/rl/<algorithm>/adapter/ (a PEFT adapter folder; PRIME's implicit PRM in its prm/
# sub-folder) and results/rl/<algorithm>/metrics.json (per-step metrics); eval mode greedy_rl_<algorithm> plays it.
from clemprm.config import sorted_dict

RL_STATES = "results/states/states.parquet"


rule rl_adapter:
    input:
        # a playpen-data instance list is an input file when set (its content then triggers reruns)
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        # rl.lora: a fresh LoRA on the base (no SFT stage needed); rl.data states: the prompt set
        sft_adapter=lambda wc: [] if config["rl"]["lora"] is not None else "results/sft/adapter",
        states=lambda wc: RL_STATES if config["rl"]["data"] == "states" else [],
    output:
        adapter=directory("results/rl/{algorithm}/adapter"),
        metrics="results/rl/{algorithm}/metrics.json",
    wildcard_constraints:
        algorithm="|".join(config["rl"]["algorithms"]),
    params:
        # the rl section with this job's algorithm (rl.prime only for prime): a PRIME setting reruns PRIME alone
        settings=lambda wc: rule_params("rl_adapter", rl_params(config, wc.algorithm), config),
    log:
        "results/logs/rl_adapter/{algorithm}.log",
    benchmark:
        "results/benchmarks/rl_adapter/{algorithm}.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/rl_adapter.py"


# The prompt set of rl.data: states: every turn of the hanabi rule-based player's self-play on rl.states.split (a game
# state: the prompt there, the answers that led to it, the rule-based answer); also the merge's examples for the RL
# adapter then (its prompts + the rule-based answers).
rule rl_states:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
    output:
        RL_STATES,
    params:
        # the seed draws the instances played (clemprm.play.catalog)
        settings=rule_params("rl_states", sorted_dict({"seed": config["seed"], "games": config["games"],
                                                    "states": config["rl"]["states"]}), config),
    log:
        "results/logs/rl_states.log",
    benchmark:
        "results/benchmarks/rl_states.tsv"
    threads: 1
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/rl_states.py"
