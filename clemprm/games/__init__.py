"""The project's own offline, text-only clemcore games: guessnumber, wordref, oddoneout and hanabi.

Each game is a clemcore game folder ``clemprm/games/<name>/`` (``clemgame.json``, ``master.py`` with one
``GameBenchmark`` subclass, ``instancegenerator.py``, ``in/instances_<split>.json``). Load one in-process with
``GameSpec.from_directory(str(builtin_game_dir(name)))[0]`` and ``GameBenchmark.load_from_spec(spec)``.

This module does not import clemcore (slow to import); ``python -m clemprm.games [--seed N]`` regenerates every
game's instance files.
"""

from __future__ import annotations

import importlib
from pathlib import Path

BUILTIN_GAMES: tuple[str, ...] = ("guessnumber", "wordref", "oddoneout", "hanabi")
SPLITS = ("train", "validation", "test")

GAMES_DIR = Path(__file__).resolve().parent


def builtin_game_dir(name: str) -> Path:
    """The folder of the built-in game ``name``; ValueError for an unknown name."""
    if name not in BUILTIN_GAMES:
        raise ValueError(f"unknown built-in game {name!r}; known built-in games: {', '.join(BUILTIN_GAMES)}")
    return GAMES_DIR / name


def instance_generator(name: str):
    """The ``instancegenerator`` module of a built-in game (``build_instances(seed)``, ``generate(seed, out_dir)``)."""
    builtin_game_dir(name)  # validates the name
    return importlib.import_module(f"clemprm.games.{name}.instancegenerator")


def generate_all_instances(seed: int = 42, out_root: str | Path | None = None) -> None:
    """Rewrites every built-in game's ``in/instances_<split>.json`` (or ``out_root/<game>/`` when given)."""
    for name in BUILTIN_GAMES:
        out_dir = None if out_root is None else Path(out_root) / name
        instance_generator(name).generate(seed, out_dir)
