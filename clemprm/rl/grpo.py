"""GRPO for games: the outcome advantage of an episode within its group, on every policy turn of the episode.

``A = (r - mean(r)) / std(r)`` over the ``G`` episodes of one instance (population std), and ``0`` for every
episode of a group whose rewards are all equal (std 0: nothing to compare; the Playpen paper's rule). Every token
of every policy turn of an episode gets the episode's advantage; in self-play both players' sequences do (the
players of a cooperative game share its outcome).

Per-turn rewards (``rl.reward.source: turn_scores``): every turn has its own reward, and its advantage is the
z-score of that reward among all policy turns of the group (:func:`turn_advantages`): a turn is compared with the
other answers to the same instance (single-turn states: the ``G`` answers at one state, i.e. GRPO on turns). The
turn's own reward, not the sum of the later turns' (the card's move rating already values a move by the play that
follows it).
"""

from __future__ import annotations

import math

from clemprm.rl.rollouts import Group

STD_EPSILON = 1e-8   # a group whose reward std is below this counts as equal rewards


def outcome_advantages(rewards: list[float]) -> list[float]:
    """``(r - mean) / std`` per reward of one group; all 0 when the rewards are equal."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    if std < STD_EPSILON:
        return [0.0] * n
    return [(r - mean) / std for r in rewards]


def episode_advantages(group: Group) -> dict[str, float]:
    """The outcome advantage of each episode of ``group``, by episode id."""
    return {row["episode_id"]: advantage
            for row, advantage in zip(group.rows, outcome_advantages(group.rewards()))}


def summary(values: list[float]) -> dict:
    """mean, std, min, max of ``values`` (None when empty)."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    mean = sum(values) / len(values)
    return {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)),
            "min": min(values), "max": max(values)}


def has_turn_rewards(group: Group) -> bool:
    """Whether every policy turn of ``group`` has its own reward (a per-turn reward source)."""
    turns = [turn for sequence in group.sequences for turn in sequence.turns]
    return bool(turns) and all(turn.reward is not None for turn in turns)


def turn_advantages(group: Group) -> dict[int, float]:
    """The advantage of each policy turn of ``group`` (by ``id(turn)``): the z-score of its own reward among all
    the group's turns (0 for all when they are equal)."""
    turns = [turn for sequence in group.sequences for turn in sequence.turns]
    return {id(turn): advantage for turn, advantage in zip(turns, outcome_advantages([t.reward for t in turns]))}


class GRPO:
    """The outcome-advantage objective (no process reward)."""

    name = "grpo"

    def assign(self, trainer, groups: list[Group]) -> dict:
        """Set every turn's per-token advantages; return the step's advantage statistics."""
        per_episode, zero_groups = [], 0
        for group in groups:
            if has_turn_rewards(group):
                by_turn = turn_advantages(group)
                zero_groups += not any(by_turn.values())
                per_episode += list(by_turn.values())
                for sequence in group.sequences:
                    for turn in sequence.turns:
                        turn.advantages = [by_turn[id(turn)]] * len(turn.completion_ids)
                continue
            advantages = episode_advantages(group)
            zero_groups += not any(advantages.values())
            per_episode += list(advantages.values())
            for sequence in group.sequences:
                for turn in sequence.turns:
                    turn.advantages = [advantages[sequence.episode_id]] * len(turn.completion_ids)
        return {"outcome_advantage": summary(per_episode), "zero_advantage_groups": zero_groups}
