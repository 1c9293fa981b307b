"""Per-turn scores of hanabi episodes: the rewards of the Hanabi card (state tracking and move rating).

At every answer the game master logs one ``turn scores`` event (in the answer's own round): ``format`` (1 when the
answer was accepted: a valid, legal move, and in strict mode a valid deduction), ``deduction`` (the deduction
score, :mod:`clemprm.games.hanabi.protocol`), ``exact_deduction`` (0/1) and ``move_rating`` (the move's value under
the rule-based player, :mod:`clemprm.games.hanabi.bot`; 0 for an answer that was not accepted), plus the move and
its value. The game's scorer turns them into clemcore ``round scores`` (one round per answer); :func:`turn_rewards`
reads them straight from an engine episode, also from an unfinished one (single-turn training on states).

No clemcore import here (the game's ``master.py`` imports this module).
"""

from __future__ import annotations

from clemprm.games.common import TURN_SCORES_EVENT, turn_scores_of

__all__ = ["REWARD_KEYS", "ROUND_SCORE_NAMES", "TURN_SCORES_EVENT", "turn_rewards", "turn_scores_of"]

REWARD_KEYS = ("deduction", "exact_deduction", "move_rating", "format")
ROUND_SCORE_NAMES = {"deduction": "Deduction Score", "exact_deduction": "Exact Deduction",
                     "move_rating": "Move Rating", "format": "Format"}
"""The clemcore round-score name of each reward."""


def turn_rewards(episode) -> list[dict]:
    """One ``{deduction, exact_deduction, move_rating, format}`` dict per turn of ``episode`` (a
    :class:`clemprm.play.episode.Episode` of hanabi), aligned with ``episode.turns``; works on unfinished episodes."""
    scores = turn_scores_of(episode.recorder.interactions)
    if len(scores) < len(episode.turns):
        raise ValueError(f"episode {episode.episode_id}: per-turn scores for {len(scores)} of its "
                         f"{len(episode.turns)} turns (only hanabi logs them)")
    return [{key: scores[index][key] for key in REWARD_KEYS} for index in range(len(episode.turns))]
