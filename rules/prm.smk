# Stage 6: the process reward model: a one-logit sequence-classification head + LoRA on the base model, trained on
# the soft labels -> a PEFT adapter folder (LoRA + score head) and its metrics.


rule prm_adapter:
    input:
        labels="results/labels/soft_labels.parquet",
        sft_adapter="results/sft/adapter",  # the policy whose log-probabilities are a baseline
        # the played episodes whose answers, with the game's verdict, the acceptance pre-training reads
        episodes=["results/rollouts/base_train.parquet", "results/labels/sft_train_episodes.parquet"],
    output:
        adapter=directory("results/prm/adapter"),
        metrics="results/prm/metrics.json",
    params:
        settings=sections(config, "seed", "model", "prm"),
    log:
        "results/logs/prm_adapter.log",
    benchmark:
        "results/benchmarks/prm_adapter.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/prm_adapter.py"
