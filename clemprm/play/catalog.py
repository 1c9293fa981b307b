"""The games a run plays: built-in games and games of a local clembench checkout, with their instances per split.

Instances are keyed by ``(game, experiment, game_id)`` (clembench reuses game ids across experiments).
Built-in games ship one instances file per split. A clembench game is found in the checkout the way clemcore's
game registry finds it (a ``clemgame.json`` holding one spec or a list of specs, up to
:data:`MAX_SPEC_DEPTH` folders deep, skipping the folders clemcore skips); its instances file is the one its spec
names (``"instances": "instances_withclue"``, default ``instances``), or the one ``games.instances_files`` chooses
for it. Without an instance list its instances are assigned to splits by a stable hash of the key (70/15/15).

A run's seed draws which instances of a split it plays (:meth:`GameCatalog.instances`): each experiment's instances
in an order shuffled by the seed, the split and the game and experiment (not by other games), then interleaved and
capped by ``games.max_instances``. A split used whole is the same set for every seed (in a drawn order); a capped
split is a draw, and every stage of a run takes the same one (each passes the run's ``seed``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from clemprm.games import SPLITS, builtin_game_dir
from clemprm.stats import derive_seed


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
    import pandas as pd

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


MAX_SPEC_DEPTH = 3
"""How deep below the checkout a ``clemgame.json`` may sit (clemcore's ``GameRegistry`` looks 3 folders deep)."""
SKIPPED_FOLDERS = frozenset({"venv", "__pycache__", "docs", "in", "resources", "utils", "evaluation", "files"})
"""Folders clemcore's registry never looks into for game specs (nor into hidden ones)."""


def clembench_specs(clembench_path: str | Path) -> dict[str, tuple[Path, dict]]:
    """Every game spec of a clembench checkout: ``{game_name: (game folder, spec dict)}``, found as clemcore's
    registry finds them: depth first in sorted order, a folder with a ``clemgame.json`` is a game folder (its file
    holds one spec or a list of specs) and is not searched further; the first spec of a name wins."""
    root = Path(clembench_path)
    if not root.is_dir():
        raise ValueError(f"games.clembench_path: {clembench_path} is not a directory (a clembench checkout)")
    found: dict[str, tuple[Path, dict]] = {}

    def visit(folder: Path, depth: int) -> None:
        if depth > MAX_SPEC_DEPTH:
            return
        spec_file = folder / "clemgame.json"
        if spec_file.is_file():
            try:
                specs = json.loads(spec_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:   # unreadable, not UTF-8 (as clemcore reads it), not JSON
                raise ValueError(f"{spec_file}: not valid JSON ({error})") from error
            for spec in specs if isinstance(specs, list) else [specs]:
                if not isinstance(spec, dict) or not isinstance(spec.get("game_name"), str) or not spec["game_name"]:
                    raise ValueError(f"{spec_file}: a game spec without a game_name (clemcore's registry needs one "
                                     f"per spec; got {json.dumps(spec)[:120]})")
                found.setdefault(spec["game_name"], (folder, spec))
            return
        for child in sorted(folder.iterdir()):
            if child.is_dir() and not child.name.startswith(".") and child.name not in SKIPPED_FOLDERS:
                visit(child, depth + 1)

    visit(root, 0)
    return found


def find_clembench_game(specs: dict[str, tuple[Path, dict]], game: str, clembench_path) -> tuple[Path, dict]:
    """The folder and spec of ``game`` among a checkout's :func:`clembench_specs`."""
    if game not in specs:
        raise ValueError(f"games.clembench_games: no game {game!r} in clembench checkout {clembench_path} "
                         f"(found: {', '.join(sorted(specs)) or 'none'})")
    return specs[game]


def instances_file(game_dir: Path, spec: dict, chosen: str | None = None) -> Path:
    """The instances file of a clembench game: ``in/<chosen>.json`` (``games.instances_files``), else the one its
    spec names (``instances``, default ``instances``), as clemcore's ``GameInstances.from_game_spec`` reads it."""
    name = chosen or spec.get("instances") or "instances"
    path = game_dir / "in" / (name if name.endswith(".json") else f"{name}.json")
    if (game_dir / "in").resolve() not in path.resolve().parents:   # a name, not a path out of the game folder
        source = "games.instances_files" if chosen else "its clemgame.json"
        raise ValueError(f"game {spec['game_name']!r}: instances file {name!r} ({source}) is not a file of "
                         f"{game_dir / 'in'}: give the name of one of its files (e.g. instances_v2.0_en)")
    if not path.is_file():
        available = sorted(p.stem for p in (game_dir / "in").glob("*.json"))
        source = "games.instances_files" if chosen else "its clemgame.json"
        raise ValueError(f"game {spec['game_name']!r}: instances file {path} ({source}) does not exist "
                         f"(available in {game_dir / 'in'}: {', '.join(available) or 'none'})")
    return path


def instance_rows(path: Path, game: str) -> list[tuple[dict, dict]]:
    """Every ``(experiment, instance)`` pair of an instances file of ``game``, in file order. Read as UTF-8 with or
    without a byte-order mark (an editor on Windows writes one; ``json`` refuses it). ValueError naming the file when
    it cannot be read, and naming game, experiment and id when a ``game_id`` repeats within an experiment: the
    instance key ``(game, experiment, game_id)`` then names two instances, and their episodes and branch points would
    share ids."""
    try:
        experiments = json.loads(Path(path).read_text(encoding="utf-8-sig"))["experiments"]
        rows = [(experiment, instance) for experiment in experiments for instance in experiment["game_instances"]]
        keys = [(experiment["name"], int(instance["game_id"])) for experiment, instance in rows]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"instances file {path}: cannot read its instances ({type(error).__name__}: {error})") \
            from error
    seen = set()
    for experiment, game_id in keys:
        if (experiment, game_id) in seen:
            raise ValueError(f"instances file {path}: game {game!r}, experiment {experiment!r}: game_id {game_id} is "
                             f"used by two instances (an instance is known by game, experiment and game_id: give "
                             f"each instance of an experiment its own game_id)")
        seen.add((experiment, game_id))
    return rows


def experiment_names(path: Path, game: str) -> set[str]:
    """The names of the experiments an instances file of ``game`` holds (:func:`instance_rows`' errors)."""
    return {experiment["name"] for experiment, _ in instance_rows(path, game)}


def _round_robin(rows_by_experiment: dict[str, list]) -> list:
    """Interleave experiments, so that capping the list keeps every experiment represented."""
    return [row for group in zip_longest(*rows_by_experiment.values()) for row in group if row is not None]


class GameCatalog:
    """Loads game benchmarks once and lists instances per split; the engine asks it for game masters. ``seed``: the
    run's seed, which draws the instances of each split (every stage passes it); None lists them in file order
    (tools and tests that look at a game's instances)."""

    def __init__(self, games_config: dict, seed: int | None = None):
        from clemprm.play.clemcore_setup import load_game_benchmark  # clemcore import is slow: only when used
        self.config = games_config
        self.seed = seed
        self.game_dirs: dict[str, Path] = {name: builtin_game_dir(name) for name in games_config["builtin"]}
        self.instance_files: dict[str, Path] = {}  # clembench games: the one instances file played
        clembench_games = games_config.get("clembench_games", [])
        if clembench_games and not games_config.get("clembench_path"):
            raise ValueError("games.clembench_games is set but games.clembench_path is null")
        chosen = games_config.get("instances_files") or {}
        unknown = sorted(set(chosen) - set(clembench_games))
        if unknown:
            raise ValueError(f"games.instances_files names {', '.join(unknown)}, not in games.clembench_games")
        specs = clembench_specs(games_config["clembench_path"]) if clembench_games else {}
        for name in clembench_games:
            game_dir, spec = find_clembench_game(specs, name, games_config["clembench_path"])
            self.game_dirs[name] = game_dir
            self.instance_files[name] = instances_file(game_dir, spec, chosen.get(name))
        self.benchmarks = {name: load_game_benchmark(path, name) for name, path in self.game_dirs.items()}
        self.instance_list = (read_instance_list(games_config["instance_list"])
                              if games_config.get("instance_list") else None)

    @property
    def games(self) -> list[str]:
        return list(self.game_dirs)

    def draws_global_randomness(self, game: str) -> bool:
        """Whether the game's code may draw from Python's ``random`` or NumPy's global generator (then each
        episode plays with generators of its own, :meth:`clemprm.play.episode.Episode.own_generators`). Built-in games
        draw nothing from them (tests/test_engine.py checks it); clembench games may."""
        return game not in self.config["builtin"]

    def parse_mode(self, game: str) -> str:
        return self.config.get("parse_mode_overrides", {}).get(game, self.config["parse_mode"])

    def _raw_rows(self, game: str, split: str) -> list[tuple[dict, dict]]:
        """(experiment, instance) pairs of ``split`` as the game's files hold them."""
        if game not in self.instance_files:  # a built-in game: one file per split
            return instance_rows(self.game_dirs[game] / "in" / f"instances_{split}.json", game)
        rows = instance_rows(self.instance_files[game], game)
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
        """Instances of ``game`` in ``split``: filtered by games.experiments and the instance list, each experiment's
        in the order the catalog's seed draws (file order without one), interleaved round-robin over experiments and
        capped by games.max_instances. A prefix of the list is a draw too (the held-out instances)."""
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
        if self.seed is not None:
            for name, rows in by_experiment.items():
                random.Random(derive_seed(self.seed, "instances", split, game, name)).shuffle(rows)
        return _round_robin(by_experiment)[: self.config["max_instances"][split]]

    def all_instances(self, split: str, per_game: int | None = None) -> list[Instance]:
        """Every game's :meth:`instances` of ``split``, at most ``per_game`` of each (the first of the draw)."""
        return [instance for game in self.games for instance in self.instances(game, split)[:per_game]]
