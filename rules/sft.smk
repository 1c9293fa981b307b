# Stage 3: LoRA (QLoRA on CUDA) fine-tune of the policy on the winning turns -> a PEFT adapter folder.


rule sft_adapter:
    input:
        data="results/sft/sft_data.parquet",
        # optional playpen-data interactions mixed in: an input file when set (its content then triggers reruns)
        extra_data=lambda wc: config["sft"]["extra_data"] or [],
    output:
        adapter=directory("results/sft/adapter"),
        metrics="results/sft/metrics.json",
    params:
        settings=rule_params("sft_adapter", sections(config, "seed", "model", "sft"), config),
    log:
        "results/logs/sft_adapter.log",
    benchmark:
        "results/benchmarks/sft_adapter.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/sft_adapter.py"
