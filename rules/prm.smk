# Stage 6: the process reward model: a one-logit sequence-classification head + LoRA on the base model, trained on
# the soft labels -> a PEFT adapter folder (LoRA + score head) and its predictions on every side; with prm.kind: probe,
# linear heads on the SFT policy's hidden states -> the same folder (probe.safetensors, probe_config.json). Then,
# with no model, its metrics, baselines and quality gate (prm_metrics): changing how it is measured trains nothing.

from clemprm.modes import probability_search
from clemprm.stages.prm_evaluation import metrics_params


rule prm_adapter:
    input:
        labels="results/labels/soft_labels.parquet",
        sft_adapter="results/sft/adapter",  # the policy whose log-probabilities are a baseline; a probe PRM reads it
        # every answer played on the train split with the game's verdict: what the acceptance pre-training reads
        answers="results/labels/answers.parquet",
    output:
        adapter=directory("results/prm/adapter"),
        # every side's predictions and the policy's log-probabilities; the training record in its provenance
        predictions="results/prm/predictions.parquet",
    params:
        # what the weights and predictions depend on: not prm.ci or prm.gate (clemprm.workflow.UNREAD_SECTIONS)
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


rule prm_metrics:
    input:
        labels="results/labels/soft_labels.parquet",
        predictions="results/prm/predictions.parquet",
    output:
        metrics="results/prm/metrics.json",
    params:
        settings=rule_params("prm_metrics", metrics_params(config), config),
        # a search that multiplies the PRM's values as probabilities: then calibration decides the gate
        probabilities=probability_search(config["eval"]),
    log:
        "results/logs/prm_metrics.log",
    benchmark:
        "results/benchmarks/prm_metrics.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/prm_metrics.py"
