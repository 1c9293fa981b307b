"""Outcome rewards of an episode record (``rl.reward``), the card's "accuracy + format" for games.

``success_played`` (default): ``success_weight * success + played_weight * (not aborted)``: the PRIME card's
accuracy (weight 1) and format (weight 1), where a game's "format" is that the episode was played to its end by
the rules (clembench's % played). ``bench_score``: ``BENCH_SCORE / 100`` of a played episode and
``aborted_value`` for an aborted one (the Playpen paper's "game score normalised, a fixed reward for aborts").

A reward source is a function of an episode record (which holds every turn). One that scores single turns (the
Hanabi issue's state tracking and move rating) plugs in beside these and its objective turns the per-turn rewards
into per-token advantages (:attr:`clemprm.rl.rollouts.Turn.advantages`); the trainer is the same.
"""

from __future__ import annotations

import math

SOURCES = ("success_played", "bench_score")


def outcome_reward(row: dict, reward_settings: dict) -> float:
    """The outcome reward of one episode record under ``rl.reward``."""
    source = reward_settings["source"]
    if source == "success_played":
        return (reward_settings["success_weight"] * bool(row["success"])
                + reward_settings["played_weight"] * (not row["aborted"]))
    if source == "bench_score":
        score = row["bench_score"]
        if row["aborted"] or score is None or math.isnan(score):
            return float(reward_settings["aborted_value"])
        return float(score) / 100
    raise ValueError(f"rl.reward.source: unknown reward source {source!r} (known: {', '.join(SOURCES)})")


def reward_function(reward_settings: dict):
    """``row -> reward`` for :func:`clemprm.rl.rollouts.collect_groups`; a bad source fails here, before playing."""
    if reward_settings["source"] not in SOURCES:
        raise ValueError(f"rl.reward.source: unknown reward source {reward_settings['source']!r} "
                         f"(known: {', '.join(SOURCES)})")
    return lambda row: outcome_reward(row, reward_settings)
