# Stages 4-5: the SFT policy's branch points, then K-rollout soft labels in independent shards (scatter/gather).

LABEL_SHARDS = config["labels"]["shards"]


rule branch_points:
    input:
        adapter="results/sft/adapter",
    output:
        episodes="results/labels/sft_train_episodes.parquet",
        branch_points="results/labels/branch_points.parquet",
    params:
        settings=policy_sections(config, "seed", "model", "games", "branch_points"),
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
        settings=policy_sections(config, "seed", "model", "games", "labels"),
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
        settings=sections(config, "labels"),
    log:
        "results/logs/gather_soft_labels.log",
    benchmark:
        "results/benchmarks/gather_soft_labels.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/gather_soft_labels.py"
