# Stage 3c: SCoRe two-attempt self-correction RL (clemprm/rl/score.py) of the SFT policy on the single-player games of
# score.games -> a PEFT adapter folder and per-stage, per-step metrics. Eval mode self_correct (rules/eval.smk) plays
# both attempts with the SFT and the SCoRe policy; its figure is in `snakemake --report` when the mode is in eval.modes.
# score.games is checked with the rest of the config when the Snakefile is parsed (clemprm.workflow.check_config)
SELF_CORRECT_ON = "self_correct" in config["eval"]["modes"]

# what rule all adds when self_correct is an eval mode (the summary then also needs the SCoRe adapter)
SCORE_TARGETS = ["results/report/self_correction.png"] if SELF_CORRECT_ON else []


rule score_adapter:
    input:
        # a playpen-data instance list is an input file when set (its content then triggers reruns)
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
    output:
        adapter=directory("results/score/adapter"),
        metrics="results/score/metrics.json",
    params:
        settings=rule_params("score_adapter", policy_sections(config, "seed", "model", "games", "score"),
                             config),
    log:
        "results/logs/score_adapter.log",
    benchmark:
        "results/benchmarks/score_adapter.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/score_adapter.py"


rule self_correction_figure:
    input:
        summary="results/prm_eval.json",
        score_metrics="results/score/metrics.json",
    output:
        report("results/report/self_correction.png", caption="../report/self_correction.rst", category="Evaluation"),
    log:
        "results/logs/self_correction_figure.log",
    benchmark:
        "results/benchmarks/self_correction_figure.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/self_correction_figure.py"
