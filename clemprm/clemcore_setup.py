"""Importing clemcore without its side effects, and loading games in-process.

``import clemcore`` runs ``logging.config.dictConfig`` on its own config: that replaces the process's logging
set-up and creates ``./clembench.log`` in whatever directory the pipeline runs in. We import it with
``dictConfig`` disabled, so clemcore's loggers propagate to ours like any library's. Only clemcore's package
``__init__`` does this, so once :func:`import_clemcore_backends` ran, its other modules import safely.
"""

from __future__ import annotations

import functools
import logging
import logging.config
import sys
from pathlib import Path


def import_clemcore_backends() -> None:
    """Import ``clemcore`` and ``clemcore.backends`` (fast; all the model side needs)."""
    if "clemcore" in sys.modules:
        return
    original = logging.config.dictConfig
    logging.config.dictConfig = lambda config: None
    try:
        import clemcore.backends  # noqa: F401
    finally:
        logging.config.dictConfig = original
    logging.getLogger("clemcore").setLevel(logging.WARNING)


def import_clemcore() -> None:
    """Also import the game side (``clemcore.clemgame``: slow, it pulls in openenv)."""
    if "clemcore.clemgame.envs.pettingzoo.master" in sys.modules:
        return
    import_clemcore_backends()
    import clemcore.clemgame.envs.pettingzoo.master  # noqa: F401
    import clemcore.clemgame.recorder as recorder

    # Every interactions recorder asks importlib.metadata for clemcore's version (parsing its METADATA file,
    # ~1.4 ms): a tenth of an episode's cost in the engine on small models. The answer never changes.
    recorder.get_version = functools.lru_cache(maxsize=1)(recorder.get_version)


def merge_roles(messages: list[dict]) -> list[dict]:
    """Messages as a clemcore backend sends them to its model (``ensure_alternating_roles``: consecutive same-role
    messages joined, an empty leading system message dropped), as plain ``{"role", "content"}`` dicts. A list that
    is already in that form (every prompt the engine renders was merged when its turn began) is only copied:
    clemcore's function deep-copies the whole conversation, ~20 us per prompt."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    empty_system_first = bool(plain) and plain[0]["role"] == "system" and not plain[0]["content"]
    if empty_system_first or any(a["role"] == b["role"] for a, b in zip(plain, plain[1:])):
        import_clemcore_backends()
        from clemcore.backends.utils import ensure_alternating_roles

        plain = ensure_alternating_roles(plain)
    return plain


def load_game_benchmark(game_dir: str | Path, game_name: str):
    """The ``GameBenchmark`` of ``game_name`` from a game folder (clemgame.json + master.py)."""
    import_clemcore()
    from clemcore.clemgame import GameBenchmark, GameSpec

    specs = [spec for spec in GameSpec.from_directory(str(game_dir)) if spec.game_name == game_name]
    if not specs:
        raise ValueError(f"{game_dir}/clemgame.json declares no game named {game_name!r}")
    return GameBenchmark.load_from_spec(specs[0])
