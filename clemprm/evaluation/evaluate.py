"""PRM-guided evaluation: each mode plays the eval split; one summary with bootstrap CIs (``results/prm_eval.json``).

Modes (each its own rule and ``results/eval/<mode>.parquet``, rows of :data:`clemprm.records.EVAL_EPISODES`):

``greedy_base``  the base policy (``model``), temperature 0
``greedy_sft``   the SFT policy (``model`` + the SFT adapter), temperature 0
``greedy_rl_grpo``, ``greedy_rl_prime``  the RL policy of that algorithm (``model`` + the RL adapter of
                 ``rl_adapter``, ``results/rl/<algorithm>/adapter``), temperature 0
``random_of_n``  the SFT policy; the same N candidates per turn as ``best_of_n``, one played at random: the
                 control that tells what the PRM's ranking adds to sampling N answers
``best_of_n``    the SFT policy; N sampled candidates per turn, the PRM's favourite is played
``beam_search``  the SFT policy; beams of forked games ranked by the PRM
``greedy_merged`` the merged SFT checkpoint (``results/merged/sft``, :mod:`clemprm.stages.merge`), temperature 0: on CPU in
                 fp32 it plays the episodes of ``greedy_sft``; only played when listed in ``eval.modes``
``best_of_n_implicit``  ``best_of_n`` with PRIME's implicit PRM (:mod:`clemprm.rl.implicit_scorer`) instead of the
                 Monte-Carlo PRM: the same candidates (same seeds), another ranking
``best_of_n_logprob``, ``beam_search_logprob``  the same searches ranking by the policy's own mean token
                 log-probability (:mod:`clemprm.search.logprob`): the PRM-free pick a PRM must beat
``self_correct``  SCoRe's two attempts per instance (greedy) for the SFT and the SCoRe policy
                 (:mod:`clemprm.rl.self_correction`); summarized apart, as ``self_correction`` (not in ``modes``)

All modes play the same instances with the same episode seeds, so they pair by instance
``(game, experiment, game_id)``.

The summary gives, per mode, per game and overall: episodes, % played, quality (mean BENCH_SCORE of the played
episodes), clemscore and success rate. Overall is clembench's macro average: % played, quality and success
rate are averaged over games (a game without a played episode has no quality and is left out of that mean),
clemscore = overall % played / 100 x overall quality (0 when nothing was played). Confidence intervals are
percentile bootstrap intervals over *instances*, resampled within each game (every game keeps its size; all
episodes of a drawn instance come along). Differences of every mode to ``greedy_sft``, ``greedy_base``,
``random_of_n``, ``best_of_n_logprob`` and ``greedy_rl_grpo`` (so PRIME's policy is compared with GRPO's) use
paired draws: the same resampled instances for both modes. Draws are seeded per game from ``seed``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import jsonschema
import numpy as np
import pandas as pd

from clemprm import records
from clemprm.play.catalog import GameCatalog
from clemprm.checks.run_time import (check_episodes, check_instances, failures_by_game, marks_metadata,
                                     read_failure_marks)
from clemprm.config import EVAL_MODE_KEYS, EVAL_PRM_MODES, provenance
from clemprm.play.engine import Episode, RolloutEngine, Sampling, derive_seed
from clemprm.stages.labels import sft_policy_settings
from clemprm.search import RandomScorer, SearchCost, greedy_cost
from clemprm.search.beam_search import beam_search
from clemprm.search.best_of_n import best_of_n
from clemprm.search.logprob import LogprobScorer
from clemprm.stages.sft import write_json
from clemprm.stages.rollouts import load_policy, summarize

log = logging.getLogger(__name__)

SELF_CORRECT = "self_correct"   # two attempts x two policies (clemprm.rl.self_correction), not a one-policy mode
MODES = tuple(mode for mode in EVAL_MODE_KEYS if mode != SELF_CORRECT)
PRM_MODES = EVAL_PRM_MODES
LOGPROB_MODES = ("best_of_n_logprob", "beam_search_logprob")  # scored by the policy's mean token log-probability
SAMPLING_MODES = tuple(mode for mode, keys in EVAL_MODE_KEYS.items() if "temperature" in keys)
BASELINES = ("greedy_sft", "greedy_base", "random_of_n", "best_of_n_logprob", "greedy_rl_grpo")
RL_MODE_PREFIX = "greedy_rl_"   # + the algorithm
METRICS = ("percent_played", "quality", "clemscore", "success_rate")
OVERALL = "overall"
SCHEMA_PATH = Path(__file__).with_name("prm_eval.schema.json")


# ------------------------------------------------------------------------------------------------ playing


def mode_sampling(mode: str, eval_settings: dict) -> Sampling:
    """Greedy modes decode at temperature 0; the searches sample their candidates."""
    if mode in SAMPLING_MODES:
        return Sampling(eval_settings["temperature"], eval_settings["top_p"], eval_settings["max_new_tokens"])
    return Sampling(0.0, 1.0, eval_settings["max_new_tokens"])


def play(mode: str, engine: RolloutEngine, episodes: list[Episode], prm,
         eval_settings: dict) -> tuple[list[Episode], list[SearchCost]]:
    """Play the started ``episodes`` in ``mode``: the episodes that count, and what each one cost."""
    if mode in ("best_of_n", "best_of_n_implicit", "best_of_n_logprob"):
        return episodes, best_of_n(engine, episodes, prm, eval_settings["n"], engine.sampling, label=mode)
    if mode == "random_of_n":
        costs = best_of_n(engine, episodes, prm, eval_settings["n"], engine.sampling, label=mode)
        for cost in costs:
            cost.prm_pairs = 0  # a random pick scores nothing
        return episodes, costs
    if mode in ("beam_search", "beam_search_logprob"):
        return beam_search(engine, episodes, prm, n=eval_settings["n"], beam_width=eval_settings["beam_width"],
                           iterations=eval_settings["num_beam_iterations"], sampling=engine.sampling,
                           aggregation=eval_settings["aggregation"])
    engine.run(episodes, label=mode)
    return episodes, [greedy_cost(episode) for episode in episodes]


def stats_dict(stats) -> dict | None:
    """A model's running counters as a dict (a dataclass with ``as_dict``, or a plain dict), None if it has none."""
    if stats is None:
        return None
    return stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)


def run_info(mode: str, seconds: float, policy, prm, prm_adapter: str | None) -> dict:
    """What the summary reports of a mode's run: wall seconds of play, the policy and the PRM with their counters."""
    cfg = getattr(policy, "cfg", None)
    return {"mode": mode, "wall_seconds": round(seconds, 3),
            "policy": {"name": policy.name, "spec": getattr(cfg, "spec", None),
                       "adapter": getattr(cfg, "adapter", None), "stats": stats_dict(getattr(policy, "stats", None))},
            "prm": None if prm is None else {"adapter": prm_adapter, "stats": stats_dict(getattr(prm, "stats", None))}}


def evaluate_mode(mode: str, settings: dict, output: str, cache_dir: str | None = None, sft_adapter: str | None = None,
                  prm_adapter: str | None = None, *, merged_model: str | None = None, rl_adapter: str | None = None,
                  policy=None, prm=None, on_failure: str = "stop", score_adapter: str | None = None) -> list[dict]:
    """Play the ``eval.split`` instances of every configured game in ``mode``; write the per-episode parquet.

    ``settings``: the rule's params (:func:`clemprm.config.eval_mode_params`: seed, model, games, the mode's eval
    keys; prm for the PRM modes). ``policy`` and ``prm`` replace the loaded models (tests; ``random_of_n``
    always picks with a :class:`~clemprm.search.RandomScorer`; the ``*_logprob`` modes score with a
    :class:`~clemprm.search.logprob.LogprobScorer` of ``policy`` unless ``prm`` is given). The parquet's provenance
    also holds the run (policy, PRM adapter, wall seconds of play, model counters) and the failure marks of
    ``on_failure: continue`` (a mode in which every episode of a game failed otherwise fails,
    :mod:`clemprm.checks.run_time`).
    ``merged_model``: the merged SFT folder (:mod:`clemprm.stages.merge`) that ``greedy_merged`` plays.
    """
    if mode == SELF_CORRECT:   # SCoRe's mode (settings: + score)
        from clemprm.rl.self_correction import evaluate_self_correct

        return evaluate_self_correct(settings, output, cache_dir, sft_adapter=sft_adapter, score_adapter=score_adapter,
                                     on_failure=on_failure)
    if mode not in MODES:
        raise ValueError(f"unknown eval mode {mode!r} (known: {', '.join(MODES + (SELF_CORRECT,))})")
    eval_settings = settings["eval"]
    catalog = GameCatalog(settings["games"])
    split_marks = check_instances(f"eval {mode}", catalog, eval_settings["split"], on_failure)
    instances = catalog.all_instances(eval_settings["split"])
    if policy is None and mode == "greedy_merged":
        if not merged_model:
            raise ValueError("eval mode greedy_merged plays the merged SFT checkpoint: give its folder")
        policy = load_policy({**settings["model"], "spec": str(merged_model), "adapter": None}, cache_dir)
    if policy is None and mode.startswith(RL_MODE_PREFIX):
        if not rl_adapter:
            raise ValueError(f"eval mode {mode} plays the RL policy: give the RL adapter folder")
        policy = load_policy(sft_policy_settings(settings["model"], rl_adapter), cache_dir)
    if policy is None:
        if mode != "greedy_base" and not sft_adapter:
            raise ValueError(f"eval mode {mode} plays the SFT policy: give the SFT adapter folder")
        model = settings["model"] if mode == "greedy_base" else sft_policy_settings(settings["model"], sft_adapter)
        policy = load_policy(model, cache_dir)
    if mode in PRM_MODES and prm is None:
        from clemprm.stages.prm import load_prm

        prm = load_prm(settings["model"], settings["prm"], prm_adapter, cache_dir)
    if mode == "best_of_n_implicit" and prm is None:
        from clemprm.rl.implicit_scorer import load_implicit_prm

        prm = load_implicit_prm(settings["model"], rl_adapter, sft_adapter, settings["rl"]["prime"]["beta"], cache_dir)
        prm_adapter = f"{rl_adapter}/prm"
    if mode == "random_of_n":
        prm = RandomScorer(settings["seed"])
    if mode in LOGPROB_MODES and prm is None:
        prm = LogprobScorer(policy)
    engine = RolloutEngine(catalog, mode_sampling(mode, eval_settings))
    log.info("eval %s: %d %s instances x %d episodes, policy %s", mode, len(instances), eval_settings["split"],
             eval_settings["episodes_per_instance"], policy.name)
    start = time.perf_counter()
    # one stage name for every mode: the same episode seeds, so modes pair episode by episode
    episodes = engine.start_all(instances, [policy], repeats=eval_settings["episodes_per_instance"],
                                base_seed=settings["seed"], stage="eval")
    episodes, costs = play(mode, engine, episodes, prm, eval_settings)
    seconds = time.perf_counter() - start
    rows = [{**episode.record(policy.name, engine.sampling), "mode": mode, "policy_tokens": cost.policy_tokens,
             "prm_pairs": cost.prm_pairs, "search_nodes": cost.nodes} for episode, cost in zip(episodes, costs)]
    log.info("eval %s: %d episodes in %.0f s\n%s", mode, len(rows), seconds, summarize(rows) if rows else "(no episode)")
    marks = split_marks + check_episodes(f"eval {mode}", rows, on_failure)
    scorer = prm if mode in PRM_MODES + LOGPROB_MODES + ("best_of_n_implicit",) else None
    run = run_info(mode, seconds, policy, scorer, prm_adapter)
    records.write_records(output, rows, records.EVAL_EPISODES,
                          {**provenance(settings), "run": run, **marks_metadata(marks)})
    log.info("eval %s -> %s", mode, output)
    return rows


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


def macro(per_game: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Overall metrics, clembench's way: averages over games; clemscore from the averaged % played and quality."""
    def stack(metric):
        return np.vstack([metrics[metric] for metrics in per_game])

    percent_played = stack("percent_played").mean(axis=0)
    qualities = stack("quality")
    defined = ~np.isnan(qualities)
    quality = np.where(defined.any(axis=0), np.nansum(qualities, axis=0) / np.maximum(defined.sum(axis=0), 1), np.nan)
    return {"percent_played": percent_played, "quality": quality, "clemscore": clemscore(percent_played, quality),
            "success_rate": stack("success_rate").mean(axis=0)}


def metric_arrays(tables: dict[str, pd.DataFrame], weights: dict[str, np.ndarray]) -> dict[str, dict]:
    """Metric arrays per game and overall under per-game instance ``weights``."""
    per_game = {game: game_metrics(table, weights[game]) for game, table in tables.items()}
    return {**per_game, OVERALL: macro(list(per_game.values()))}


def bootstrap_weights(tables: dict[str, pd.DataFrame], samples: int, seed: int) -> dict[str, np.ndarray]:
    """Per game, ``samples`` draws of its instances with replacement (as counts), seeded per game and size: two
    modes on the same instances get the same draws (paired), and a game's draws do not depend on other games."""
    weights = {}
    for game, table in tables.items():
        rng = np.random.default_rng(derive_seed(seed, "bootstrap", game, len(table)))
        weights[game] = rng.multinomial(len(table), np.full(len(table), 1 / len(table)), size=samples)
    return weights


def interval(point: float, draws: np.ndarray, ci: float) -> dict:
    """Point estimate and percentile bootstrap interval; null where undefined (e.g. quality with nothing played)."""
    draws = draws[~np.isnan(draws)]
    if math.isnan(point) or not draws.size:
        return {"value": None, "ci_low": None, "ci_high": None}
    low, high = np.percentile(draws, [50 * (1 - ci), 50 * (1 + ci)])
    return {"value": float(point), "ci_low": float(low), "ci_high": float(high)}


def estimates(points: dict[str, dict], draws: dict[str, dict], ci: float) -> dict[str, dict]:
    return {group: {metric: interval(points[group][metric][0], draws[group][metric], ci) for metric in METRICS}
            for group in points}


def split_by_game(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    return {game: part for game, part in table.groupby(level="game", sort=True)}


def mode_estimates(table: pd.DataFrame, samples: int, seed: int, ci: float, rows: list[dict] | None = None) -> dict:
    """Metrics of one mode per game and overall, with bootstrap CIs and episode/instance counts; with the mode's
    episode ``rows``, also the failed episodes (an exception in game code or scorer) and the first error per game."""
    tables = split_by_game(table)
    points = metric_arrays(tables, {game: np.ones((1, len(part))) for game, part in tables.items()})
    result = estimates(points, metric_arrays(tables, bootstrap_weights(tables, samples, seed)), ci)
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
    they share none)."""
    common = table.index.intersection(baseline.index)
    if common.empty:
        return {}
    a, b = split_by_game(table.loc[common]), split_by_game(baseline.loc[common])
    ones = {game: np.ones((1, len(part))) for game, part in a.items()}
    weights = bootstrap_weights(a, samples, seed)
    points = _subtract(metric_arrays(a, ones), metric_arrays(b, ones))
    result = estimates(points, _subtract(metric_arrays(a, weights), metric_arrays(b, weights)), ci)
    for group in result:
        result[group]["instances"] = len(common) if group == OVERALL else len(a[group])
    return result


def _subtract(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    return {group: {metric: a[group][metric] - b[group][metric] for metric in METRICS} for group in a}


# ------------------------------------------------------------------------------------------------ summary


def mode_cost(rows: list[dict], run: dict) -> dict:
    return {"policy_tokens": sum(row["policy_tokens"] for row in rows),
            "prm_pairs": sum(row["prm_pairs"] for row in rows),
            "search_nodes": sum(row["search_nodes"] for row in rows),
            "wall_seconds": run.get("wall_seconds")}


RANKING_SCORERS = ("prm", "constant_mean", "game_mean", "candidate_length", "policy_logprob")
GLOBAL_KEYS = ("n", "bce", "mse", "pearson", "spearman", "auroc")


def prm_summary(prm_metrics: dict) -> dict | None:
    """The PRM stage's held-out metrics (``results/prm/metrics.json``, on its ranked side: the validation-split
    branch points, else the validation slice of train instances) as the summary
    shows them: ``global`` (BCE, MSE, correlations and AUROC against the labels, across states) and ``ranking``
    (within-prefix pairwise accuracy, top-1 regret and the label of the pick among siblings, with bootstrap CIs,
    :func:`clemprm.stages.prm.ranking_metrics`), for the PRM and every baseline; ``constant_mean`` and ``game_mean`` tie all
    siblings of a state: their pick is a random pick's expectation. None when the PRM was not trained."""
    ranking = prm_metrics.get("ranking")
    if not ranking:
        return None
    side = ranking.get("side", "validation")
    blocks = {"prm": (prm_metrics.get("evaluation") or {}).get(side),
              **{name: (entry or {}).get(side) for name, entry in (prm_metrics.get("baselines") or {}).items()}}
    return {"side": side, "instances": (prm_metrics.get("examples") or {}).get(f"{side}_instances"),
            "loss": prm_metrics.get("loss"), "pairwise_weight": prm_metrics.get("pairwise_weight"),
            "global": {name: {key: block.get(key) for key in GLOBAL_KEYS if key in block}
                       for name, block in blocks.items() if name in RANKING_SCORERS and block},
            "ranking": {key: value for key, value in ranking.items() if key != "side"}}


def summarize_eval(settings: dict, mode_paths: list[str], output: str, upstream_paths: list[str] = (),
                   prm_metrics_path: str | None = None) -> dict:
    """Read every mode's episodes, compute the summary and write it as JSON (validated against its schema).

    ``upstream_paths``: the outputs of the earlier stages the modes were built from (base rollouts, SFT metrics,
    branch points, soft labels); their failure marks (:mod:`clemprm.checks.run_time`), then the modes' own, are the
    summary's ``upstream_warnings``, and their messages its ``warnings``. ``prm_metrics_path``: the PRM stage's
    metrics, whose held-out ranking and global metrics the summary repeats (:func:`prm_summary`)."""
    eval_settings = settings["eval"]
    samples, ci, seed = eval_settings["bootstrap_samples"], eval_settings["ci"], settings["seed"]
    runs = {}
    for path in mode_paths:
        run = records.read_provenance(path).get("run", {})
        mode = run.get("mode") or Path(path).stem
        schema = records.SELF_CORRECT_EPISODES if mode == SELF_CORRECT else records.EVAL_EPISODES
        runs[mode] = (records.read_records(path, schema), run)
    self_correct = runs.pop(SELF_CORRECT, None)   # attempt pairs of two policies: its own entry
    marks = [mark for path in [*upstream_paths, *mode_paths] for mark in read_failure_marks(path)]
    tables = {mode: instance_table(rows) for mode, (rows, _) in runs.items() if rows}
    summary = {
        "split": eval_settings["split"],
        "bootstrap": {"samples": samples, "ci": ci, "seed": seed, "unit": "instance (game, experiment, game_id)",
                      "resampling": "within each game", "interval": "percentile"},
        "modes": {mode: {"policy": run.get("policy"), "prm": run.get("prm"), "cost": mode_cost(rows, run),
                         "results": mode_estimates(tables[mode], samples, seed, ci, rows) if mode in tables else {}}
                  for mode, (rows, run) in runs.items()},
        # on_failure: continue let these stages go on despite a fail-fast condition (in pipeline order)
        "upstream_warnings": marks,
        "warnings": [mark["message"] for mark in marks],
        "differences": {baseline: {mode: difference(tables[mode], tables[baseline], samples, seed, ci)
                                   for mode in tables if mode != baseline}
                        for baseline in BASELINES if baseline in tables},
        **provenance(settings),
    }
    if prm_metrics_path is not None:
        summary["prm"] = prm_summary(json.loads(Path(prm_metrics_path).read_text()))
    if self_correct is not None:
        from clemprm.rl.self_correction import self_correction_summary

        summary["self_correction"] = self_correction_summary(self_correct[0], samples, seed, ci)
    jsonschema.validate(summary, json.loads(SCHEMA_PATH.read_text()))
    write_json(output, summary)
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
            lines.append(f"{mode}: {overall['episodes']} episodes, % played {show(overall['percent_played'])}, "
                         f"quality {show(overall['quality'])}, clemscore {show(overall['clemscore'])}, "
                         f"success {show(overall['success_rate'])}, failed episodes {overall.get('errors', 0)}; "
                         f"cost {entry['cost']}")
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
