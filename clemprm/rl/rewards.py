"""Outcome rewards of an episode record (``rl.reward``), the card's "accuracy + format" for games.

``success_played`` (default): ``success_weight * success + played_weight * (not aborted)``: the PRIME card's
accuracy (weight 1) and format (weight 1), where a game's "format" is that the episode was played to its end by
the rules (clembench's % played). ``bench_score``: ``BENCH_SCORE / 100`` of a played episode and
``aborted_value`` for an aborted one (the Playpen paper's "game score normalised, a fixed reward for aborts").

An outcome source is a function of an episode record (which holds every turn). ``turn_scores`` rewards every turn
on its own: ``sum_k turn_weights[k] * score_k`` of the scores the game logs at that answer (the ``turn scores``
events, :data:`clemprm.games.common.TURN_SCORES_EVENT`; hanabi logs its card's deduction score, exact deduction,
move rating and format). Any game that logs them can be trained on them; the objective turns the per-turn rewards
into per-turn advantages (:func:`clemprm.rl.grpo.turn_advantages`).
"""

from __future__ import annotations

import math

SOURCES = ("success_played", "bench_score", "turn_scores")
TURN_SOURCES = ("turn_scores",)   # sources that reward each turn on its own (not the episode's outcome)


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
    if source in TURN_SOURCES:
        raise ValueError(f"rl.reward.source {source!r} rewards turns, not episodes (turn_reward_function)")
    raise ValueError(f"rl.reward.source: unknown reward source {source!r} (known: {', '.join(SOURCES)})")


def reward_function(reward_settings: dict):
    """``row -> reward`` for :func:`clemprm.rl.rollouts.collect_groups`; a bad source fails here, before playing."""
    if reward_settings["source"] not in SOURCES:
        raise ValueError(f"rl.reward.source: unknown reward source {reward_settings['source']!r} "
                         f"(known: {', '.join(SOURCES)})")
    return lambda row: outcome_reward(row, reward_settings)


def turn_scores(episode) -> list[dict]:
    """The scores the game logged at each answer of ``episode`` (a :class:`clemprm.play.episode.Episode`, finished or
    not), aligned with ``episode.turns``; an error naming the game when it does not log one per answer."""
    from clemprm.games.common import turn_scores_of

    scores = turn_scores_of(episode.recorder.interactions)
    if len(scores) < len(episode.turns):
        raise ValueError(f"rl.reward.source turn_scores: game {episode.instance.game} logged per-turn scores for "
                         f"{len(scores)} of the {len(episode.turns)} answers of {episode.episode_id} (a game must log "
                         f"a 'turn scores' event at every answer)")
    return scores[:len(episode.turns)]


def weighted_turn_reward(scores: dict, weights: dict) -> float:
    """``sum_k weights[k] * scores[k]``; a weight naming a score the game does not log is an error naming it."""
    missing = sorted(set(weights) - set(scores))
    if missing:
        raise ValueError(f"rl.reward.turn_weights: {', '.join(missing)} not among the game's per-turn scores "
                         f"({', '.join(sorted(scores))})")
    return float(sum(weight * float(scores[key]) for key, weight in weights.items()))


def turn_reward_function(reward_settings: dict):
    """``episode -> [(reward, scores)] per turn`` for a per-turn source (``turn_scores``), else None."""
    if reward_settings["source"] not in TURN_SOURCES:
        return None
    weights = dict(reward_settings["turn_weights"])
    if not weights:
        raise ValueError("rl.reward.turn_weights: empty (source turn_scores needs at least one weighted score)")

    def rewards_of(episode) -> list[tuple[float, dict]]:
        return [(weighted_turn_reward(scores, weights), scores) for scores in turn_scores(episode)]
    return rewards_of
