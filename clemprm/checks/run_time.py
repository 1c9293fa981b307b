"""Run-time failure policy of the stages: a stage with nothing left to work on stops the run, saying why.

A stage fails (:class:`StageFailure`, one message naming the game, the count and the first error) when

* a configured game has no instance in the split the stage plays, or every episode of a game failed (base
  rollouts, branch points, every eval mode);
* there are no wins to fine-tune on (``sft_adapter``), no branch points (``branch_points``), or no soft label
  with any variance (``gather_soft_labels``: a PRM cannot learn from labels that are all the same).

With ``on_failure: continue`` (config) the stage goes on instead and logs the message as a loud warning; the
evaluation summary (``results/prm_eval.json``) lists the warnings of the eval modes under ``warnings``. Isolated
failures (some episodes of a game) never stop a stage; :func:`failures_by_game` counts them per game for the logs
and the summary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

ON_FAILURE = ("stop", "continue")


class StageFailure(RuntimeError):
    """A stage left with nothing to work on (the message says which game, how many and the first error)."""


@dataclass
class GameFailures:
    """Failed episodes of one game: how many of how many, and the first error."""
    game: str
    failed: int
    episodes: int
    first_error: str | None

    def describe(self) -> str:
        return (f"{self.game}: {self.failed} of {self.episodes} episodes failed"
                + (f", first error: {self.first_error}" if self.first_error else ""))


def failures_by_game(rows: list[dict]) -> dict[str, GameFailures]:
    """Per game (in first-seen order): episodes, failed episodes (``error`` not null) and the first error."""
    by_game: dict[str, GameFailures] = {}
    for row in rows:
        entry = by_game.setdefault(row["game"], GameFailures(row["game"], 0, 0, None))
        entry.episodes += 1
        if row["error"] is not None:
            entry.failed += 1
            entry.first_error = entry.first_error or f"{row['episode_id']}: {row['error']}"
    return by_game


def fail_or_warn(stage: str, message: str, on_failure: str) -> str:
    """Raise :class:`StageFailure` (``on_failure: stop``), or log ``message`` loudly and return the warning."""
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    text = f"{stage}: {message}"
    if on_failure == "stop":
        raise StageFailure(f"{text} (set `on_failure: continue` in the config to go on anyway)")
    log.warning("CONTINUING DESPITE A FAILED STAGE (on_failure: continue): %s", text)
    return text


def check_episodes(stage: str, rows: list[dict], on_failure: str) -> list[str]:
    """Log failed episodes per game; fail the stage when every episode of some game failed. Returns warnings."""
    warnings = []
    for entry in failures_by_game(rows).values():
        if not entry.failed:
            continue
        if entry.failed == entry.episodes:
            warnings.append(fail_or_warn(stage, f"every episode of game {entry.describe()}", on_failure))
        else:
            log.warning("%s: %s", stage, entry.describe())
    return warnings


def check_instances(stage: str, catalog, split: str, on_failure: str) -> list[str]:
    """Fail the stage when a configured game has no instance in ``split`` (a clembench game's instances are split
    by a hash of their key, or by the instance list: a small game can end up with none in a split)."""
    warnings = []
    for game in catalog.games:
        if not catalog.instances(game, split):
            source = "the instance list names none" if catalog.instance_list is not None else "the hash split gave none"
            warnings.append(fail_or_warn(stage, f"game {game} has no {split} instances ({source}; choose them with "
                                                f"games.instance_list)", on_failure))
    return warnings


def check_not_empty(stage: str, what: str, count: int, context: str, on_failure: str) -> list[str]:
    """Fail the stage when ``count`` (of ``what``) is 0; ``context`` says what it came from."""
    if count:
        return []
    return [fail_or_warn(stage, f"no {what} ({context})", on_failure)]
