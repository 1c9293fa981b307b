"""Playing a split of the games, once for every stage that plays one (:func:`play_split`: base rollouts, the eval
modes, self-correction), and the stages of base rollouts and the win filter.

The rule scripts in ``workflow_scripts/`` only unpack ``snakemake.input/output/params`` and call these.
``settings`` is always the rule's params: the config sections the stage depends on (its rerun trigger).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Callable

from clemprm import distributed, records
from clemprm.play.catalog import GameCatalog, Instance
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


@dataclass
class RunFolder:
    """One run folder of a clembench results tree (:mod:`clemprm.play.clembench_tree`): the entries of the episodes
    one policy played one way (:func:`describer`'s, None where no tree is written), the model ``infos`` and the
    ``info`` its ``run.json`` holds."""

    name: str
    infos: dict
    info: dict
    entries: list[dict | None]


def describer(clembench_dir: str | None, run_dir: str, infos: dict):
    """What describes a played episode for run folder ``run_dir`` (``describe`` of
    :meth:`~clemprm.play.engine.RolloutEngine.play_described`): its results-tree entry, or nothing without a tree."""
    return (lambda episode: episode_entry(episode, run_dir, infos)) if clembench_dir is not None else None


@dataclass
class Played:
    """What one policy played of a split: its episodes' rows, checked together under ``label``
    (:func:`clemprm.checks.run_time.check_episodes`), and their run folders."""

    label: str
    rows: list[dict]
    folders: list[RunFolder]


PlayPolicies = Callable[[RolloutEngine, list[Instance]], tuple[list[Played], dict | None]]
"""How a caller of :func:`play_split` loads its policies and plays the instances: each policy's :class:`Played`, and
the run the records' provenance holds (None: none)."""


def play_split(label: str, settings: dict, split: str, sampling: Sampling, play: PlayPolicies, output: str, schema, *,
               on_failure: str, clembench_dir: str | None = None, games: dict | None = None,
               per_game: int | None = None) -> list[dict]:
    """Play the ``split`` instances of ``games`` (default: the configured ones, ``settings["games"]``), at most
    ``per_game`` of each game (the first of the split's draw; None: all), and write them: the one skeleton of base
    rollouts, every eval mode and self-correction. The instance checks (:mod:`clemprm.checks.run_time`, named
    ``label``) come first, so a run that cannot work stops before any model
    is loaded; then ``play(engine, instances)`` loads the policies and plays them, returning what each played
    (:class:`Played`) and the run the records' provenance holds (None: none); then each policy's episode checks, the
    records (``schema``, with the config's provenance, the run and the failure marks of ``on_failure: continue``)
    and, given ``clembench_dir``, the run folders of the clembench results tree. Rank 0 alone writes."""
    catalog = GameCatalog(settings["games"] if games is None else games, settings["seed"])
    marks = check_instances(label, catalog, split, on_failure)
    played, run = play(RolloutEngine(catalog, sampling), catalog.all_instances(split, per_game))
    for part in played:
        marks += check_episodes(part.label, part.rows, on_failure)
    rows = [row for part in played for row in part.rows]
    records.write_records(output, rows, schema,
                          {**provenance(settings), **({} if run is None else {"run": run}), **marks_metadata(marks)})
    trees = [write_results_tree(clembench_dir, folder.name, folder.entries, infos=folder.infos, info=folder.info)
             for part in played for folder in part.folders] if clembench_dir is not None else []
    if distributed.is_main():
        log.info("%s: wrote %d episodes to %s%s", label, len(rows), output,
                 "".join(f"; a clembench results tree in {tree}" for tree in trees))
    return rows


def base_rollouts(settings: dict, output: str, cache_dir: str | None = None, policy=None,
                  on_failure: str = "stop", clembench_dir: str | None = None) -> list[dict]:
    """The base policy plays the train split of every configured game (``episodes_per_instance`` times each).
    Fails (:mod:`clemprm.checks.run_time`) when a game has no train instance or every episode of a game failed,
    unless ``on_failure`` is continue (then the file's provenance records what it went on despite). With
    ``clembench_dir`` (``base_rollouts.clembench_tree``) the episodes are also written there as a clembench results
    tree, run folder ``<policy>-base_rollouts`` (:mod:`clemprm.play.clembench_tree`)."""
    rollout = settings["base_rollouts"]
    sampling = Sampling(rollout["temperature"], rollout["top_p"], rollout["max_new_tokens"])

    def play(engine: RolloutEngine, instances: list[Instance]) -> tuple[list[Played], None]:
        base = policy
        if base is None:
            from clemprm.models.generation import load_policy   # torch: imported by the jobs that generate

            base = load_policy(settings["model"], cache_dir)
        log.info("base rollouts: %d train instances x %d episodes, policy %s", len(instances),
                 rollout["episodes_per_instance"], base.name)
        run_dir, infos = run_dir_name(base.name, "base_rollouts"), model_infos(base, sampling)
        described = engine.play_described(
            instances, [base], repeats=rollout["episodes_per_instance"], base_seed=settings["seed"],
            stage="base_rollouts", policy_name=base.name, describe=describer(clembench_dir, run_dir, infos))
        rows = [row for row, _ in described]
        log.info("played %d episodes\n%s", len(rows), summarize(rows))
        folder = RunFolder(run_dir, infos, {"stage": "base_rollouts", "split": "train"},
                           [entry for _, entry in described])
        return [Played("base_rollouts", rows, [folder])], None

    return play_split("base_rollouts", settings, "train", sampling, play, output, records.EPISODES,
                      on_failure=on_failure, clembench_dir=clembench_dir)


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
