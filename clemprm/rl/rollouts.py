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

from clemprm.catalog import Instance
from clemprm.engine import Progress, RolloutEngine, Sampling, derive_seed


@dataclass
class Turn:
    """One played answer: the prompt and answer tokens, and what the objective assigns to its answer tokens."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantages: list[float] | None = None   # per answer token, set by the objective (None: not trained)
    kl_beta: float | None = None            # the K3 KL weight of this turn (None: ``rl.kl_beta``)
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
                   step: int, sampling: Sampling, reward_of) -> list[Group]:
    """Play ``group_size`` episodes of every instance with ``policy`` in lockstep; return one :class:`Group` each.

    Episode ``<game>/<experiment>/<game_id>/<g>`` of step ``step`` is seeded ``derive_seed(base_seed, "rl", step,
    episode_id)``. ``reward_of(row)`` is the outcome reward of an episode record. An answer whose game step failed
    ends its episode (an aborted episode, recorded with its error) and is not trained on.
    """
    episodes, owner = [], []
    for index, instance in enumerate(instances):
        game, experiment, game_id = instance.key
        for g in range(group_size):
            episode_id = f"{game}/{experiment}/{game_id}/{g}"
            episodes.append(engine.start(instance, [policy], episode_id, derive_seed(base_seed, "rl", step, episode_id)))
            owner.append(index)
    return play_groups(engine, policy, instances, episodes, owner, step=step, sampling=sampling, reward_of=reward_of)


def play_groups(engine: RolloutEngine, policy, instances: list[Instance], episodes: list, owner: list[int], *,
                step: int, sampling: Sampling, reward_of, label: str = "rollouts") -> list[Group]:
    """Play the started ``episodes`` (episode ``i`` of instance ``owner[i]``) with ``policy`` in lockstep; return
    one :class:`Group` per instance (its episodes in order). :func:`collect_groups` starts them; SCoRe's attempt
    builder starts attempt 2 episodes (:mod:`clemprm.rl.attempts`)."""
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
                    played[i].append((episode.turns[-1]["player"],
                                      Turn(list(generation.prompt_ids), list(generation.token_ids))))
        live = [i for i in live if not episodes[i].done]
        progress.update(len(episodes) - len(live), turns, tokens, force=not live)

    groups = [Group(instance, [], []) for instance in instances]
    for i, episode in enumerate(episodes):
        row = episode.record(policy.name, sampling)
        group = groups[owner[i]]
        group.rows.append(row)
        reward = float(reward_of(row))
        sequences: dict[str, Sequence] = {}
        for player, turn in played[i]:
            sequences.setdefault(player, Sequence(row["episode_id"], player, reward=reward,
                                                  success=bool(row["success"]))).turns.append(turn)
        if not sequences:  # nothing trainable was played (e.g. set-up failed): the episode still has its reward
            sequences[""] = Sequence(row["episode_id"], "", reward=reward, success=bool(row["success"]))
        group.sequences.extend(sequences.values())
    return groups
