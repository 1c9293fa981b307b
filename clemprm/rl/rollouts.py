"""Groups of episodes for on-policy RL, played by the current policy through the one rollout engine in lockstep.

A *group* is ``G`` episodes of one train instance, each with its own seed. All groups of a step advance together:
each engine step is one ``propose`` call (one ``generate`` call for every waiting episode of every group), then
each answer is applied. Every answer keeps the tokens it was sampled as (the rendered prompt's ids and the
generated ids, end token included), so training scores exactly what was played.

A *sequence* is what the policy is trained on: one player's turns in one episode. In a one-player game an episode
is one sequence; in two-player self-play (``wordref``) each player's turns are that player's sequence, so a
group holds ``G`` sequences per player.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import logging

from clemprm.play.catalog import Instance
from clemprm.play.contract import Sampling
from clemprm.play.engine import Progress, RolloutEngine
from clemprm.stats import derive_seed

log = logging.getLogger(__name__)


@dataclass
class Turn:
    """One played answer: the prompt and answer tokens, and what the objective assigns to its answer tokens."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantages: list[float] | None = None   # per answer token, set by the objective (None: not trained)
    kl_beta: float | None = None            # the K3 KL weight of this turn (None: ``rl.kl_beta``)
    reward: float | None = None             # this turn's own reward (a per-turn source; None: the episode's)
    scores: dict | None = None              # the per-turn scores the game logged for this answer
    sampler_logprobs: list[float] | None = None   # per answer token, under the weights that sampled it
    kl_sum: float | None = None             # the summed K3 of its tokens in the update that trained it

    @property
    def trained(self) -> bool:
        """Whether this turn contributes a gradient: a non-zero advantage, or a KL term."""
        return self.advantages is not None and (any(self.advantages) or bool(self.kl_beta))


@dataclass
class Sequence:
    """One player's turns of one episode, with the episode's outcome."""

    episode_id: str
    player: str
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0      # the outcome reward of the episode (set by the reward source)
    success: bool = False

    @property
    def tokens(self) -> int:
        return sum(len(turn.completion_ids) for turn in self.turns)


@dataclass
class Group:
    """``G`` episodes of one instance: their records (rows of :data:`clemprm.records.EPISODES`) and sequences."""

    instance: Instance
    rows: list[dict]
    sequences: list[Sequence]

    def rewards(self) -> list[float]:
        """The outcome reward of each episode, in episode order."""
        by_episode = {sequence.episode_id: sequence.reward for sequence in self.sequences}
        return [by_episode.get(row["episode_id"], 0.0) for row in self.rows]

    def by_player(self) -> dict[str, list[Sequence]]:
        """The group's sequences per player (the cohort a per-player baseline compares)."""
        cohorts: dict[str, list[Sequence]] = {}
        for sequence in self.sequences:
            cohorts.setdefault(sequence.player, []).append(sequence)
        return cohorts


def collect_groups(engine: RolloutEngine, policy, instances: list[Instance], group_size: int, *, base_seed: int,
                   step: int, sampling: Sampling, reward_of, turn_reward_of=None) -> list[Group]:
    """Play ``group_size`` episodes of every instance with ``policy`` in lockstep; return one :class:`Group` each.

    Episode ``<game>/<experiment>/<game_id>/<g>`` of step ``step`` is seeded ``derive_seed(base_seed, "rl", step,
    episode_id)``. ``reward_of(row)`` is the outcome reward of an episode record; with ``turn_reward_of(episode)``
    (a per-turn source, :func:`clemprm.rl.rewards.turn_reward_function`) every turn gets its own reward and scores
    instead, and a sequence's reward is the mean of its turns'. An answer whose game step failed ends its episode
    (an aborted episode, recorded with its error) and is not trained on.
    """
    episodes, owner = [], []
    for index, instance in enumerate(instances):
        game, experiment, game_id = instance.key
        for g in range(group_size):
            episode_id = f"{game}/{experiment}/{game_id}/{g}"
            seed = derive_seed(base_seed, "rl", step, episode_id)
            episodes.append(engine.start(instance, [policy], episode_id, seed))
            owner.append(index)
    return play_groups(engine, policy, instances, episodes, owner, step=step, sampling=sampling, reward_of=reward_of,
                       turn_reward_of=turn_reward_of)


def play_groups(engine: RolloutEngine, policy, instances: list[Instance], episodes: list, owner: list[int], *,
                step: int, sampling: Sampling, reward_of, turn_reward_of=None, label: str = "rollouts") -> list[Group]:
    """Play the started ``episodes`` (episode ``i`` of instance ``owner[i]``) with ``policy`` in lockstep; return
    one :class:`Group` per instance (its episodes in order), rewarded as :func:`collect_groups` says.
    :func:`collect_groups` starts them; SCoRe's attempt builder starts attempt 2 episodes
    (:mod:`clemprm.rl.attempts`)."""
    played: list[list[tuple[str, Turn]]] = [[] for _ in episodes]
    progress = Progress(len(episodes), f"rl step {step} {label}")
    live = [i for i, episode in enumerate(episodes) if not episode.done]
    while live:
        proposals = engine.propose([episodes[i] for i in live], 1, sampling)
        turns = tokens = 0
        for i, candidates in zip(live, proposals):
            for generation in candidates:
                episode = episodes[i]
                before = len(episode.turns)
                engine.apply(episode, generation)
                turns += 1
                tokens += generation.new_tokens
                if len(episode.turns) > before and generation.token_ids:
                    played[i].append((episode.turns[-1]["player"], len(episode.turns) - 1,
                                      Turn(list(generation.prompt_ids), list(generation.token_ids),
                                           sampler_logprobs=generation.logprobs)))
        live = [i for i in live if not episodes[i].done]
        progress.update(len(episodes) - len(live), turns, tokens, force=not live)

    groups = [Group(instance, [], []) for instance in instances]
    for i, episode in enumerate(episodes):
        per_turn = turn_reward_of(episode) if turn_reward_of is not None else None   # before record() ends it
        row = episode.record(policy.name, sampling)
        group = groups[owner[i]]
        group.rows.append(row)
        reward = float(reward_of(row)) if per_turn is None else 0.0
        sequences: dict[str, Sequence] = {}
        for player, index, turn in played[i]:
            if per_turn is not None:
                turn.reward, turn.scores = per_turn[index]
            sequences.setdefault(player, Sequence(row["episode_id"], player, reward=reward,
                                                  success=bool(row["success"]))).turns.append(turn)
        if per_turn is not None:
            for sequence in sequences.values():
                sequence.reward = sum(turn.reward for turn in sequence.turns) / len(sequence.turns)
        if not sequences:  # nothing trainable was played (e.g. set-up failed): the episode still has its reward
            sequences[""] = Sequence(row["episode_id"], "", reward=reward, success=bool(row["success"]))
        group.sequences.extend(sequences.values())
    return groups


def collect_state_groups(engine: RolloutEngine, policy, states: list[tuple[Instance, dict]], group_size: int, *,
                         base_seed: int, step: int, sampling: Sampling, turn_reward_of) -> list[Group]:
    """Single-turn groups: ``group_size`` answers of ``policy`` at each state of a prompt set (rows of
    :data:`clemprm.records.STATES` with their instance), all in one ``propose`` call; return one :class:`Group` per
    state, each answer a one-turn sequence whose reward is that turn's (``turn_reward_of``, a per-turn source).

    Each answer is played in its own replay of the state's ``history`` (episode ``<state_id>/<g>``, seeded
    ``derive_seed(base_seed, "rl", step, episode_id)``); the game goes no further than that answer. A group's
    rows are the game's state after the answer: ``success`` / ``aborted`` only when that answer ended the game."""
    from clemprm.stages.rl_states import replay_state

    episodes, owner = [], []
    for index, (instance, state) in enumerate(states):
        for g in range(group_size):
            episode_id = f"{state['state_id']}/{g}"
            episodes.append(replay_state(engine, instance, list(state["history"]), [policy], episode_id,
                                         derive_seed(base_seed, "rl", step, episode_id)))
            owner.append(index)
    groups = [Group(instance, [], []) for instance, _ in states]
    for i, (episode, candidates) in enumerate(zip(episodes, engine.propose(episodes, 1, sampling))):
        before = len(episode.turns)
        for generation in candidates:
            engine.apply(episode, generation)
        group = groups[owner[i]]
        row = (episode.record(policy.name, sampling) if episode.done else
               {"episode_id": episode.episode_id, "game": group.instance.key[0], "success": False, "aborted": False,
                "error": None})
        group.rows.append(row)
        sequence = Sequence(episode.episode_id, "", success=bool(row["success"]))
        if len(episode.turns) > before and candidates and candidates[0].token_ids:
            generation = candidates[0]
            turn = Turn(list(generation.prompt_ids), list(generation.token_ids), sampler_logprobs=generation.logprobs)
            turn.reward, turn.scores = turn_reward_of(episode)[before]
            sequence.player, sequence.reward = episode.turns[before]["player"], turn.reward
            sequence.turns.append(turn)
        group.sequences.append(sequence)
    log.info("rl step %d: %d answers at %d states", step, len(episodes), len(states))
    return groups
