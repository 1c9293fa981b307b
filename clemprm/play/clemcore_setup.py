"""Importing clemcore without its side effects, loading games in-process, and the glue clembench games need.

``import clemcore`` runs ``logging.config.dictConfig`` on its own config: that replaces the process's logging
set-up and creates ``./clembench.log`` in whatever directory the pipeline runs in. We import it with
``dictConfig`` disabled, so clemcore's loggers propagate to ours like any library's. Only clemcore's package
``__init__`` does this, so once :func:`import_clemcore_backends` ran, its other modules import safely.
Its game side imports openenv (clemcore's OpenEnv server and client), which loads its web interface only where gradio
is installed; clemprm never serves a game, so :func:`import_clemcore` imports it as if gradio were not there (gradio
took 4.2 of the 6.6 s that the game side took to import, once in every job).

clembench (the real games, main as of 2025-09) against the pinned clemcore 3.7.2, what differs and what is done:

* the old state API: clembench's wordle (and its clue and critic variants) assigns a plain dataclass to
  ``self.state`` in ``_on_setup``. clemcore 3.7's ``GameMaster.state`` setter carries the base ``GameState``
  fields over onto the new object by reading them from it, and a plain object lacks them (``AttributeError:
  'WordleGameState' object has no attribute 'outcome'``: every episode failed at set-up).
  :func:`tolerate_plain_game_states` makes the setter treat a missing base field as unset, which the setter
  then fills in as for any unset field; a ``GameState`` goes through unchanged.
* game-local modules: clemcore loads one game at a time and drops the modules a game brought along
  (``GameBenchmark.close``); clembench games share top-level module names (wordle, taboo and guesswhat each
  have a ``utils`` package). A run here loads all its games at once, so :func:`load_game_benchmark` drops a
  game's own modules (those loaded from its folders, :func:`is_game_local`) from ``sys.modules`` right after
  loading it (its code keeps the module objects it imported), and the next game imports its own ``utils``.
* the legacy round count: since clemcore 3.5 the legacy ``DialogueGameMaster`` starts at round -1 and
  ``before_game`` counts up after ``_on_before_game``; before, the round was 0 from the start and
  ``before_game`` left it as ``_on_before_game`` set it. clembench's privateshared plays a probing round 0 in
  ``_on_before_game`` and then sets round 1 itself: it read round -1 (``KeyError: '-1'``, every episode failed at
  set-up). :func:`keep_legacy_round_count` runs a legacy ``_on_before_game`` at round 0 and keeps the round it
  leaves; a game that does not touch the round there (all other 2.0 text games) ends set-up at round 0 either way.
* NumPy 2 (pinned here; clemcore 3.7.2 allows it) removed the ``np.NaN`` alias, which the scorers of
  textmapworld and its two variants use: every episode failed when scored. :func:`import_clemcore` puts the
  alias back (``numpy.NaN is numpy.nan``) where it is missing.
* rule violations: every clembench 2.0 text game uses the legacy API (``clemcore.clemgame.legacy``), where a
  violated request is ``_validate_player_response`` returning False (those games never call
  ``count_request_violation``). :func:`record_validation` has a legacy game master keep its last verdict, so a
  turn's ``parse_ok`` comes from what the game itself decided.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import logging.config
import sys
import traceback
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


@functools.cache
def import_clemcore() -> None:
    """Also import the game side (``clemcore.clemgame``: slow, it pulls in openenv), and adapt it once per process
    (also where some other code imported clemcore's game side first)."""
    import_clemcore_backends()
    with without_gradio():
        import clemcore.clemgame.envs.pettingzoo.master  # noqa: F401
    import clemcore.clemgame.recorder as recorder

    import clemcore.clemgame.legacy.master  # noqa: F401  (loaded once here, never as a game's own module)

    tolerate_plain_game_states()
    keep_legacy_round_count()
    restore_numpy_nan_alias()

    # Every interactions recorder asks importlib.metadata for clemcore's version (parsing its METADATA file,
    # ~1.4 ms): a tenth of an episode's cost in the engine on small models. The answer never changes.
    recorder.get_version = functools.lru_cache(maxsize=1)(recorder.get_version)


@contextlib.contextmanager
def without_gradio():
    """Imports in this block find no gradio (``import gradio`` raises ModuleNotFoundError), as where it is not
    installed: openenv's ``env_server`` then leaves its optional web interface out (``create_web_interface_app`` is
    None). Outside the block gradio imports as usual."""
    if "gradio" in sys.modules:
        yield
        return
    sys.modules["gradio"] = None
    try:
        yield
    finally:
        if sys.modules.get("gradio", 0) is None:
            del sys.modules["gradio"]


def tolerate_plain_game_states() -> None:
    """Let ``GameMaster.state`` accept a state object that is not a ``GameState`` (see the module doc): each base
    field it lacks is set to None first, which clemcore's own setter then treats as unset and fills in."""
    from clemcore.clemgame.master import GameMaster

    setter = GameMaster.state.fset
    if getattr(setter, "tolerates_plain_states", False):
        return

    def set_state(self, new_state):
        for field in GameMaster._GAME_STATE_FIELDS:
            if not hasattr(new_state, field):
                setattr(new_state, field, None)
        setter(self, new_state)

    set_state.tolerates_plain_states = True
    GameMaster.state = GameMaster.state.setter(set_state)


def keep_legacy_round_count() -> None:
    """The round count a legacy ``_on_before_game`` was written for (see the module doc): it runs at round 0, and
    set-up ends at the round it leaves (clemcore's ``before_game`` adds one after it: it is given one less)."""
    from clemcore.clemgame.legacy.master import DialogueGameMaster as LegacyDialogueGameMaster

    before_game = LegacyDialogueGameMaster.before_game
    if getattr(before_game, "keeps_legacy_round_count", False):
        return

    def legacy_before_game(self):
        on_before_game = self._on_before_game

        def at_round_zero():
            self.current_round = 0
            on_before_game()
            self.current_round -= 1

        self._on_before_game = at_round_zero  # for this call only
        try:
            before_game(self)
        finally:
            del self._on_before_game

    legacy_before_game.keeps_legacy_round_count = True
    LegacyDialogueGameMaster.before_game = legacy_before_game


def restore_numpy_nan_alias() -> None:
    """``numpy.NaN`` (removed in NumPy 2.0) as the alias of ``numpy.nan`` it was, for games written against
    NumPy 1 (see the module doc)."""
    import numpy

    if not hasattr(numpy, "NaN"):
        numpy.NaN = numpy.nan


VALIDATION_VERDICT = "_clemprm_response_valid"
"""The attribute where a legacy game master keeps the verdict of its last ``_validate_player_response``."""


def record_validation(game_master) -> None:
    """Have a legacy game master note each ``_validate_player_response`` verdict in :data:`VALIDATION_VERDICT`
    (the class's method is wrapped once; the verdict lives on the instance, so it is copied with forks)."""
    from clemcore.clemgame.legacy.master import DialogueGameMaster as LegacyDialogueGameMaster

    cls = type(game_master)
    validate = cls._validate_player_response if isinstance(game_master, LegacyDialogueGameMaster) else None
    if validate is None or getattr(validate, "records_validation", False):
        return

    @functools.wraps(validate)
    def recording(self, player, response):
        valid = validate(self, player, response)
        self.__dict__[VALIDATION_VERDICT] = bool(valid)
        return valid

    recording.records_validation = True
    cls._validate_player_response = recording


def take_validation_verdict(game_master) -> bool | None:
    """The verdict :func:`record_validation` noted since the last call (None: the game did not validate)."""
    return game_master.__dict__.pop(VALIDATION_VERDICT, None)


class GameCodeError(ImportError):
    """A game's code (its ``master.py`` and what it imports) raised while clemcore loaded it: the message names the
    game, the folder and the game's own file and line where it raised (clemcore's names neither)."""

    def __init__(self, game_name: str, game_dir: str | Path, error: BaseException):
        frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if Path(frame.filename).resolve().is_relative_to(Path(game_dir).resolve())]
        where = f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else f"{game_dir}/master.py"
        super().__init__(f"game {game_name!r}: its code failed to load ({where}): {type(error).__name__}: {error}")


def load_game_benchmark(game_dir: str | Path, game_name: str):
    """The ``GameBenchmark`` of ``game_name`` from a game folder (clemgame.json + master.py). The game's own
    modules leave ``sys.modules`` again (see the module doc), so games with same-named modules load side by side."""
    import_clemcore()
    from clemcore.clemgame import GameBenchmark, GameSpec

    specs = [spec for spec in GameSpec.from_directory(str(game_dir)) if spec.game_name == game_name]
    if not specs:
        raise ValueError(f"{game_dir}/clemgame.json declares no game named {game_name!r}")
    before = set(sys.modules)
    try:
        benchmark = GameBenchmark.load_from_spec(specs[0])
    except Exception as error:
        raise GameCodeError(game_name, game_dir, error) from error
    for name in set(sys.modules) - before:
        if is_game_local(sys.modules[name], game_dir):
            del sys.modules[name]
    return benchmark


def is_game_local(module, game_dir: str | Path) -> bool:
    """Whether ``module`` was loaded from the folders clemcore puts on ``sys.path`` for a game: the game folder,
    and its parent when the folder's name starts with the parent's (``textmapworld/textmapworld_main``). Libraries
    a game imports first (numpy, nltk, clemcore's own legacy modules) are not: they stay loaded, once."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    game_dir = Path(game_dir).resolve()
    roots = [game_dir] + ([game_dir.parent] if game_dir.name.startswith(game_dir.parent.name) else [])
    return any(Path(file).resolve().is_relative_to(root) for root in roots)
