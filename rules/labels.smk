# Stages 4-5: the SFT policy's branch points, then K-rollout soft labels in independent shards (scatter/gather).

SOFT_LABELS_PARAMS = rule_params("soft_labels", policy_sections(config, "seed", "model", "games", "labels"), config)
# labels.shards, or the count of the shards already made with these params (a new count alone remakes nothing)
LABEL_SHARDS = label_shard_count(config, SOFT_LABELS_PARAMS)


rule branch_points:
    input:
        adapter="results/sft/adapter",
    output:
        episodes="results/labels/sft_train_episodes.parquet",
        branch_points="results/labels/branch_points.parquet",
    params:
        settings=rule_params("branch_points", policy_sections(config, "seed", "model", "games", "branch_points"),
                             config),
    log:
        "results/logs/branch_points.log",
    benchmark:
        "results/benchmarks/branch_points.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/branch_points.py"


# One job per shard; a killed shard resumes from results/labels/shards/<shard>.parquet.ckpt/ when rerun.
rule soft_labels:
    input:
        branch_points="results/labels/branch_points.parquet",
        adapter="results/sft/adapter",
    output:
        "results/labels/shards/{shard}-of-{shards}.parquet",
    wildcard_constraints:
        shard=r"\d+",
        shards=r"\d+",
    params:
        settings=SOFT_LABELS_PARAMS,
    log:
        "results/logs/soft_labels/{shard}-of-{shards}.log",
    benchmark:
        "results/benchmarks/soft_labels/{shard}-of-{shards}.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/soft_labels.py"


rule gather_soft_labels:
    input:
        branch_points="results/labels/branch_points.parquet",
        shards=expand("results/labels/shards/{shard}-of-{shards}.parquet", shard=range(LABEL_SHARDS),
                      shards=LABEL_SHARDS),
    output:
        "results/labels/soft_labels.parquet",
    params:
        settings=rule_params("gather_soft_labels", sections(config, "labels"), config),
    log:
        "results/logs/gather_soft_labels.log",
    benchmark:
        "results/benchmarks/gather_soft_labels.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/gather_soft_labels.py"


# Every answer played on the train split (base rollouts, SFT-policy trajectories, siblings, label continuations) with
# the game's verdict on it, gathered from what those stages wrote: nothing is played again. No params: the output
# depends on its inputs alone.
rule gather_answers:
    input:
        rollouts="results/rollouts/base_train.parquet",
        sft_episodes="results/labels/sft_train_episodes.parquet",
        branch_points="results/labels/branch_points.parquet",
        shards=expand("results/labels/shards/{shard}-of-{shards}.parquet", shard=range(LABEL_SHARDS),
                      shards=LABEL_SHARDS),
    output:
        "results/labels/answers.parquet",
    log:
        "results/logs/gather_answers.log",
    benchmark:
        "results/benchmarks/gather_answers.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/gather_answers.py"
