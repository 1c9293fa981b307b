"""Pipeline stages as plain functions: each reads its inputs, computes, and writes one record file.

The rule scripts in ``workflow_scripts/`` only unpack ``snakemake.input/output/params`` and call these.
``settings`` is always the rule's params: the config sections the stage depends on (its rerun trigger).
"""

from __future__ import annotations

import collections
import logging

from clemprm import distributed, records
from clemprm.play.catalog import GameCatalog
from clemprm.play.clembench_tree import episode_entry, model_infos, run_dir_name, write_results_tree
from clemprm.checks.run_time import check_episodes, check_instances, marks_metadata
from clemprm.config import provenance
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine

log = logging.getLogger(__name__)


def summarize(rows: list[dict]) -> str:
    """One line per game: episodes, % played, success rate, mean BENCH_SCORE of played episodes."""
    by_game = collections.defaultdict(list)
    for row in rows:
        by_game[row["game"]].append(row)
    lines = []
    for game, game_rows in sorted(by_game.items()):
        played = [row for row in game_rows if not row["aborted"]]
        quality = sum(row["bench_score"] for row in played) / len(played) if played else float("nan")
        lines.append(f"{game}: {len(game_rows)} episodes, {100 * len(played) / len(game_rows):.0f}% played, "
                     f"{100 * sum(row['success'] for row in game_rows) / len(game_rows):.0f}% success, "
                     f"quality {quality:.1f}, errors {sum(row['error'] is not None for row in game_rows)}")
    return "\n".join(lines)


def base_rollouts(settings: dict, output: str, cache_dir: str | None = None, policy=None,
                  on_failure: str = "stop", clembench_dir: str | None = None) -> list[dict]:
    """The base policy plays the train split of every configured game (``episodes_per_instance`` times each).
    Fails (:mod:`clemprm.checks.run_time`) when a game has no train instance or every episode of a game failed,
    unless ``on_failure`` is continue (then the file's provenance records what it went on despite). With
    ``clembench_dir`` (``base_rollouts.clembench_tree``) the episodes are also written there as a clembench results
    tree, run folder ``<policy>-base_rollouts`` (:mod:`clemprm.play.clembench_tree`)."""
    rollout = settings["base_rollouts"]
    catalog = GameCatalog(settings["games"], settings["seed"])
    marks = check_instances("base_rollouts", catalog, "train", on_failure)
    instances = catalog.all_instances("train")
    if policy is None:
        from clemprm.models.generation import load_policy   # torch: imported by the jobs that generate

        policy = load_policy(settings["model"], cache_dir)
    sampling = Sampling(rollout["temperature"], rollout["top_p"], rollout["max_new_tokens"])
    log.info("base rollouts: %d train instances x %d episodes, policy %s", len(instances),
             rollout["episodes_per_instance"], policy.name)
    run_dir, infos = run_dir_name(policy.name, "base_rollouts"), model_infos(policy, sampling)
    played = RolloutEngine(catalog, sampling).play_described(
        instances, [policy], repeats=rollout["episodes_per_instance"], base_seed=settings["seed"],
        stage="base_rollouts", policy_name=policy.name,
        describe=(lambda episode: episode_entry(episode, run_dir, infos)) if clembench_dir is not None else None)
    rows = [row for row, _ in played]
    log.info("played %d episodes\n%s", len(rows), summarize(rows))
    marks += check_episodes("base_rollouts", rows, on_failure)
    records.write_records(output, rows, records.EPISODES, {**provenance(settings), **marks_metadata(marks)})
    if clembench_dir is not None:
        tree = write_results_tree(clembench_dir, run_dir, [entry for _, entry in played], infos=infos,
                                  info={"stage": "base_rollouts", "split": "train"})
    if distributed.is_main():   # rank 0 alone writes (records.write_records, write_results_tree)
        log.info("wrote %d episodes to %s%s", len(rows), output,
                 f" and a clembench results tree in {tree}" if clembench_dir is not None else "")
    return rows


def outcome(row: dict) -> str:
    return "aborted" if row["aborted"] else "success" if row["success"] else "lose"


def interactions_of(row: dict) -> list[dict]:
    """playpen-data `interactions` rows of one episode: each LLM player's final perspective with its answer."""
    last_turn_of_player = {}
    for turn in row["turns"]:
        last_turn_of_player[turn["player"]] = turn
    return [{
        "messages": turn["messages"] + [{"role": "assistant", "content": turn["response"]}],
        "meta": {"game": row["game"], "experiment": row["experiment"], "task_id": row["game_id"],
                 "player_name": player, "game_role": turn["game_role"], "model": row["policy"],
                 "outcome": outcome(row)},
    } for player, turn in sorted(last_turn_of_player.items())]


def win_filter(settings: dict, episodes_path: str, output: str) -> list[dict]:
    """Keep winning episodes (clembench ``Success``, BENCH_SCORE >= threshold) as SFT data."""
    rules = settings["win_filter"]
    episodes = records.read_records(episodes_path, records.EPISODES, splits=records.TRAIN_SPLITS)
    kept = [row for row in episodes
            if (row["success"] or not rules["require_success"]) and not row["aborted"]
            and row["bench_score"] >= rules["min_bench_score"]]
    rows = [interaction for row in kept for interaction in interactions_of(row)]
    records.write_records(output, rows, records.INTERACTIONS, provenance(settings))
    log.info("win filter: kept %d of %d episodes -> %d player perspectives in %s\n%s", len(kept), len(episodes),
             len(rows), output, summarize(kept) if kept else "(no episode kept)")
    return rows
