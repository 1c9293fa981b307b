"""The rollout engine: plays many clemcore games in lockstep, one batched generation call per step.

Every stage that plays games (base rollouts, branch points, K-rollout labels, searches) uses this module.
Each game is a clemcore ``GameMasterEnv`` driven directly (the fast path: no clemcore runner in between):

* lockstep: each :meth:`RolloutEngine.step`, every episode waiting for a model answer is answered by one
  ``generate`` call per model (the model micro-batches by token budget, sorted by length);
* forkable: :meth:`~clemprm.play.episode.Episode.fork` deep-copies a game at any turn; models return themselves
  from ``__deepcopy__``, so the language model is shared, never copied;
* isolated: an exception in one episode (game code, scorer, a too-long prompt) is recorded on that episode,
  which ends there; the others go on;
* reproducible: a game that draws from Python's ``random`` or NumPy's global generator draws from its episode's
  own generators (seeded from the episode id, carried along by forks), never from state other episodes moved:
  replaying an episode's answers rebuilds the same game, whatever else is played beside it.

One game being played is an :class:`~clemprm.play.episode.Episode` (:mod:`clemprm.play.episode`); what the engine
asks of a model and what one answer holds is :mod:`clemprm.play.contract`.
"""

from __future__ import annotations

import copy
import logging
import time

from clemprm import distributed
from clemprm.play.catalog import GameCatalog, Instance
from clemprm.play.chat import merge_roles
from clemprm.play.clemcore_setup import import_clemcore, record_validation, take_validation_verdict
from clemprm.play.contract import BackendError, Generation, Sampling
from clemprm.play.episode import Episode, game_seed, seeded_generator_states, shared_by_copies
from clemprm.stats import derive_seed

log = logging.getLogger(__name__)


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
            except BackendError:   # the generator itself is gone (a dead server): the stage fails, not the episodes
                raise
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

    def play_each(self, episode: Episode, candidates: list, seeds: list[int] | None = None) -> list[Episode]:
        """A fork of ``episode`` per candidate with that candidate played (fork ``j`` seeded ``seeds[j]``, by default
        the episode's own seed): its turn record holds the game's reply, and it is the game that goes on when a
        search chooses that candidate. A candidate that failed, or that the game failed on, fails its fork."""
        children = []
        for j, candidate in enumerate(candidates):
            child = episode.fork(seed=None if seeds is None else seeds[j])
            self.apply(child, candidate)
            children.append(child)
        return children

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
                    "prompt_tokens": generation.prompt_tokens, "new_tokens": generation.new_tokens, "reply": ""})
                episode.advance_to_model_turn()
            episode.turns[-1]["reply"] = RolloutEngine.game_reply(episode, player)
        except Exception as error:
            episode.fail(error)

    @staticmethod
    def game_reply(episode: Episode, player) -> str:
        """What the game answered ``player``'s answer with, once it has moved on (the PRM reads it after the
        answer): the game's next message when ``player`` moves next (feedback, a reprompt), the next player's new
        message marked ``[to <role>]`` when another one does, ``Game over: won|lost|aborted.`` (the game's own
        scores) when the answer ended the game, and "" when the episode failed."""
        if episode.error is not None:
            return ""
        if episode.done:
            scores = episode.scores()
            outcome = "aborted" if scores.get("Aborted", 1) else "won" if scores.get("Success", 0) else "lost"
            return f"{GAME_OVER}{outcome}."
        waiting = RolloutEngine.waiting(episode)
        if waiting is None:
            return ""
        next_player, messages = waiting
        text = messages[-1]["content"] if messages else ""
        return text if next_player.name == player.name else f"[to {next_player.game_role}] {text}"

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
        """Play every instance ``repeats`` times and return the episode records. In a job of several processes each
        plays its share of the instances and every one gets all records (:func:`clemprm.distributed.map_split`)."""
        return [row for row, _ in self.play_described(instances, models, repeats=repeats, base_seed=base_seed,
                                                      stage=stage, policy_name=policy_name, describe=None)]

    def play_described(self, instances: list[Instance], models: list, *, repeats: int, base_seed: int, stage: str,
                       policy_name: str, describe, play=None) -> list[tuple[dict, object]]:
        """:meth:`play`, each record paired with ``describe(episode)`` of the played episode (None without
        ``describe``): e.g. its clembench results-tree entry (:func:`clemprm.play.clembench_tree.episode_entry`),
        which needs the live episode; picklable, as every process gets every pair. ``play(episodes) -> (episodes,
        fields)``, when given, plays the started episodes instead of :meth:`run` (a search): the episodes that count,
        in order, and per episode the fields its record gets besides the episode's own (e.g. what the search cost)."""
        def play_share(share: list[Instance]) -> list[list[tuple[dict, object]]]:
            episodes = self.start_all(share, models, repeats=repeats, base_seed=base_seed, stage=stage)
            if play is None:
                self.run(episodes, label=stage)
                fields = [{}] * len(episodes)
            else:
                episodes, fields = play(episodes)
            pairs = [({**episode.record(policy_name, self.sampling), **more}, describe(episode) if describe else None)
                     for episode, more in zip(episodes, fields)]
            return [pairs[index:index + repeats] for index in range(0, len(pairs), repeats)]

        return [pair for pairs in distributed.map_split(instances, play_share) for pair in pairs]


GAME_OVER = "Game over: "   # how RolloutEngine.game_reply says that an answer ended the game
RULE_VALUES = {"won": 1.0, "lost": 0.1, "aborted": 0.0, "accepted": 0.5, "rejected": 0.2}
"""The lookahead rule's values: the game's end-of-game verdict on an answer, else whether it accepted it."""


def game_over(reply: str | None) -> str | None:
    """``won``, ``lost`` or ``aborted`` where ``reply`` (:meth:`RolloutEngine.game_reply`) says the answer ended the
    game, else None."""
    if reply and reply.startswith(GAME_OVER):
        return reply[len(GAME_OVER):].rstrip(".")
    return None


def rule_score(reply: str | None, accepted: bool | None) -> float:
    """What a fork shows of an answer, read with no model (:data:`RULE_VALUES`): the control of every search and
    scorer that reads the game's answer (lookahead)."""
    outcome = game_over(reply)
    return RULE_VALUES.get(outcome, RULE_VALUES["accepted" if accepted else "rejected"])

