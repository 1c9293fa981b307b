"""One game being played (:class:`Episode`): the clemcore env, its interactions recorder, the turn records, and
the episode's own random generators; forks share what never changes.

The rollout engine (:mod:`clemprm.play.engine`) starts episodes and plays them; this module holds the game side of
one of them: forking at any turn (models return themselves from ``__deepcopy__``, so the language model is shared,
never copied), running game code with the episode's own ``random`` / NumPy generators (seeded from the episode id
by :func:`game_seed`, carried along by forks), scoring it with the game's own scorer and its record row.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import traceback
from contextlib import contextmanager

import numpy as np

from clemprm.play.catalog import Instance
from clemprm.play.contract import Sampling
from clemprm.stats import derive_seed

log = logging.getLogger(__name__)


def shared_by_copies(env, benchmark) -> dict:
    """The deep-copy memo that makes copies of a game env share what never changes: the benchmark, and the env's
    gymnasium spaces (fixed when the env is made; holding random generators, they were the costliest part of
    copying an env, and building them is the costliest part of making one)."""
    static = [benchmark, benchmark.game_spec, getattr(env, "_observation_space", None),
              getattr(env, "_action_space", None)]
    return {id(obj): obj for obj in static if obj is not None}


def game_seed(base_seed: int, episode_id: str) -> int:
    """The seed of an episode's game-side random generators: the same in every stage that plays the episode id,
    so a replay of its answers (soft labels) meets the same draws as the original play (branch points)."""
    return derive_seed(base_seed, "game", episode_id)


def seeded_generator_states(seed: int) -> tuple:
    """Fresh states of Python's ``random`` and NumPy's global generator, seeded with ``seed``."""
    return random.Random(seed).getstate(), np.random.RandomState(seed % 2 ** 32).get_state()


class Episode:
    """One game being played: the clemcore env, its interactions recorder, and the turn records."""

    def __init__(self, episode_id: str, instance: Instance, seed: int, env, recorder, benchmark,
                 generator_states: tuple | None = None):
        self.episode_id = episode_id
        self.instance = instance
        self.seed = seed
        self.env = env
        self.recorder = recorder
        self.benchmark = benchmark
        # the game's own random / numpy.random states; None for a game that draws nothing from them (built-in games)
        self.generator_states = generator_states
        self.turns: list[dict] = []
        self.error: str | None = None
        # (agent id, messages) once the waiting player has perceived its context (clemcore's perceive_context
        # memorizes and logs it, so it happens once per turn; forks of a waiting episode inherit it)
        self.pending: tuple[str, list[dict]] | None = None
        # text put before the first user message of every perspective the model gets (SCoRe's attempt 2 starts
        # with attempt 1's transcript, :mod:`clemprm.rl.attempts`); the game never sees it
        self.context_prefix = ""

    @property
    def done(self) -> bool:
        return self.error is not None or not self.env.agents

    @contextmanager
    def own_generators(self):
        """Run game code with this episode's ``random`` / ``numpy.random`` states; the process's are restored.
        A no-op for games that draw nothing from them: swapping NumPy's state costs ~55 us each way, a third of
        a built-in game's whole turn in the engine."""
        if self.generator_states is None:
            yield
            return
        outside = random.getstate(), np.random.get_state()
        random.setstate(self.generator_states[0])
        np.random.set_state(self.generator_states[1])
        try:
            yield
        finally:
            self.generator_states = random.getstate(), np.random.get_state()
            random.setstate(outside[0])
            np.random.set_state(outside[1])

    def fail(self, error: BaseException | str) -> None:
        if isinstance(error, BaseException):
            error = "".join(traceback.format_exception_only(type(error), error)).strip()
        log.warning("episode %s failed: %s", self.episode_id, error)
        self.error = error

    def fork(self, episode_id: str | None = None, seed: int | None = None) -> "Episode":
        """An independent copy of this game at its current turn (the models are shared, not copied)."""
        env, recorder, turns = copy.deepcopy((self.env, self.recorder, self.turns),
                                             shared_by_copies(self.env, self.benchmark))
        clone = Episode(episode_id or self.episode_id, self.instance, self.seed if seed is None else seed,
                        env, recorder, self.benchmark, self.generator_states)
        clone.turns, clone.error, clone.pending = turns, self.error, self.pending
        clone.context_prefix = self.context_prefix
        return clone

    def advance_to_model_turn(self) -> None:
        """Step terminated agents out (PettingZoo's final None step) and let programmatic players (clemcore's
        ``CustomResponseModel``, e.g. privateshared's questioner) answer themselves, as clemcore's ``Player``
        call does, until a model-backed player is to move or no agent is left. Programmatic answers are not
        turns of the episode (not policy answers): a replay of the policy's answers replays them too."""
        from clemcore.backends import CustomResponseModel

        env = self.env
        while env.agents:
            agent = env.agent_selection
            if env.terminations[agent] or env.truncations[agent]:
                env.step(None)
            elif isinstance((player := env.player_by_agent_id[agent]).model, CustomResponseModel):
                env.step(player(env.observe(agent)))
            else:
                return

    def game_scores(self, interactions: dict | None = None) -> dict:
        """The game's own scorer on the recorded interactions (``self.recorder.interactions``, or ``interactions``:
        a copy of them with meta data filled in): its whole output, what clemcore stores as ``scores.json``
        ("episode scores", "round scores", ...; a scorer may copy the interactions' meta data)."""
        scorer = self.benchmark.create_game_scorer(self.instance.experiment, self.instance.instance)
        scorer.compute_scores(self.recorder.interactions if interactions is None else interactions)
        return scorer.scores

    def scores(self) -> dict:
        """The game's own scorer on the recorded interactions ("episode scores")."""
        return self.game_scores()["episode scores"]

    def record(self, policy: str, sampling: Sampling) -> dict:
        """The episode as a row of :data:`clemprm.records.EPISODES`."""
        scores = {}
        if self.error is None:
            if not self.done:
                self.fail("episode not finished")
            else:
                try:
                    scores = self.scores()
                except Exception as error:  # a scorer bug ends this episode only
                    self.fail(error)
        aborted = self.error is not None or bool(scores.get("Aborted", 1))
        bench_score = float(scores.get("Main Score", math.nan)) if not aborted else math.nan
        game, experiment, game_id = self.instance.key
        return {
            "episode_id": self.episode_id, "game": game, "experiment": experiment, "game_id": game_id,
            "split": self.instance.split, "policy": policy, "seed": self.seed,
            "temperature": sampling.temperature, "n_turns": len(self.turns), "aborted": aborted,
            "lost": not aborted and bool(scores.get("Lose", 0)),
            "success": not aborted and bool(scores.get("Success", 0)),
            "bench_score": bench_score, "error": self.error,
            "episode_scores": json.dumps(scores, default=float, sort_keys=True), "turns": self.turns,
        }
