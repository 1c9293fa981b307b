"""Importing clemcore without its side effects, and loading games in-process.

``import clemcore`` runs ``logging.config.dictConfig`` on its own config: that replaces the process's logging
set-up and creates ``./clembench.log`` in whatever directory the pipeline runs in. We import it with
``dictConfig`` disabled, so clemcore's loggers propagate to ours like any library's.
"""

from __future__ import annotations

import functools
import logging
import logging.config
import sys
from pathlib import Path


def import_clemcore() -> None:
    if "clemcore.clemgame" in sys.modules:
        return
    original = logging.config.dictConfig
    logging.config.dictConfig = lambda config: None
    try:
        import clemcore.clemgame  # noqa: F401  (slow: pulls in openenv)
        import clemcore.clemgame.envs.pettingzoo.master  # noqa: F401
    finally:
        logging.config.dictConfig = original
    logging.getLogger("clemcore").setLevel(logging.WARNING)
    # Every interactions recorder asks importlib.metadata for clemcore's version (parsing its METADATA file,
    # ~1.4 ms): a tenth of an episode's cost in the engine on small models. The answer never changes.
    import clemcore.clemgame.recorder as recorder

    recorder.get_version = functools.lru_cache(maxsize=1)(recorder.get_version)


def load_game_benchmark(game_dir: str | Path, game_name: str):
    """The ``GameBenchmark`` of ``game_name`` from a game folder (clemgame.json + master.py)."""
    import_clemcore()
    from clemcore.clemgame import GameBenchmark, GameSpec

    specs = [spec for spec in GameSpec.from_directory(str(game_dir)) if spec.game_name == game_name]
    if not specs:
        raise ValueError(f"{game_dir}/clemgame.json declares no game named {game_name!r}")
    return GameBenchmark.load_from_spec(specs[0])
