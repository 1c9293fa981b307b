"""The score of one soft-label continuation: finished, aborted, capped, or failed (:mod:`clemprm.stages.labels`).

Each continuation is scored by the game's own BENCH_SCORE; an aborted one counts ``labels.aborted_value`` x 100; one
stopped after ``labels.max_rollout_rounds`` turns past the branch point is scored with the game's partial score at
the cutoff (:func:`partial_score`): the game master's ``partial_bench_score()`` where it has one, otherwise the
game's own scorer on a copy of the episode closed as lost (:func:`closed_as_lost_score`, which reaches into
clemcore's recorder to close the episode the way clemcore leaves a finished one).

A continuation whose game raises (its code, its scorer, its ``partial_bench_score``, its scorer on an episode with
answers closed as lost) is an error (:class:`ContinuationError`): :func:`scored` counts it per game in
:class:`ErrorCounts` and logs it, and the labelling leaves it out of the label.
"""

from __future__ import annotations

import logging
import math

from clemprm.play.contract import Sampling
from clemprm.play.episode import Episode

log = logging.getLogger(__name__)


class ContinuationError(Exception):
    """A continuation the game could not play or score to the end (its code, scorer or partial score raised)."""


_NO_PARTIAL_SCORE_LOGGED: set[str] = set()


def partial_score(episode: Episode) -> float:
    """The BENCH_SCORE (0-100) of an unfinished episode at the cutoff. A game master's ``partial_bench_score()``
    when it has one (an exception there is the continuation's error); otherwise :func:`closed_as_lost_score`
    (whose :class:`ContinuationError` is the continuation's error too), and 0 where that yields no score (logged
    once per game)."""
    partial = getattr(episode.env.game_master, "partial_bench_score", None)
    if partial is not None:
        try:
            return float(partial())
        except Exception as error:
            raise ContinuationError(f"partial_bench_score raised {type(error).__name__}: {error}") from error
    score, reason = closed_as_lost_score(episode)
    if reason is None:
        return score
    if episode.instance.game not in _NO_PARTIAL_SCORE_LOGGED:
        _NO_PARTIAL_SCORE_LOGGED.add(episode.instance.game)
        log.info("%s: no partial score from its scorer on an episode closed as lost (%s): capped continuations "
                 "score 0", episode.instance.game, reason)
    return 0.0


def closed_as_lost_score(episode: Episode) -> tuple[float, str | None]:
    """``(Main Score, None)`` of the game's own scorer on a copy of the unfinished ``episode`` closed as lost, shaped
    as clemcore leaves a finished episode: a round the game had opened but not played is closed first
    (:func:`close_unplayed_round`), then the game's end-of-game hook logs its keys and events (into the last played
    round, as when it ends), then Aborted 0, Lose 1, Success 0 are logged over whatever it logged.

    ``(nan, why)`` when there is no score: the scorer's Main Score is NaN, or the episode holds no answer yet and
    the hook or scorer raised on it (clemcore's scorers divide by the episode's requests: an empty episode cannot be
    scored; not an error). A hook or scorer that raises on an episode with answers is an error of the game's code:
    :class:`ContinuationError`."""
    from clemcore.clemgame.legacy.master import DialogueGameMaster as LegacyDialogueGameMaster
    from clemcore.clemgame.metrics import METRIC_ABORTED, METRIC_LOSE, METRIC_SUCCESS

    closed = episode.fork()
    interactions = closed.recorder.interactions
    try:
        closing = closed.env.game_master
        round_closed = close_unplayed_round(closed.recorder)
        with closed.own_generators():
            closing._on_after_game()
            closing.log_game_end(auto_count_logging=not isinstance(closing, LegacyDialogueGameMaster))
        if round_closed:
            drop_own_counts_of_unplayed_round(interactions)
        for key, value in ((METRIC_ABORTED, 0), (METRIC_LOSE, 1), (METRIC_SUCCESS, 0)):
            closed.recorder.log_key(key, value)
        score = float(closed.scores().get("Main Score", math.nan))
    except Exception as error:
        if not holds_answers(interactions):
            return math.nan, f"no answer yet, {type(error).__name__}: {error}"
        raise ContinuationError(f"the game's end-of-game hook or scorer raised on the episode closed as lost: "
                                f"{type(error).__name__}: {error}") from error
    return (score, None) if math.isfinite(score) else (math.nan, f"its Main Score is {score}")


def holds_answers(interactions: dict) -> bool:
    """Whether any player answered yet in an episode's ``interactions`` (clemcore's players log each answer as a
    ``get message`` event; a game may log other events during set-up)."""
    return any(event["action"]["type"] == "get message" for events in interactions["turns"] for event in events)


def close_unplayed_round(recorder) -> bool:
    """Undo the recorder's opening of the last round when nothing happened in it yet (clemcore opens the next round
    as soon as one ends, but not after the last one): a game never ends in such a round, and clemcore's scorers
    divide by each round's requests. What the end-of-game hook logs next then lands in the last played round, as
    in a finished episode. Its per-round request counts go with it. True when a round was closed.

    Reaches into clemcore 3.7.2's ``GameInteractionsRecorder`` (its round index and per-round counts), the inverse
    of its ``log_next_round``."""
    turns = recorder.interactions["turns"]
    if len(turns) < 2 or turns[-1]:
        return False
    turns.pop()
    for counts in (recorder.requests_counts, recorder.violated_requests_counts, recorder.successful_requests_counts):
        counts.pop()
    recorder._current_round -= 1
    return True


def drop_own_counts_of_unplayed_round(interactions: dict) -> None:
    """Per-round request counts a game logs itself (legacy games, in their end-of-game hook) that still hold an
    entry for the round :func:`close_unplayed_round` closed."""
    from clemcore.clemgame.metrics import (METRIC_REQUEST_COUNT, METRIC_REQUEST_COUNT_PARSED,
                                           METRIC_REQUEST_COUNT_VIOLATED)

    for key in (METRIC_REQUEST_COUNT, METRIC_REQUEST_COUNT_PARSED, METRIC_REQUEST_COUNT_VIOLATED):
        counts = interactions.get(key)
        if isinstance(counts, list) and len(counts) == len(interactions["turns"]) + 1:
            counts.pop()


def continuation_score(episode: Episode, capped: bool, aborted_value: float) -> tuple[float, bool, bool]:
    """``(score 0-100, aborted, success)`` of a finished or capped continuation; :class:`ContinuationError` when
    the game failed on it (its code or scorer raised)."""
    if episode.error is not None:
        raise ContinuationError(episode.error)
    if capped:
        return partial_score(episode), False, False
    row = episode.record("", Sampling())
    if row["error"] is not None:  # the scorer raised
        raise ContinuationError(row["error"])
    if row["aborted"]:
        return 100.0 * aborted_value, True, False
    return row["bench_score"], False, row["success"]


def scored(episode: Episode, capped: bool, aborted_value: float, errors: "ErrorCounts"):
    """:func:`continuation_score`, or None when the game failed on it (counted in ``errors``)."""
    try:
        return continuation_score(episode, capped, aborted_value)
    except ContinuationError as error:
        errors.add(episode.instance.game, episode.episode_id, str(error))
        return None


class ErrorCounts:
    """Continuation errors per game: how many, and the first one (logged when it happens)."""

    def __init__(self):
        self.count: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def add(self, game: str, where: str, error: str) -> None:
        self.count[game] = self.count.get(game, 0) + 1
        self.first.setdefault(game, f"{where}: {error}")
        log.warning("%s: continuation %s failed (%d so far in this game): %s", game, where, self.count[game], error)

    def lines(self) -> str:
        return "\n".join(f"{game}: {count} continuations failed, first: {self.first[game]}"
                         for game, count in sorted(self.count.items()))
