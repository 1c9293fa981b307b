"""The rollout engine: plays many clemcore games in lockstep, one batched generation call per step.

Every stage that plays games (base rollouts, branch points, K-rollout labels, searches) uses this module.
Each game is a clemcore ``GameMasterEnv`` driven directly (the fast path: no clemcore runner in between):

* lockstep: each :meth:`RolloutEngine.step`, every episode waiting for a model answer is answered by one
  ``generate`` call per model (the model micro-batches by token budget, sorted by length);
* forkable: :meth:`Episode.fork` deep-copies a game at any turn; models return themselves from
  ``__deepcopy__``, so the language model is shared, never copied;
* isolated: an exception in one episode (game code, scorer, a too-long prompt) is recorded on that episode,
  which ends there; the others go on;
* reproducible: a game that draws from Python's ``random`` or NumPy's global generator draws from its episode's
  own generators (seeded from the episode id, carried along by forks), never from state other episodes moved:
  replaying an episode's answers rebuilds the same game, whatever else is played beside it.

A model is any object with a ``name`` and ``generate(perspectives, seeds=..., temperature=..., top_p=...,
max_new_tokens=...) -> list[Generation]`` (:class:`clemprm.models.generation.PolicyModel`, or a scripted policy
in tests); :class:`Generation` is the engine's contract with a model: what one answer holds.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from clemprm.play.catalog import GameCatalog, Instance
from clemprm.play.chat import merge_roles
from clemprm.play.clemcore_setup import import_clemcore, record_validation, take_validation_verdict
from clemprm.stats import derive_seed

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """One answer. ``raw_text``: the new tokens decoded with special tokens (the end token) skipped;
    ``text``: what the game sees, ``raw_text`` without ``<think>`` blocks, stripped. ``new_tokens`` counts the
    end token. On ``error`` (e.g. "context too long: 3000 > 2048 tokens") text is "" and nothing was generated."""

    text: str
    raw_text: str
    prompt_tokens: int
    new_tokens: int
    error: str | None = None
    finish_reason: str = "stop"   # "stop" (an end token), "length" (max_new_tokens reached) or "error"
    # the tokens behind the answer, for training on what was played (clemprm.rl): the rendered prompt's ids and
    # the generated ids (end token included); None where nothing was generated or a policy does not tokenise
    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64


def _recorder_class():
    import_clemcore()
    from clemcore.clemgame import GameInteractionsRecorder

    class EpisodeRecorder(GameInteractionsRecorder):
        """clemcore's interactions recorder (what the game's scorer reads) that also counts rule violations."""

        violations = 0

        def count_request_violation(self):
            self.violations += 1
            super().count_request_violation()

    return EpisodeRecorder


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


class RecordingFromCreation:
    """A game benchmark as a ``GameMasterEnv`` sees it during one reset: the game master it creates has the
    episode's interactions recorder registered at once, before its set-up, so keys a game logs while setting up
    are recorded (adventuregame logs ``adventure_info`` in ``_on_setup`` and its scorer reads it; clemcore 3.7's
    own runners attach their recorders after set-up and lose it). Everything else is the benchmark's."""

    def __init__(self, benchmark, recorder):
        self._benchmark, self._recorder = benchmark, recorder

    def __getattr__(self, name):
        return getattr(self._benchmark, name)

    def create_game_master(self, experiment: dict, player_models: list):
        game_master = self._benchmark.create_game_master(experiment, player_models)
        game_master.register(self._recorder)
        return game_master


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


def with_context_prefix(messages: list[dict], prefix: str) -> list[dict]:
    """``messages`` with ``prefix`` put before the content of the first user message (unchanged when empty)."""
    if not prefix:
        return messages
    first = next((i for i, message in enumerate(messages) if message["role"] == "user"), None)
    if first is None:
        return messages
    return [*messages[:first], {**messages[first], "content": prefix + messages[first]["content"]},
            *messages[first + 1:]]


class Progress:
    """Log lines with episodes done, turns/s and generated tokens/s, at most every ``every`` seconds."""

    def __init__(self, total: int, label: str, every: float = 10.0):
        self.total, self.label, self.every = total, label, every
        self.start = self.last = time.perf_counter()
        self.turns = self.tokens = 0

    def update(self, done: int, turns: int, tokens: int, force: bool = False) -> None:
        self.turns += turns
        self.tokens += tokens
        now = time.perf_counter()
        if force or now - self.last >= self.every:
            self.last = now
            elapsed = max(now - self.start, 1e-9)
            log.info("%s: %d/%d episodes done, %d turns (%.1f/s), %d tokens generated (%.1f/s), %.0f s",
                     self.label, done, self.total, self.turns, self.turns / elapsed, self.tokens,
                     self.tokens / elapsed, elapsed)


class RolloutEngine:
    """Starts episodes from a :class:`GameCatalog` and plays them in lockstep."""

    def __init__(self, catalog: GameCatalog, sampling: Sampling):
        import_clemcore()
        self.catalog = catalog
        self.sampling = sampling
        self._recorder_cls = _recorder_class()
        self._blank_envs: dict[str, object] = {}  # game -> a GameMasterEnv never reset, copied for each episode

    def start(self, instance: Instance, models: list, episode_id: str, seed: int,
              game_seed: int | None = None) -> Episode:
        """Set up a game (clemcore's reset); ``models`` gives one model per player, or one for all players.
        ``seed`` seeds the answers sampled for it, ``game_seed`` (default: ``seed``) the game's own random draws."""
        from clemcore.clemgame import GameBenchmarkCallback, GameBenchmarkCallbackList

        recorder = self._recorder_cls(instance.game, instance.experiment["name"], instance.instance["game_id"], "", {})

        class LogPlayers(GameBenchmarkCallback):
            def on_game_start(self, game_master, game_instance):
                for player in game_master.get_players():
                    recorder.log_player(player.name, player.game_role, player.model.name)

        benchmark = self.catalog.benchmarks[instance.game]
        env = self._new_env(benchmark)
        env.callbacks = GameBenchmarkCallbackList([LogPlayers()])
        generator_states = (seeded_generator_states(seed if game_seed is None else game_seed)
                            if self.catalog.draws_global_randomness(instance.game) else None)
        episode = Episode(episode_id, instance, seed, env, recorder, benchmark, generator_states)
        env.game_benchmark = RecordingFromCreation(benchmark, recorder)
        try:
            with episode.own_generators():
                env.reset(options={"player_models": list(models), "experiment": copy.deepcopy(instance.experiment),
                                   "game_instance": copy.deepcopy(instance.instance)})
                env.callbacks = GameBenchmarkCallbackList()  # the players are logged; forks need no callback
                record_validation(env.game_master)
                episode.advance_to_model_turn()
        except Exception as error:
            episode.env.agents = []
            episode.fail(error)
        finally:
            env.game_benchmark = benchmark
        return episode

    def _new_env(self, benchmark):
        """A fresh ``GameMasterEnv`` of ``benchmark``: a copy of one blank env per game, sharing its gymnasium
        spaces (making an env takes ~75 us, most of it building three gymnasium spaces; a copy ~20 us)."""
        from clemcore.clemgame.envs.pettingzoo.master import GameMasterEnv

        blank = self._blank_envs.get(benchmark.game_name)
        if blank is None:
            blank = self._blank_envs[benchmark.game_name] = GameMasterEnv(benchmark)
        return copy.deepcopy(blank, shared_by_copies(blank, benchmark))

    @staticmethod
    def waiting(episode: Episode):
        """``(player, messages)`` of the player the live ``episode`` waits for; the messages as the model gets
        them (roles merged). The player perceives its context once per turn. None (and the episode fails)
        when the game cannot say."""
        try:
            if episode.pending is None:
                agent = episode.env.agent_selection
                player = episode.env.player_by_agent_id[agent]
                with episode.own_generators():
                    messages = merge_roles(player.perceive_context(episode.env.observe(agent)))
                    episode.pending = agent, with_context_prefix(messages, episode.context_prefix)
            agent, messages = episode.pending
            return episode.env.player_by_agent_id[agent], messages
        except Exception as error:
            episode.fail(error)
            return None

    def propose(self, episodes: list[Episode], n: int = 1, sampling: Sampling | None = None) -> list[list]:
        """``n`` candidate answers (:class:`Generation`) for every live episode, nothing applied yet: one
        ``generate`` call per model for all episodes and candidates. Candidate ``j`` of an episode is sampled
        with ``derive_seed(episode.seed, turn)`` for ``j == 0`` (what :meth:`step` plays) and
        ``derive_seed(episode.seed, turn, j)`` otherwise. Done or failing episodes get ``[]``."""
        sampling = sampling or self.sampling
        candidates: list[list] = [[] for _ in episodes]
        by_model: dict[int, list] = {}  # id(model) -> [(index, messages, seed)]
        models = {}
        for index, episode in enumerate(episodes):
            if episode.done or (waiting := self.waiting(episode)) is None:
                continue
            player, messages = waiting
            models[id(player.model)] = player.model
            turn = len(episode.turns)
            for j in range(n):
                seed = derive_seed(episode.seed, turn) if j == 0 else derive_seed(episode.seed, turn, j)
                by_model.setdefault(id(player.model), []).append((index, messages, seed))
        for model_id, items in by_model.items():
            try:
                generations = models[model_id].generate(
                    [messages for _, messages, _ in items], seeds=[seed for _, _, seed in items],
                    temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens)
            except Exception as error:  # the whole call failed (e.g. out of memory): these episodes end
                for index, _, _ in items:
                    episodes[index].fail(error)
                continue
            for (index, _, _), generation in zip(items, generations):
                if not episodes[index].done:
                    candidates[index].append(generation)
        return candidates

    def apply(self, episode: Episode, generation) -> None:
        """Play ``generation`` as the answer of the player ``episode`` waits for (an error ends the episode)."""
        if generation.error:
            episode.fail(generation.error)
        elif (waiting := self.waiting(episode)) is not None:
            self._apply(episode, *waiting, generation)

    def step(self, episodes: list[Episode], sampling: Sampling | None = None) -> tuple[int, int]:
        """Answer every episode that waits for a model: one ``generate`` call per model. Returns (turns, tokens)."""
        turns = tokens = 0
        for episode, candidates in zip(episodes, self.propose(episodes, 1, sampling)):
            for generation in candidates:
                turns += 1
                tokens += generation.new_tokens
                self.apply(episode, generation)
        return turns, tokens

    @staticmethod
    def _apply(episode: Episode, player, messages: list[dict], generation) -> None:
        """Give the answer to the player's memory and the game; record the turn."""
        episode.pending = None
        try:
            with episode.own_generators():
                player.perceive_response(generation.text, metadata={
                    "prompt": messages, "response_object": {"raw_text": generation.raw_text}})
                violations_before = episode.recorder.violations
                take_validation_verdict(episode.env.game_master)
                episode.env.step(generation.text)
                # a legacy game's own verdict on the answer, else whether the game counted a violated request
                verdict = take_validation_verdict(episode.env.game_master)
                episode.turns.append({
                    "turn_idx": len(episode.turns), "player": player.name, "game_role": player.game_role,
                    "messages": messages, "response": generation.text,
                    "parse_ok": episode.recorder.violations == violations_before if verdict is None else verdict,
                    "prompt_tokens": generation.prompt_tokens, "new_tokens": generation.new_tokens})
                episode.advance_to_model_turn()
        except Exception as error:
            episode.fail(error)

    def run(self, episodes: list[Episode], label: str = "rollouts", sampling: Sampling | None = None,
            max_turns: int | None = None) -> list[Episode]:
        """Step all episodes in lockstep until every one is done, or has played ``max_turns`` turns in this call
        (then it stays unfinished: the caller decides how to score it)."""
        progress = Progress(len(episodes), label)
        start_turns = {id(episode): len(episode.turns) for episode in episodes}

        def playing(episode):
            return not episode.done and (max_turns is None or len(episode.turns) - start_turns[id(episode)] < max_turns)

        live = [episode for episode in episodes if playing(episode)]
        while live:
            turns, tokens = self.step(live, sampling)
            live = [episode for episode in live if playing(episode)]
            progress.update(len(episodes) - len(live), turns, tokens, force=not live)
        return episodes

    def replay(self, episode: Episode, responses: list[str]) -> Episode:
        """Play recorded answers (no generation) to rebuild a game state; the games are deterministic given
        their instance and the answers, so the state equals the one the answers were first given in."""
        for text in responses:
            if episode.done:
                break
            self.apply(episode, Generation(text=text, raw_text=text, prompt_tokens=0, new_tokens=0))
        return episode

    def start_all(self, instances: list[Instance], models: list, *, repeats: int, base_seed: int,
                  stage: str) -> list[Episode]:
        """Every instance ``repeats`` times, as episodes ``<game>/<experiment>/<game_id>/<repeat>`` seeded from
        ``(base_seed, stage, episode id)``: runs of one stage pair episode by episode whatever model plays."""
        episodes = []
        for instance in instances:
            game, experiment, game_id = instance.key
            for repeat in range(repeats):
                episode_id = f"{game}/{experiment}/{game_id}/{repeat}"
                episodes.append(self.start(instance, models, episode_id, derive_seed(base_seed, stage, episode_id),
                                           game_seed(base_seed, episode_id)))
        return episodes

    def play(self, instances: list[Instance], models: list, *, repeats: int, base_seed: int, stage: str,
             policy_name: str) -> list[dict]:
        """Play every instance ``repeats`` times and return the episode records."""
        episodes = self.start_all(instances, models, repeats=repeats, base_seed=base_seed, stage=stage)
        self.run(episodes, label=stage)
        return [episode.record(policy_name, self.sampling) for episode in episodes]
