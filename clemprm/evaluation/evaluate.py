"""PRM-guided evaluation: each mode plays the eval split; one summary with bootstrap CIs (``results/prm_eval.json``).

A mode is one row of :data:`clemprm.modes.MODES` (the policy it plays, its search, the scorer ranking the
search's candidates and its regime); each writes ``results/eval/<mode>.parquet`` (rows of
:data:`clemprm.records.EVAL_EPISODES`, its regime in the file's provenance). Blind modes (the default) show the game
one answer per turn; lookahead modes play every candidate in a fork first (:mod:`clemprm.search`) and are compared
only with lookahead controls. ``random_of_n`` samples ``best_of_n``'s candidates (same seeds) and picks one at
random: the control that tells what a ranking adds to sampling N answers; the ``*_logprob`` modes rank by the
policy's own mean token log-probability (:mod:`clemprm.models.logprob`), the PRM-free pick a PRM must beat; the
``*_rule`` modes rank what a fork shows by a rule with no model (:class:`clemprm.search.RuleScorer`), the control
of a lookahead search; ``self_correct`` (SCoRe's two attempts, :mod:`clemprm.evaluation.self_correct`) is summarized
apart, as ``self_correction``.

All modes play the same instances with the same episode seeds, so they pair by instance
``(game, experiment, game_id)``.

The summary gives, per mode, per game and overall: episodes, % played, quality (mean BENCH_SCORE of the played
episodes), clemscore and success rate. Overall is clembench's macro average: % played, quality and success
rate are averaged over games (a game without a played episode has no quality and is left out of that mean),
clemscore = overall % played / 100 x overall quality (0 when nothing was played). Confidence intervals are
percentile bootstrap intervals over *instances*, resampled within each game (every game keeps its size; all
episodes of a drawn instance come along). Differences of every mode to the baselines of its regime (blind:
``greedy_sft``, ``greedy_base``, ``random_of_n``, ``best_of_n_logprob``, ``greedy_rl_grpo``: PRIME's policy is compared
with GRPO's; lookahead: ``best_of_n_rule``, ``beam_search_rule``, ``beam_search_logprob``) use paired draws: the same
resampled instances for both modes. Draws are seeded per game from ``seed``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jsonschema
import numpy as np
import pandas as pd

from clemprm import records, stats
from clemprm.checks.run_time import CONDITIONS, failures_by_game, read_failure_marks
from clemprm.config import provenance
from clemprm.evaluation.scorers import MODEL_FREE_SCORERS, load_scorer
from clemprm.evaluation.self_correct import evaluate_self_correct, self_correction_summary
from clemprm.models.loader import policy_settings
from clemprm.modes import MODES, SELF_CORRECT, EvalMode
from clemprm.play.clembench_tree import model_infos, run_dir_name
from clemprm.play.contract import Sampling, Scorer
from clemprm.play.engine import RolloutEngine
from clemprm.play.episode import Episode
from clemprm.search import SearchCost, greedy_cost
from clemprm.search.beam_search import beam_search
from clemprm.search.best_of_n import best_of_n
from clemprm.stages.rollouts import Played, RunFolder, describer, play_split, summarize
from clemprm.stats import OVERALL

log = logging.getLogger(__name__)

SCHEMA_PATH = Path(__file__).with_name("prm_eval.schema.json")


# ------------------------------------------------------------------------------------------------ playing


def mode_sampling(mode: EvalMode, eval_settings: dict) -> Sampling:
    """Greedy modes decode at temperature 0; the searches sample their candidates."""
    if mode.samples:
        return Sampling(eval_settings["temperature"], eval_settings["top_p"], eval_settings["max_new_tokens"])
    return Sampling(0.0, 1.0, eval_settings["max_new_tokens"])


def play(mode: EvalMode, engine: RolloutEngine, episodes: list[Episode], scorer: Scorer | None,
         eval_settings: dict) -> tuple[list[Episode], list[SearchCost]]:
    """Play the started ``episodes`` in ``mode``: the episodes that count, and what each one cost."""
    if mode.search == "best_of_n":
        costs = best_of_n(engine, episodes, scorer, eval_settings["n"], engine.sampling, label=mode.name,
                          lookahead=mode.regime == "lookahead")
        if mode.scorer in MODEL_FREE_SCORERS:
            for cost in costs:
                cost.prm_pairs = 0  # a random pick or a rule scores with no model
        return episodes, costs
    if mode.search == "beam_search":
        return beam_search(engine, episodes, scorer, n=eval_settings["n"], beam_width=eval_settings["beam_width"],
                           iterations=eval_settings["num_beam_iterations"], sampling=engine.sampling,
                           aggregation=eval_settings["aggregation"], label=mode.name)
    engine.run(episodes, label=mode.name)
    return episodes, [greedy_cost(episode) for episode in episodes]


def load_mode_policy(mode: EvalMode, settings: dict, inputs: dict, cache_dir: str | None):
    """The policy ``mode`` plays: the base model, the merged SFT checkpoint, or the base with the SFT or RL adapter."""
    from clemprm.models.generation import load_policy   # torch: imported by the jobs that play

    if mode.policy == "base":
        return load_policy(settings["model"], cache_dir)
    if mode.policy == "merged":
        merged = mode.required_input(inputs, "merged_model")
        return load_policy({**settings["model"], "spec": merged, "adapter": None}, cache_dir)
    adapter = mode.required_input(inputs, "rl_adapter" if mode.policy == "rl" else "sft_adapter")
    return load_policy(policy_settings(settings["model"], adapter), cache_dir)


def stats_dict(stats) -> dict | None:
    """A model's running counters as a dict (a dataclass with ``as_dict``, or a plain dict), None if it has none."""
    if stats is None:
        return None
    return stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)


def run_info(mode: str, seconds: float, policy, prm: Scorer | None, prm_adapter: str | None) -> dict:
    """What the summary reports of a mode's run: its regime, wall seconds of play, the policy and the PRM with their
    counters."""
    cfg = getattr(policy, "cfg", None)
    return {"mode": mode, "regime": MODES[mode].regime, "wall_seconds": round(seconds, 3),
            "policy": {"name": policy.name, "spec": getattr(cfg, "spec", None),
                       "adapter": getattr(cfg, "adapter", None), "stats": stats_dict(getattr(policy, "stats", None))},
            "prm": None if prm is None else {"adapter": prm_adapter, "stats": stats_dict(prm.stats)}}


def evaluate_mode(name: str, settings: dict, output: str, cache_dir: str | None = None, *, policy=None,
                  prm: Scorer | None = None, on_failure: str = "stop", clembench_dir: str | None = None,
                  **inputs: str | None) -> list[dict]:
    """Play the ``eval.split`` instances of every configured game in mode ``name``; write the per-episode parquet
    and, given ``clembench_dir`` (``results/clembench/<mode>``), the episodes as a clembench results tree there
    (:mod:`clemprm.play.clembench_tree`: one run folder ``<policy>-<mode>``, which clemcore's ``clem score``,
    ``clem transcribe`` and ``clem eval`` read; a search writes the episode it finally played).

    ``settings``: the rule's params (:func:`clemprm.config.eval_mode_params`). ``inputs``: the files the mode reads,
    named as in its row of :data:`clemprm.modes.MODES` (``sft_adapter``, ``prm_adapter``, ``rl_adapter``,
    ``merged_model``, ``score_adapter``). ``policy`` and ``prm`` replace the loaded models (tests; ``random_of_n``
    always picks with a :class:`~clemprm.search.RandomScorer`). The parquet's provenance also holds the run (policy,
    scorer adapter, wall seconds of play, model counters) and the failure marks of ``on_failure: continue`` (a mode in
    which every episode of a game failed otherwise fails, :mod:`clemprm.checks.run_time`).
    """
    if name not in MODES:
        raise ValueError(f"unknown eval mode {name!r} (known: {', '.join(MODES)})")
    mode = MODES[name]
    if mode.search == "self_correct":   # two policies, two attempts
        return evaluate_self_correct(settings, output, cache_dir, sft_adapter=inputs.get("sft_adapter"),
                                     score_adapter=inputs.get("score_adapter"), on_failure=on_failure,
                                     clembench_dir=clembench_dir)
    eval_settings = settings["eval"]
    return play_split(f"eval {name}", settings, eval_settings["split"], mode_sampling(mode, eval_settings),
                      lambda engine, instances: play_mode(mode, settings, inputs, cache_dir, engine, instances,
                                                          policy=policy, prm=prm, clembench_dir=clembench_dir),
                      output, records.EVAL_EPISODES, on_failure=on_failure, clembench_dir=clembench_dir,
                      per_game=eval_settings["max_instances"])


def play_mode(mode: EvalMode, settings: dict, inputs: dict, cache_dir: str | None, engine: RolloutEngine,
              instances: list, *, policy, prm: Scorer | None, clembench_dir: str | None) -> tuple[list[Played], dict]:
    """:func:`evaluate_mode`'s play (:func:`clemprm.stages.rollouts.play_split`): the mode's policy (unless given)
    and scorer loaded, ``instances`` played in the mode; its episodes and its run (:func:`run_info`)."""
    eval_settings = settings["eval"]
    policy = policy or load_mode_policy(mode, settings, inputs, cache_dir)
    scorer, scorer_adapter = load_scorer(mode, settings, inputs, policy, cache_dir, given=prm)
    log.info("eval %s: %d %s instances x %d episodes, policy %s", mode.name, len(instances), eval_settings["split"],
             eval_settings["episodes_per_instance"], policy.name)
    start = time.perf_counter()
    run_dir, infos = run_dir_name(policy.name, mode.name, mode.regime), model_infos(policy, engine.sampling)

    def searched(started: list[Episode]) -> tuple[list[Episode], list[dict]]:
        episodes, costs = play(mode, engine, started, scorer, eval_settings)
        return episodes, [{"mode": mode.name, "policy_tokens": cost.policy_tokens, "prm_pairs": cost.prm_pairs,
                           "search_nodes": cost.nodes, "choices": cost.choices} for cost in costs]

    # one stage name for every mode: the same episode seeds, so modes pair episode by episode
    described = engine.play_described(instances, [policy], repeats=eval_settings["episodes_per_instance"],
                                      base_seed=settings["seed"], stage="eval", policy_name=policy.name,
                                      describe=describer(clembench_dir, run_dir, infos), play=searched)
    seconds = time.perf_counter() - start
    rows = [row for row, _ in described]
    log.info("eval %s: %d episodes in %.0f s\n%s", mode.name, len(rows), seconds,
             summarize(rows) if rows else "(no episode)")
    run = run_info(mode.name, seconds, policy, None if mode.scorer in MODEL_FREE_SCORERS else scorer, scorer_adapter)
    folder = RunFolder(run_dir, infos, {"mode": mode.name, "regime": mode.regime, "split": eval_settings["split"],
                                        "wall_seconds": run["wall_seconds"]}, [entry for _, entry in described])
    return [Played(f"eval {mode.name}", rows, [folder])], run


# ------------------------------------------------------------------------------------------------ metrics


def instance_table(rows: list[dict]) -> pd.DataFrame:
    """Per instance ``(game, experiment, game_id)``, sorted: episodes, played episodes, their summed BENCH_SCORE,
    successes (the sufficient statistics of every metric)."""
    frame = pd.DataFrame({
        "game": [row["game"] for row in rows], "experiment": [row["experiment"] for row in rows],
        "game_id": [row["game_id"] for row in rows], "played": [not row["aborted"] for row in rows],
        "score": [0.0 if row["aborted"] else row["bench_score"] for row in rows],
        "success": [bool(row["success"]) for row in rows]})
    return frame.groupby(["game", "experiment", "game_id"]).agg(
        episodes=("played", "size"), played=("played", "sum"), score=("score", "sum"), success=("success", "sum"))


def clemscore(percent_played: np.ndarray, quality: np.ndarray) -> np.ndarray:
    """% played / 100 x quality; 0 where nothing was played (no quality)."""
    return np.where(np.isnan(quality), 0.0, percent_played / 100 * np.nan_to_num(quality))


def game_metrics(table: pd.DataFrame, weights: np.ndarray) -> dict[str, np.ndarray]:
    """The metrics of one game, one per row of ``weights`` (draws x instances: how often each instance is drawn)."""
    episodes, played, score, success = (weights @ table[column].to_numpy(float)
                                        for column in ("episodes", "played", "score", "success"))
    with np.errstate(invalid="ignore", divide="ignore"):
        quality = np.where(played > 0, score / played, np.nan)
    percent_played = 100 * played / episodes
    return {"percent_played": percent_played, "quality": quality, "clemscore": clemscore(percent_played, quality),
            "success_rate": 100 * success / episodes}


MACRO_METRICS = ("percent_played", "quality", "success_rate")   # overall: the mean over the games where defined


def mode_statistic(tables: dict[str, pd.DataFrame], weights: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per game and overall (clembench's macro average over games; clemscore from the averaged % played and
    quality): a :data:`clemprm.stats.Statistic` of :func:`instance_table` rows."""
    per_game = {game: game_metrics(table, weights[game]) for game, table in tables.items()}
    overall = stats.macro_average(list(per_game.values()), MACRO_METRICS)
    overall["clemscore"] = clemscore(overall["percent_played"], overall["quality"])
    return {**per_game, OVERALL: overall}


def mode_estimates(table: pd.DataFrame, samples: int, seed: int, ci: float, rows: list[dict] | None = None) -> dict:
    """Metrics of one mode per game and overall, with bootstrap CIs and episode/instance counts; with the mode's
    episode ``rows``, also the failed episodes (an exception in game code or scorer) and the first error per game."""
    tables = stats.split_by_game(table)
    result = stats.bootstrap(tables, mode_statistic, samples, seed, ci)
    for game, part in tables.items():
        result[game].update(episodes=int(part["episodes"].sum()), instances=len(part))
    result[OVERALL].update(episodes=int(table["episodes"].sum()), instances=len(table))
    if rows is not None:
        failures = failures_by_game(rows)
        for game, entry in failures.items():
            result[game].update(errors=entry.failed, first_error=entry.first_error)
        result[OVERALL].update(errors=sum(entry.failed for entry in failures.values()), first_error=next(
            (entry.first_error for entry in failures.values() if entry.first_error), None))
    return result


def difference(table: pd.DataFrame, baseline: pd.DataFrame, samples: int, seed: int, ci: float) -> dict:
    """``mode - baseline`` per game and overall on the instances both played, with paired bootstrap CIs ({} when
    they share none). An overall difference of % played, quality or success rate is the mean of the per-game
    differences over the games where both modes have the metric (quality: where both played an episode), in every
    draw as in the point estimate; ``games`` under ``overall`` says how many games each covers. clemscore, defined
    everywhere, is the difference of the two modes' clemscores."""
    return stats.paired_difference(table, baseline, mode_statistic, samples, seed, ci, macro=MACRO_METRICS)


# ------------------------------------------------------------------------------------------------ summary


def mode_cost(rows: list[dict], run: dict) -> dict:
    return {"policy_tokens": sum(row["policy_tokens"] for row in rows),
            "prm_pairs": sum(row["prm_pairs"] for row in rows),
            "search_nodes": sum(row["search_nodes"] for row in rows),
            "wall_seconds": run.get("wall_seconds")}


RANKING_SCORERS = ("prm", "constant_mean", "game_mean", "candidate_length", "policy_logprob", "acceptance", "rule")
GLOBAL_KEYS = ("n", "bce", "mse", "pearson", "spearman", "auroc")


def prm_summary(prm_metrics: dict) -> dict | None:
    """The PRM stage's held-out metrics (``results/prm/metrics.json``, on its ranked side: the validation-split
    branch points, else the validation slice of train instances) as the summary shows them: ``global`` (BCE, MSE,
    correlations and AUROC against the labels, across states), ``ranking`` (within-state pairwise accuracy, top-1
    regret and the label of the pick among siblings, with bootstrap CIs,
    :func:`clemprm.stages.prm_metrics.ranking_metrics`) for the PRM and every baseline (``constant_mean`` and
    ``game_mean`` tie all siblings of a state: their pick is a random pick's expectation), and the quality ``gate``.
    None when the PRM was not trained."""
    ranking = prm_metrics.get("ranking")
    if not ranking:
        return None
    side = ranking.get("side", "validation")
    blocks = {"prm": (prm_metrics.get("evaluation") or {}).get(side),
              **{name: (entry or {}).get(side) for name, entry in (prm_metrics.get("baselines") or {}).items()}}
    return {"side": side, "input": prm_metrics.get("input"),
            "instances": (prm_metrics.get("examples") or {}).get(f"{side}_instances"),
            "loss": prm_metrics.get("loss"), "pairwise_weight": prm_metrics.get("pairwise_weight"),
            "gate": prm_metrics.get("gate"),
            "global": {name: {key: block.get(key) for key in GLOBAL_KEYS if key in block}
                       for name, block in blocks.items() if name in RANKING_SCORERS and block},
            "ranking": {key: value for key, value in ranking.items() if key != "side"},
            "ceiling": prm_metrics.get("ceiling"), "train_ranking": prm_metrics.get("train_ranking")}


def baselines() -> list[str]:
    """The modes every other mode's difference is reported to (``baseline`` in :data:`clemprm.modes.MODES`)."""
    return [name for name, mode in MODES.items() if mode.baseline]


def episode_modes() -> list[str]:
    """The modes whose episodes the summary's modes and differences cover (self_correct has its own entry)."""
    return [name for name in MODES if name != SELF_CORRECT]


def summary_schema() -> dict:
    """The schema of ``prm_eval.json``, with the modes and baselines of :data:`clemprm.modes.MODES` and the failure
    conditions of :data:`clemprm.checks.run_time.CONDITIONS` filled in."""
    schema = json.loads(SCHEMA_PATH.read_text())
    schema["$defs"]["mode"] = {"enum": episode_modes()}
    schema["properties"]["differences"]["propertyNames"] = {"enum": baselines()}
    schema["properties"]["upstream_warnings"]["items"]["properties"]["condition"] = {"enum": list(CONDITIONS)}
    return schema


def file_regime(path: str, run: dict) -> tuple[str, str | None]:
    """The regime a mode's records were played in (their provenance's ``run.regime``), and a warning for records
    made before the blind/lookahead split: they carry no mark and every search then played its candidates in forks,
    so they are read as lookahead."""
    if run.get("regime") is not None:
        return run["regime"], None
    mode = run.get("mode") or Path(path).stem
    if mode in MODES and MODES[mode].search == "greedy":
        return "blind", None   # greedy play answered once per turn before the split too
    return "lookahead", (f"{path} has no regime mark (made before blind and lookahead search were told apart): read "
                         f"as lookahead, its candidates played in forks; remake it (snakemake --forcerun eval_mode) "
                         f"for a blind figure")


# a PRM gate's verdict that every mode searching with it warns of: a failed gate, and one not judged (no evidence)
GATE_WARNINGS = {"failed": "that did not pass its quality gate",
                 "not_judged": "whose quality gate was not judged (no evidence is no pass)"}


def summarize_eval(settings: dict, mode_paths: list[str], output: str, upstream_paths: list[str] = (),
                   prm_metrics_path: str | None = None) -> dict:
    """Read every mode's episodes, compute the summary and write it as JSON (validated against its schema).

    ``upstream_paths``: the outputs of the earlier stages the modes were built from (base rollouts, SFT metrics,
    branch points, soft labels); their failure marks (:mod:`clemprm.checks.run_time`), then the modes' own, are the
    summary's ``upstream_warnings``, and their messages its ``warnings``. ``prm_metrics_path``: the PRM stage's
    metrics, whose held-out ranking and global metrics the summary repeats (:func:`prm_summary`)."""
    eval_settings = settings["eval"]
    samples, ci, seed = eval_settings["bootstrap_samples"], eval_settings["ci"], settings["seed"]
    runs, regimes, legacy = {}, {}, []
    for path in mode_paths:
        run = records.read_provenance(path).get("run", {})
        mode = run.get("mode") or Path(path).stem
        schema = records.SELF_CORRECT_EPISODES if mode == SELF_CORRECT else records.EVAL_EPISODES
        runs[mode] = (records.read_records(path, schema, splits=(eval_settings["split"],)), run)
        regimes[mode], warning = file_regime(path, run)
        legacy += [warning] if warning else []
    self_correct = runs.pop(SELF_CORRECT, None)   # attempt pairs of two policies: its own entry
    prm_metrics = json.loads(Path(prm_metrics_path).read_text()) if prm_metrics_path is not None else None
    # in pipeline order: the earlier stages, the PRM (its quality gate), then the modes
    prm_paths = [prm_metrics_path] if prm_metrics_path is not None else []
    marks = [mark for path in [*upstream_paths, *prm_paths, *mode_paths] for mark in read_failure_marks(path)]
    gate = (prm_metrics or {}).get("gate") or {}
    tables = {mode: instance_table(rows) for mode, (rows, _) in runs.items() if rows}
    summary = {
        "split": eval_settings["split"],
        "bootstrap": {"samples": samples, "ci": ci, "seed": seed, "unit": "instance (game, experiment, game_id)",
                      "resampling": "within each game", "interval": "percentile"},
        "modes": {mode: {"regime": regimes[mode], "policy": run.get("policy"), "prm": run.get("prm"),
                         "cost": mode_cost(rows, run),
                         "results": mode_estimates(tables[mode], samples, seed, ci, rows) if mode in tables else {},
                         **({"prm_gate": gate.get("status")} if MODES[mode].scorer == "prm" else {})}
                  for mode, (rows, run) in runs.items()},
        # on_failure: continue let these stages go on despite a fail-fast condition (in pipeline order)
        "upstream_warnings": marks,
        "warnings": [mark["message"] for mark in marks] + legacy,
        # each mode against the controls of its own regime: a lookahead search is never compared with a blind one
        "differences": {baseline: {mode: difference(tables[mode], tables[baseline], samples, seed, ci)
                                   for mode in tables if mode != baseline and regimes[mode] == regimes[baseline]}
                        for baseline in baselines() if baseline in tables},
        **provenance(settings),
    }
    if prm_metrics is not None:
        summary["prm"] = prm_summary(prm_metrics)
    if gate.get("status") in GATE_WARNINGS:   # the searches ranked by it say so
        summary["warnings"] += [f"{mode} ran on a PRM {GATE_WARNINGS[gate['status']]}"
                                + (f" ({'; '.join(gate['not_judged'])})" if gate["status"] == "not_judged" else "")
                                for mode in summary["modes"] if MODES[mode].scorer == "prm"]
    if self_correct is not None:
        summary["self_correction"] = self_correction_summary(self_correct[0], samples, seed, ci)
    jsonschema.validate(summary, summary_schema())
    records.write_json(output, summary)
    log.info("eval summary -> %s\n%s", output, summary_lines(summary))
    if summary.get("prm"):
        log.info("PRM on its held-out states (%s instances):\n%s", summary["prm"]["instances"],
                 ranking_lines(summary["prm"]))
    for warning in summary["warnings"]:
        log.warning("THIS SUMMARY INCLUDES A FAILED STAGE (on_failure: continue): %s", warning)
    return summary


def summary_lines(summary: dict) -> str:
    """One line per mode: % played and quality side by side (never clemscore alone), with their CIs."""
    def show(value):
        if value["value"] is None:
            return "n/a"
        return f"{value['value']:.1f} [{value['ci_low']:.1f}, {value['ci_high']:.1f}]"

    lines = []
    for mode, entry in summary["modes"].items():
        overall = entry["results"].get(OVERALL)
        if overall:
            lines.append(f"{mode} ({entry.get('regime', 'lookahead')}): {overall['episodes']} episodes, "
                         f"% played {show(overall['percent_played'])}, quality {show(overall['quality'])}, "
                         f"clemscore {show(overall['clemscore'])}, "
                         f"success {show(overall['success_rate'])}, failed episodes {overall.get('errors', 0)}; "
                         f"cost {entry['cost']}"
                         + (f"; RAN ON A PRM {GATE_WARNINGS[entry['prm_gate']].upper()}"
                            if entry.get("prm_gate") in GATE_WARNINGS else ""))
    return "\n".join(lines)



def ranking_lines(prm: dict) -> str:
    """One line per scorer of :func:`prm_summary`: overall pairwise accuracy, top-1 regret and pick label among
    siblings (with CIs), and the global AUROC."""
    def show(estimate):
        if not estimate or estimate["value"] is None:
            return "n/a"
        return f"{estimate['value']:.3f} [{estimate['ci_low']:.3f}, {estimate['ci_high']:.3f}]"

    ranking = prm["ranking"]
    lines = [f"{ranking['prefixes']} states with siblings, {ranking['pairs_with_different_labels']} sibling pairs "
             f"with different labels; best sibling's label {show(ranking['best_label'].get(OVERALL))}"]
    for name, entry in ranking["scorers"].items():
        overall = entry.get(OVERALL) or {}
        sign = " (read as lower is better)" if ranking.get("orientation", {}).get(name) == -1 else ""
        lines.append(f"{name}{sign}: pairwise accuracy {show(overall.get('pairwise_accuracy'))}, top-1 regret "
                     f"{show(overall.get('top1_regret'))}, pick label {show(overall.get('pick_label'))}, AUROC "
                     f"{(prm['global'].get(name) or {}).get('auroc')}")
    return "\n".join(lines)
