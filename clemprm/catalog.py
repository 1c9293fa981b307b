"""The games a run plays: built-in games and games of a local clembench checkout, with their instances per split.

Instances are keyed by ``(game, experiment, game_id)`` (clembench reuses game ids across experiments).
Built-in games ship one instances file per split. A clembench game has one ``in/instances.json``: without an
instance list its instances are assigned to splits by a stable hash of the key (70/15/15).
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import pandas as pd

from clemprm.games import SPLITS, builtin_game_dir


@dataclass(frozen=True)
class Instance:
    """One playable game instance: the experiment (with pipeline settings applied) and the instance dict."""
    game: str
    split: str
    experiment: dict
    instance: dict

    @property
    def key(self) -> tuple[str, str, int]:
        return self.game, self.experiment["name"], int(self.instance["game_id"])


def hash_split(game: str, experiment: str, game_id: int) -> str:
    digest = int(hashlib.sha256(f"{game}/{experiment}/{game_id}".encode()).hexdigest(), 16) % 100
    return "train" if digest < 70 else "validation" if digest < 85 else "test"


def read_instance_list(path: str | Path) -> set[tuple[str, str, int, str]]:
    """A playpen-data `instances` table (columns game, experiment, task_id, split) as a set of keys."""
    path = Path(path)
    readers = {".parquet": pd.read_parquet, ".csv": pd.read_csv, ".jsonl": lambda p: pd.read_json(p, lines=True),
               ".json": pd.read_json}
    if path.suffix not in readers:
        raise ValueError(f"instance list {path}: unsupported format {path.suffix!r} (use {', '.join(readers)})")
    try:
        frame = readers[path.suffix](path)
    except Exception as error:  # pandas raises many types for a corrupt file
        raise ValueError(f"cannot read instance list {path}: {error}") from error
    missing = {"game", "experiment", "task_id", "split"} - set(frame.columns)
    if missing:
        raise ValueError(f"instance list {path} lacks columns {sorted(missing)}")
    return {(str(r.game), str(r.experiment), int(r.task_id), str(r.split)) for r in frame.itertuples()}


def find_clembench_game(clembench_path: str | Path, game: str) -> Path:
    """The folder of a clembench checkout whose clemgame.json declares ``game``."""
    for spec_file in sorted(Path(clembench_path).glob("*/clemgame.json")):
        specs = json.loads(spec_file.read_text())
        names = [spec["game_name"] for spec in (specs if isinstance(specs, list) else [specs])]
        if game in names:
            return spec_file.parent
    raise ValueError(f"games.clembench_games: no game {game!r} in clembench checkout {clembench_path}")


def _round_robin(rows_by_experiment: dict[str, list]) -> list:
    """Interleave experiments, so that capping the list keeps every experiment represented."""
    return [row for group in zip_longest(*rows_by_experiment.values()) for row in group if row is not None]


class GameCatalog:
    """Loads game benchmarks once and lists instances per split; the engine asks it for game masters."""

    def __init__(self, games_config: dict):
        from clemprm.clemcore_setup import load_game_benchmark  # clemcore import is slow: only when used
        self.config = games_config
        self.game_dirs: dict[str, Path] = {name: builtin_game_dir(name) for name in games_config["builtin"]}
        for name in games_config.get("clembench_games", []):
            if not games_config.get("clembench_path"):
                raise ValueError("games.clembench_games is set but games.clembench_path is null")
            self.game_dirs[name] = find_clembench_game(games_config["clembench_path"], name)
        self.benchmarks = {name: load_game_benchmark(path, name) for name, path in self.game_dirs.items()}
        self.instance_list = (read_instance_list(games_config["instance_list"])
                              if games_config.get("instance_list") else None)

    @property
    def games(self) -> list[str]:
        return list(self.game_dirs)

    def parse_mode(self, game: str) -> str:
        return self.config.get("parse_mode_overrides", {}).get(game, self.config["parse_mode"])

    def _raw_rows(self, game: str, split: str) -> list[tuple[dict, dict]]:
        """(experiment, instance) pairs of ``split`` as the game's files hold them."""
        game_dir = self.game_dirs[game]
        split_file = game_dir / "in" / f"instances_{split}.json"
        if split_file.exists():
            experiments = json.loads(split_file.read_text())["experiments"]
            return [(exp, inst) for exp in experiments for inst in exp["game_instances"]]
        experiments = json.loads((game_dir / "in" / "instances.json").read_text())["experiments"]
        rows = [(exp, inst) for exp in experiments for inst in exp["game_instances"]]
        if self.instance_list is not None:  # the list assigns the splits
            return rows
        return [(exp, inst) for exp, inst in rows if hash_split(game, exp["name"], inst["game_id"]) == split]

    def experiments(self, game: str) -> set[str] | None:
        """The experiments of ``game`` that games.experiments selects (None: all); an unknown name is an error."""
        selected = self.config.get("experiments", {}).get(game)
        if selected is None:
            return None
        known = {exp["name"] for split in SPLITS for exp, _ in self._raw_rows(game, split)}
        unknown = sorted(set(selected) - known)
        if unknown:
            raise ValueError(f"games.experiments.{game}: no experiment {unknown} (known: {', '.join(sorted(known))})")
        return set(selected)

    def instances(self, game: str, split: str) -> list[Instance]:
        """Instances of ``game`` in ``split``: filtered by games.experiments and the instance list, capped by
        games.max_instances."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
        experiments = self.experiments(game)
        by_experiment: dict[str, list[Instance]] = {}
        for experiment, instance in self._raw_rows(game, split):
            key = (game, experiment["name"], int(instance["game_id"]), split)
            if self.instance_list is not None and key not in self.instance_list:
                continue
            if experiments is not None and experiment["name"] not in experiments:
                continue
            experiment = {k: v for k, v in experiment.items() if k != "game_instances"}
            if game in self.config["builtin"]:
                experiment["parse_mode"] = self.parse_mode(game)
            by_experiment.setdefault(experiment["name"], []).append(
                Instance(game, split, experiment, copy.deepcopy(instance)))
        return _round_robin(by_experiment)[: self.config["max_instances"][split]]

    def all_instances(self, split: str) -> list[Instance]:
        return [instance for game in self.games for instance in self.instances(game, split)]
