# Stage 7: evaluation on eval.split: one job per mode of eval.modes (clemprm.modes.MODES: the policy it plays, its
# search, what ranks the candidates, the eval keys it plays by and the files it reads), the summary with bootstrap CIs
# (results/prm_eval.json), and the figures and transcripts of `snakemake --report`. A mode's params hold only the config
# it plays by. Each mode also writes its episodes as a clembench results tree,
# results/clembench/<mode>/<policy>-<mode>/.

from clemprm.modes import MODES, SELF_CORRECT, upstream_outputs


def eval_mode_inputs(wc):
    """The files mode ``wc.mode`` reads (its row's inputs), and the playpen-data instance list when set (its content
    then triggers reruns). A mode that searches with the PRM also waits for its metrics (rule prm_metrics: a failed
    gate under prm.gate.on_failure: stop fails there), as ancient: remade metrics (a new prm.ci or gate threshold)
    rerun no search."""
    inputs = {"instance_list": config["games"]["instance_list"] or [], **MODES[wc.mode].inputs}
    if "prm_adapter" in inputs:
        inputs["prm_metrics"] = ancient("results/prm/metrics.json")
    return inputs


rule eval_mode:
    input:
        unpack(eval_mode_inputs),
    output:
        episodes="results/eval/{mode}.parquet",
        # the episodes as a clembench results tree (run folder <policy>-<mode>), which clem score / transcribe / eval
        # read (clemprm.play.clembench_tree; docs/records.md)
        clembench=directory("results/clembench/{mode}"),
    wildcard_constraints:
        mode="|".join(MODES),
    params:
        settings=lambda wc: rule_params("eval_mode", eval_mode_params(config, wc.mode), config),
    log:
        "results/logs/eval/{mode}.log",
    benchmark:
        "results/benchmarks/eval/{mode}.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


rule eval_summary:
    input:
        modes=expand("results/eval/{mode}.parquet", mode=config["eval"]["modes"]),
        # the earlier stages the modes are built from: their failure marks (on_failure: continue) reach the summary
        upstream=upstream_outputs(config["eval"]["modes"]),
        # the PRM stage's held-out metrics, which the summary repeats, when a mode ranks by that PRM
        prm_metrics=(["results/prm/metrics.json"]
                     if any(MODES[m].scorer == "prm" for m in config["eval"]["modes"]) else []),
    output:
        report("results/prm_eval.json", caption="../report/prm_eval.rst", category="Evaluation"),
    params:
        settings=rule_params("eval_summary", sections(config, "seed", "model", "games", "eval"), config),
    log:
        "results/logs/eval_summary.log",
    benchmark:
        "results/benchmarks/eval_summary.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_summary.py"


rule eval_report_figures:
    input:
        summary="results/prm_eval.json",
        soft_labels="results/labels/soft_labels.parquet",
        prm_metrics="results/prm/metrics.json",
        sft_metrics="results/sft/metrics.json",
    output:
        # included at the top of the report's front page (report/workflow.rst)
        warnings=report("results/report/warnings.html", caption="../report/warnings.rst", category="Evaluation"),
        scores=report("results/report/eval_scores.png", caption="../report/eval_scores.rst", category="Evaluation"),
        soft_labels=report("results/report/soft_labels.png", caption="../report/soft_labels.rst", category="PRM"),
        calibration=report("results/report/prm_calibration.png", caption="../report/prm_calibration.rst",
                           category="PRM"),
        training=report("results/report/training_curves.png", caption="../report/training_curves.rst",
                        category="Training"),
        sibling_picks=report("results/report/prm_sibling_picks.png", caption="../report/prm_sibling_picks.rst",
                             category="PRM"),
    log:
        "results/logs/eval_report_figures.log",
    benchmark:
        "results/benchmarks/eval_report_figures.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_report_figures.py"


rule eval_transcripts:
    input:
        # self_correct's attempt pairs of two policies are not shown
        modes=expand("results/eval/{mode}.parquet", mode=[m for m in config["eval"]["modes"] if m != SELF_CORRECT]),
    output:
        # per mode and game one won and one lost episode, and a search's choices in them, as HTML pages
        # <mode>/<game>/<won|lost>[_choices].html (clemprm.evaluation.transcript)
        report(directory("results/report/transcripts"), patterns=["{mode}/{game}/{page}.html"],
               caption="../report/transcripts.rst", category="Transcripts", subcategory="{mode}",
               labels={"game": "{game}", "page": "{page}"}),
    log:
        "results/logs/eval_transcripts.log",
    benchmark:
        "results/benchmarks/eval_transcripts.tsv"
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_transcripts.py"
