# Stage 1-2: the base policy plays the train split; winning episodes become SFT data.


rule base_rollouts:
    input:
        # a playpen-data instance list is an input file when set (its content then triggers reruns)
        instance_list=lambda wc: config["games"]["instance_list"] or [],
    output:
        episodes="results/rollouts/base_train.parquet",
        # base_rollouts.clembench_tree: the episodes as a clembench results tree too
        **({"clembench": directory("results/clembench/base_rollouts")}
           if config["base_rollouts"]["clembench_tree"] else {}),
    params:
        settings=rule_params("base_rollouts", base_rollouts_params(config), config),
    log:
        "results/logs/base_rollouts.log",
    benchmark:
        "results/benchmarks/base_rollouts.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/base_rollouts.py"


rule win_filter:
    input:
        "results/rollouts/base_train.parquet",
    output:
        "results/sft/sft_data.parquet",
    params:
        settings=rule_params("win_filter", sections(config, "win_filter"), config),
    log:
        "results/logs/win_filter.log",
    benchmark:
        "results/benchmarks/win_filter.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/win_filter.py"
