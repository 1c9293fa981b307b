# Stage 6: the process reward model: a one-logit sequence-classification head + LoRA on the base model, trained on
# the soft labels -> a PEFT adapter folder (LoRA + score head) and its metrics; with prm.kind: probe, linear heads on
# the SFT policy's hidden states -> the same folder (probe.safetensors, probe_config.json) and metrics.


rule prm_adapter:
    input:
        labels="results/labels/soft_labels.parquet",
        sft_adapter="results/sft/adapter",  # the policy whose log-probabilities are a baseline; a probe PRM reads it
        # every answer played on the train split with the game's verdict: what the acceptance pre-training reads
        answers="results/labels/answers.parquet",
    output:
        adapter=directory("results/prm/adapter"),
        metrics="results/prm/metrics.json",
    params:
        settings=rule_params("prm_adapter", sections(config, "seed", "model", "prm"), config),
    log:
        "results/logs/prm_adapter.log",
    benchmark:
        "results/benchmarks/prm_adapter.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/prm_adapter.py"
