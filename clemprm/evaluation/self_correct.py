"""Eval mode ``self_correct``: two greedy attempts per instance, for the SFT and the SCoRe policy, and its summary.

Playing (:func:`evaluate_self_correct`): per ``eval.split`` instance of ``score.games`` (``eval.episodes_per_instance``
times) attempt 1 is an episode as every eval mode plays it (the same episode ids and seeds: the SFT policy's
attempt 1 is ``greedy_sft``'s episode), then attempt 2 starts from it (:mod:`clemprm.rl.attempts`), both greedy; once
with the SFT policy (``model`` + the SFT adapter), once with the SCoRe policy (+ ``results/score/adapter``). Rows:
:data:`clemprm.records.SELF_CORRECT_EPISODES` (the eval episode columns, ``attempt`` 1 or 2, ``policy_role`` sft or
score); an attempt pair shares its ``episode_id``.

Summary (:func:`self_correction_summary`, ``self_correction`` in ``results/prm_eval.json``): the SCoRe paper's table
per policy, per game and overall (the macro average over games): Accuracy@t1 and Accuracy@t2 (success rate, %),
delta(t1, t2) = Accuracy@t2 - Accuracy@t1, delta i->c (% of episodes wrong at t1 and right at t2), delta c->i (% right
at t1 and wrong at t2; delta(t1, t2) = delta i->c - delta c->i), plus % played and quality (mean BENCH_SCORE of the
played episodes) per attempt; each with the eval's percentile bootstrap interval over instances resampled within each
game (:mod:`clemprm.stats`), and SCoRe minus SFT on each with paired draws.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pandas as pd

from clemprm import records, stats
from clemprm.play.clembench_tree import model_infos, run_dir_name
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.rl.attempts import score_games_config, start_second_attempt
from clemprm.search import greedy_cost
from clemprm.stages.rollouts import Played, RunFolder, describer, play_split
from clemprm.stats import OVERALL, derive_seed

log = logging.getLogger(__name__)

MODE = "self_correct"
ROLES = ("sft", "score")
METRICS = ("accuracy_t1", "accuracy_t2", "delta_t1_t2", "delta_i_to_c", "delta_c_to_i", "percent_played_t1",
           "percent_played_t2", "quality_t1", "quality_t2")


def play_two_attempts(engine: RolloutEngine, policy, instances, *, role: str, settings: dict,
                      clembench_dir: str | None = None) -> Played:
    """Attempt 1, then attempt 2, of every instance with ``policy``, greedy: the rows of both, and a run folder per
    attempt (``<policy>-self_correct_<role>_attempt<1|2>``)."""
    eval_settings, seed = settings["eval"], settings["seed"]
    infos = model_infos(policy, engine.sampling)
    first = engine.start_all(instances, [policy], repeats=eval_settings["episodes_per_instance"], base_seed=seed,
                             stage="eval")
    engine.run(first, label=f"{MODE} {role} attempt 1")
    first_rows = [episode.record(policy.name, engine.sampling) for episode in first]
    second = [start_second_attempt(engine, episode.instance, [policy], row, row["episode_id"],
                                   derive_seed(seed, "eval attempt 2", row["episode_id"]),
                                   settings["score"]["instruction"])
              for episode, row in zip(first, first_rows)]
    engine.run(second, label=f"{MODE} {role} attempt 2")
    rows, folders = [], []
    for attempt, episodes, attempt_rows in ((1, first, first_rows),
                                            (2, second, [e.record(policy.name, engine.sampling) for e in second])):
        run_dir = run_dir_name(policy.name, f"{MODE}_{role}_attempt{attempt}")
        describe = describer(clembench_dir, run_dir, infos)
        for episode, row in zip(episodes, attempt_rows):
            cost = greedy_cost(episode)
            rows.append({**row, "mode": MODE, "policy_tokens": cost.policy_tokens, "prm_pairs": 0,
                         "search_nodes": cost.nodes, "attempt": attempt, "policy_role": role})
        folders.append(RunFolder(run_dir, infos, {"mode": MODE, "policy_role": role, "attempt": attempt,
                                                  "split": eval_settings["split"]},
                                 [describe(episode) if describe else None for episode in episodes]))
    return Played(f"eval {MODE} ({role})", rows, folders)


def evaluate_self_correct(settings: dict, output: str, cache_dir: str | None = None, *, sft_adapter: str | None,
                          score_adapter: str | None, policies: dict | None = None,
                          on_failure: str = "stop", clembench_dir: str | None = None) -> list[dict]:
    """Play mode ``self_correct`` (module docstring) and write its parquet. ``settings``: the mode's eval params +
    ``score`` (its games and instruction). ``policies`` ({"sft": ..., "score": ...}) replaces the loaded policies
    (tests). ``clembench_dir``: where the episodes go as a clembench results tree
    (:mod:`clemprm.play.clembench_tree`), one run folder per policy and attempt,
    ``<policy>-self_correct_<sft|score>_attempt<1|2>``."""
    eval_settings = settings["eval"]
    adapters = {"sft": sft_adapter, "score": score_adapter}

    def load(role: str):
        from clemprm.models.generation import load_policy
        from clemprm.models.loader import policy_settings

        if policies is not None:
            return policies[role]
        if not adapters[role]:
            raise ValueError(f"eval mode {MODE} plays the {role} policy: give its adapter folder")
        return load_policy(policy_settings(settings["model"], adapters[role]), cache_dir)

    def play(engine: RolloutEngine, instances: list) -> tuple[list[Played], dict]:
        played, run_policies = [], {}
        start = time.perf_counter()
        for role in ROLES:
            policy = load(role)
            log.info("eval %s: %s policy %s, %d %s instances x %d episodes x 2 attempts", MODE, role, policy.name,
                     len(instances), eval_settings["split"], eval_settings["episodes_per_instance"])
            role_start = time.perf_counter()
            played.append(play_two_attempts(engine, policy, instances, role=role, settings=settings,
                                            clembench_dir=clembench_dir))
            stats = getattr(policy, "stats", None)
            run_policies[role] = {"name": policy.name, "adapter": adapters[role],
                                  "wall_seconds": round(time.perf_counter() - role_start, 3),
                                  "stats": stats.as_dict() if hasattr(stats, "as_dict") else None}
            del policy   # before the next role's policy is loaded
        log_summary([row for part in played for row in part.rows], settings["seed"])
        return played, {"mode": MODE, "wall_seconds": round(time.perf_counter() - start, 3), "policies": run_policies}

    return play_split(f"eval {MODE}", settings, eval_settings["split"],
                      Sampling(0.0, 1.0, eval_settings["max_new_tokens"]), play, output,
                      records.SELF_CORRECT_EPISODES, on_failure=on_failure, clembench_dir=clembench_dir,
                      games=score_games_config(settings["games"], settings["score"]["games"]),
                      per_game=eval_settings["max_instances"])


def log_summary(rows: list[dict], seed: int) -> None:
    """Each policy's overall accuracy and % played at attempts 1 and 2 (a point estimate: one bootstrap draw)."""
    summary = self_correction_summary(rows, samples=1, seed=seed, ci=0.95)
    for role, entry in summary["policies"].items():
        overall = entry["results"][OVERALL]
        log.info("eval %s %s: accuracy t1 %.1f%% -> t2 %.1f%% (i->c %.1f, c->i %.1f), played %.1f%% -> %.1f%%", MODE,
                 role, *(overall[metric]["value"] or 0.0 for metric in
                         ("accuracy_t1", "accuracy_t2", "delta_i_to_c", "delta_c_to_i", "percent_played_t1",
                          "percent_played_t2")))


# ------------------------------------------------------------------------------------------------ metrics


def pair_table(rows: list[dict]) -> pd.DataFrame:
    """Per instance ``(game, experiment, game_id)``, sorted: attempt pairs, and per attempt the played episodes,
    their summed BENCH_SCORE and the successes, plus the pairs wrong -> right and right -> wrong."""
    attempts = {(row["episode_id"], row["attempt"]): row for row in rows}
    pairs = [(row, attempts[(row["episode_id"], 2)]) for row in rows
             if row["attempt"] == 1 and (row["episode_id"], 2) in attempts]
    frame = pd.DataFrame({
        "game": [a["game"] for a, _ in pairs], "experiment": [a["experiment"] for a, _ in pairs],
        "game_id": [a["game_id"] for a, _ in pairs], "episodes": [1] * len(pairs),
        **{f"{what}{t}": [value(pair[t - 1]) for pair in pairs] for t in (1, 2) for what, value in (
            ("played", lambda row: not row["aborted"]),
            ("score", lambda row: 0.0 if row["aborted"] else row["bench_score"]),
            ("success", lambda row: bool(row["success"])))},
        "i_to_c": [not a["success"] and bool(b["success"]) for a, b in pairs],
        "c_to_i": [bool(a["success"]) and not b["success"] for a, b in pairs]})
    return frame.groupby(["game", "experiment", "game_id"]).sum()


def pair_metrics(table: pd.DataFrame, weights: np.ndarray) -> dict[str, np.ndarray]:
    """The metrics of one game, one per row of ``weights`` (draws x instances)."""
    sums = {column: weights @ table[column].to_numpy(float) for column in table.columns}
    episodes = sums["episodes"]
    metrics = {}
    for t in (1, 2):
        with np.errstate(invalid="ignore", divide="ignore"):
            metrics[f"quality_t{t}"] = np.where(sums[f"played{t}"] > 0, sums[f"score{t}"] / sums[f"played{t}"], np.nan)
        metrics[f"percent_played_t{t}"] = 100 * sums[f"played{t}"] / episodes
        metrics[f"accuracy_t{t}"] = 100 * sums[f"success{t}"] / episodes
    metrics["delta_t1_t2"] = metrics["accuracy_t2"] - metrics["accuracy_t1"]
    metrics["delta_i_to_c"] = 100 * sums["i_to_c"] / episodes
    metrics["delta_c_to_i"] = 100 * sums["c_to_i"] / episodes
    return metrics


def pair_statistic(tables: dict[str, pd.DataFrame], weights: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per game and overall (every metric averaged over games): a :data:`clemprm.stats.Statistic` of
    :func:`pair_table` rows."""
    per_game = {game: pair_metrics(table, weights[game]) for game, table in tables.items()}
    return {**per_game, OVERALL: stats.macro_average(list(per_game.values()), METRICS)}


def self_correction_summary(rows: list[dict], samples: int, seed: int, ci: float) -> dict:
    """The ``self_correction`` entry of ``results/prm_eval.json`` (module docstring) from the mode's rows."""
    def counted(result: dict, table: pd.DataFrame) -> dict:
        for game, part in stats.split_by_game(table).items():
            result[game].update(episodes=int(part["episodes"].sum()), instances=len(part))
        result[OVERALL].update(episodes=int(table["episodes"].sum()), instances=len(table))
        return result

    def estimate(table: pd.DataFrame) -> dict:
        return counted(stats.bootstrap(stats.split_by_game(table), pair_statistic, samples, seed, ci), table)

    by_role = {role: [row for row in rows if row["policy_role"] == role] for role in ROLES}
    tables = {role: pair_table(role_rows) for role, role_rows in by_role.items() if role_rows}
    summary = {"policies": {role: {"policy": by_role[role][0]["policy"], "results": estimate(tables[role])}
                            for role in tables},
               "difference": {}}
    if set(tables) == set(ROLES):
        score, sft = tables["score"], tables["sft"]
        difference = stats.paired_difference(score, sft, pair_statistic, samples, seed, ci, macro=METRICS)
        if difference:
            common = score.index.intersection(sft.index)
            summary["difference"] = {"score_minus_sft": counted(difference, score.loc[common])}
    return summary
