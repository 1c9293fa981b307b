# Merged checkpoints: each trained adapter merged (fp32, an untied lm_head where the base ties it) into its base as
# results/merged/<name>/ (config, tokenizer, safetensors, verification.json against PEFT(base fp32 + adapter)); the
# job fails when the merged model does not match. name -> (adapter folder, task) for each adapter the run trains
# (clemprm.config.trained_adapters): results/sft, results/prm, results/rl/<algorithm> for rl_<algorithm>.

MERGED_ADAPTERS = {
    name: (f"results/{name.replace('rl_', 'rl/', 1)}/adapter", "seq-cls" if name == "prm" else "causal-lm")
    for name in trained_adapters(config)
}


def merge_inputs(wildcards):
    """The adapter and the records its verification examples come from (the SFT data, the RL prompt set, or the
    PRM's soft labels)."""
    adapter, task = MERGED_ADAPTERS[wildcards.name]
    if wildcards.name.startswith("rl_") and config["rl"]["data"] == "states":
        return {"adapter": adapter, "data": RL_STATES}   # trained on the prompt set (rules/rl.smk): its states
    if task == "causal-lm":
        # the SFT stage's extra data is part of its validation split: an input file when set
        return {"adapter": adapter, "data": "results/sft/sft_data.parquet",
                "extra_data": config["sft"]["extra_data"] or []}
    # the PRM: after its metrics (a failed gate under prm.gate.on_failure: stop fails there), which rerun no merge
    return {"adapter": adapter, "data": "results/labels/soft_labels.parquet",
            "metrics": ancient("results/prm/metrics.json")}


rule merge:
    input:
        unpack(merge_inputs),
    output:
        directory("results/merged/{name}"),
    wildcard_constraints:
        name="|".join(MERGED_ADAPTERS),
    params:
        settings=lambda wc: rule_params("merge", merge_params(config, MERGED_ADAPTERS[wc.name][1]), config),
        task=lambda wc: MERGED_ADAPTERS[wc.name][1],
    log:
        "results/logs/merge/{name}.log",
    benchmark:
        "results/benchmarks/merge/{name}.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/merge_adapter.py"
