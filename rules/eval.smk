# Stage 7: evaluation on eval.split, one rule per mode (greedy base and SFT policies, the random-pick control,
# PRM-guided best-of-N and beam search), the summary with bootstrap CIs (results/prm_eval.json), and the figures of
# `snakemake --report`. A mode's params hold only the eval keys it plays by (clemprm.config.EVAL_MODE_KEYS).

from clemprm.config import EVAL_PRM_MODES


rule greedy_base:
    input:
        # a playpen-data instance list is an input file when set (its content then triggers reruns)
        instance_list=lambda wc: config["games"]["instance_list"] or [],
    output:
        "results/eval/greedy_base.parquet",
    params:
        settings=eval_mode_params(config, "greedy_base"),
    log:
        "results/logs/greedy_base.log",
    benchmark:
        "results/benchmarks/greedy_base.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


rule greedy_sft:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
    output:
        "results/eval/greedy_sft.parquet",
    params:
        settings=eval_mode_params(config, "greedy_sft"),
    log:
        "results/logs/greedy_sft.log",
    benchmark:
        "results/benchmarks/greedy_sft.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


# the RL policy of each algorithm of rl.algorithms: eval modes greedy_rl_grpo, greedy_rl_prime
rule greedy_rl:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        rl_adapter="results/rl/{algorithm}/adapter",
    output:
        "results/eval/greedy_rl_{algorithm}.parquet",
    wildcard_constraints:
        algorithm="|".join(config["rl"]["algorithms"]),
    params:
        settings=lambda wc: eval_mode_params(config, f"greedy_rl_{wc.algorithm}"),
        mode=lambda wc: f"greedy_rl_{wc.algorithm}",
    log:
        "results/logs/greedy_rl/{algorithm}.log",
    benchmark:
        "results/benchmarks/greedy_rl/{algorithm}.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


# PRIME's implicit PRM (results/rl/prime/adapter/prm; needs prime in rl.algorithms) ranking best-of-N candidates
# (not a default mode)
rule best_of_n_implicit:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
        rl_adapter="results/rl/prime/adapter",
    output:
        "results/eval/best_of_n_implicit.parquet",
    params:
        settings={**eval_mode_params(config, "best_of_n_implicit"), "rl": rl_params(config, "prime")["rl"]},
    log:
        "results/logs/best_of_n_implicit.log",
    benchmark:
        "results/benchmarks/best_of_n_implicit.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


rule random_of_n:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
    output:
        "results/eval/random_of_n.parquet",
    params:
        settings=eval_mode_params(config, "random_of_n"),
    log:
        "results/logs/random_of_n.log",
    benchmark:
        "results/benchmarks/random_of_n.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


rule best_of_n:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
        prm_adapter="results/prm/adapter",
    output:
        "results/eval/best_of_n.parquet",
    params:
        settings=eval_mode_params(config, "best_of_n"),
    log:
        "results/logs/best_of_n.log",
    benchmark:
        "results/benchmarks/best_of_n.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


rule beam_search:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
        prm_adapter="results/prm/adapter",
    output:
        "results/eval/beam_search.parquet",
    params:
        settings=eval_mode_params(config, "beam_search"),
    log:
        "results/logs/beam_search.log",
    benchmark:
        "results/benchmarks/beam_search.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


# best_of_n ranking by the policy's own mean token log-probability (no PRM)
rule best_of_n_logprob:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
    output:
        "results/eval/best_of_n_logprob.parquet",
    params:
        settings=eval_mode_params(config, "best_of_n_logprob"),
    log:
        "results/logs/best_of_n_logprob.log",
    benchmark:
        "results/benchmarks/best_of_n_logprob.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


# beam_search ranking by the policy's own mean token log-probability (no PRM)
rule beam_search_logprob:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
    output:
        "results/eval/beam_search_logprob.parquet",
    params:
        settings=eval_mode_params(config, "beam_search_logprob"),
    log:
        "results/logs/beam_search_logprob.log",
    benchmark:
        "results/benchmarks/beam_search_logprob.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


def upstream_stage_outputs(wc):
    """The outputs of the earlier stages the configured modes are built from, whose failure marks (on_failure:
    continue) the summary carries (prm_eval.json's upstream_warnings): every mode but greedy_base plays a policy
    trained from the base rollouts; the PRM modes also rank by a PRM trained on the soft labels; the RL modes play
    the RL stage's policies."""
    modes = set(config["eval"]["modes"])
    outputs = []
    if modes - {"greedy_base"}:
        outputs += ["results/rollouts/base_train.parquet", "results/sft/metrics.json"]
    if modes & set(EVAL_PRM_MODES):
        outputs += ["results/labels/branch_points.parquet", "results/labels/soft_labels.parquet"]
    # the RL policies the greedy_rl_<algorithm> modes play (best_of_n_implicit: PRIME's implicit PRM)
    algorithms = {mode.removeprefix("greedy_rl_") for mode in modes if mode.startswith("greedy_rl_")}
    algorithms |= {"prime"} if "best_of_n_implicit" in modes else set()
    outputs += [f"results/rl/{algorithm}/metrics.json" for algorithm in sorted(algorithms)]
    return outputs


rule eval_summary:
    input:
        modes=expand("results/eval/{mode}.parquet", mode=config["eval"]["modes"]),
        upstream=upstream_stage_outputs,
        # the PRM stage's held-out metrics, which the summary repeats, when a mode ranks by that PRM
        prm_metrics=lambda wc: ["results/prm/metrics.json"] if set(config["eval"]["modes"]) & set(EVAL_PRM_MODES) else [],
    output:
        report("results/prm_eval.json", caption="../report/prm_eval.rst", category="Evaluation"),
    params:
        settings=sections(config, "seed", "model", "games", "eval"),
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


# Optional (only when listed in eval.modes): the merged SFT checkpoint played greedily; on CPU in fp32 it plays the
# episodes of greedy_sft.
rule greedy_merged:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        merged_model="results/merged/sft",
    output:
        "results/eval/greedy_merged.parquet",
    params:
        settings=eval_mode_params(config, "greedy_merged"),
    log:
        "results/logs/greedy_merged.log",
    benchmark:
        "results/benchmarks/greedy_merged.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"


# SCoRe's mode (only when listed in eval.modes): per instance of score.games, attempt 1 then attempt 2 (greedy), for the
# SFT and the SCoRe policy; params: the mode's eval keys + score (its games and instruction; the adapter's settings)
rule self_correct:
    input:
        instance_list=lambda wc: config["games"]["instance_list"] or [],
        sft_adapter="results/sft/adapter",
        score_adapter="results/score/adapter",
    output:
        "results/eval/self_correct.parquet",
    params:
        settings={**eval_mode_params(config, "self_correct"), **sections(config, "score")},
    log:
        "results/logs/self_correct.log",
    benchmark:
        "results/benchmarks/self_correct.tsv"
    threads: max(1, config["model"]["threads"])
    conda:
        "../envs/clemprm.yaml"
    script:
        "../workflow_scripts/eval_mode.py"
