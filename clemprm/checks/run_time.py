"""Run-time failure policy of the stages: a stage with nothing left to work on stops the run, saying why.

A stage fails (:class:`StageFailure`, one message naming each game, the count and the first error) when

* a configured game has no instance in the split the stage plays, or every episode of a game failed (base
  rollouts, branch points, every eval mode);
* there are no wins to fine-tune on (``sft_adapter``), a game's every SFT pair is too long for ``sft.max_length``
  even shortened (``sft_adapter``), no branch points (``branch_points``), or no soft label
  with any variance (``gather_soft_labels``: a PRM cannot learn from labels that are all the same);
* training left the SFT adapter as it was (``sft_adapter``: a schedule that never left learning rate 0, e.g. one
  optimizer step with a warmup, or weights that did not change);
* the trained PRM fails its quality gate (``prm_metrics``: its predictions collapsed, or it ranks siblings no better
  than a candidate-aware baseline, :func:`clemprm.stages.prm_metrics.quality_gate`).

A warning (:func:`warning_mark`: the run goes on as configured, but not quite as the config says, e.g. a capped
gradient accumulation) never stops a stage; it is a mark like a failure's, so the summary shows it.

With ``on_failure: continue`` (config) the stage goes on instead, logs the message as a loud warning and returns a
:class:`FailureMark`, which the stage records in its output (:data:`MARKS_KEY` of a record file's provenance, or of
its metrics JSON); the evaluation summary carries the marks of every stage it was built from into
``results/prm_eval.json`` (``upstream_warnings``, :func:`read_failure_marks`), and the report shows them first.
Isolated failures (some episodes of a game) never stop a stage; :func:`failures_by_game` counts them per game for
the logs and the summary.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from clemprm import records

log = logging.getLogger(__name__)

ON_FAILURE = ("stop", "continue")
# what a stage went on despite (FailureMark.condition)
FAILURE_CONDITIONS = ("no_instances", "all_episodes_failed", "no_wins", "no_training_examples",
                      "game_lost_to_max_length", "no_branch_points", "no_soft_labels", "no_label_variance",
                      "prm_not_learned", "adapter_not_trained")
# warnings (:func:`warning_mark`): the run went on as configured, but not quite as the config says
WARNING_CONDITIONS = ("grad_accum_capped", "heldout_capped", "probe_choice_at_grid_edge")
CONDITIONS = FAILURE_CONDITIONS + WARNING_CONDITIONS
MARKS_KEY = "failure_marks"   # where a stage's output records its marks (provenance or metrics JSON)


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


@dataclass
class FailureMark:
    """A fail-fast condition a stage went on despite (``on_failure: continue``).

    ``game`` is None when the condition is the stage's as a whole (no wins, no branch points, ...); ``count`` is how
    many items it is about: the game's failed episodes (all of them), the labels that are all alike, 0 where there
    was nothing at all; ``first_error`` the first failed episode's id and exception, where episodes failed."""
    stage: str
    condition: str
    game: str | None
    count: int
    first_error: str | None
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


def fail_or_warn(stage: str, message: str, on_failure: str, *, condition: str, game: str | None = None,
                 count: int = 0, first_error: str | None = None) -> FailureMark:
    """Raise :class:`StageFailure` (``on_failure: stop``), or log ``message`` loudly and return its mark."""
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    if condition not in CONDITIONS:
        raise ValueError(f"unknown failure condition {condition!r} (known: {', '.join(CONDITIONS)})")
    text = f"{stage}: {message}"
    if on_failure == "stop":
        raise StageFailure(f"{text} (set `on_failure: continue` in the config to go on anyway)")
    log.warning("CONTINUING DESPITE A FAILED STAGE (on_failure: continue): %s", text)
    return FailureMark(stage, condition, game, count, first_error, text)


def warning_mark(stage: str, message: str, *, condition: str, game: str | None = None,
                 count: int = 0) -> FailureMark:
    """Log ``message`` as a WARNING and return its mark: something that changes what a run means (a capped gradient
    accumulation, a capped held-out set) but is no failure, so it never stops a run, whatever ``on_failure`` says.
    The stage records the mark with its failure marks (:func:`marks_metadata`): the summary lists it in
    ``upstream_warnings`` and ``warnings``, and the report and the results table show it."""
    if condition not in CONDITIONS:
        raise ValueError(f"unknown warning condition {condition!r} (known: {', '.join(CONDITIONS)})")
    text = f"{stage}: {message}"
    log.warning("WARNING: %s", text)
    return FailureMark(stage, condition, game, count, None, text)


def check_episodes(stage: str, rows: list[dict], on_failure: str) -> list[FailureMark]:
    """Log failed episodes per game; fail the stage when every episode of some game failed, naming every such game
    (``on_failure: stop``: one failure for all of them). Returns the marks, one per such game."""
    lost = []
    for entry in failures_by_game(rows).values():
        if entry.failed and entry.failed == entry.episodes:
            lost.append(entry)
        elif entry.failed:
            log.warning("%s: %s", stage, entry.describe())
    if lost and on_failure == "stop":
        games = f"game {lost[0].describe()}" if len(lost) == 1 else \
            f"{len(lost)} games: " + "; ".join(entry.describe() for entry in lost)
        fail_or_warn(stage, f"every episode of {games}", on_failure, condition="all_episodes_failed")
    return [fail_or_warn(stage, f"every episode of game {entry.describe()}", on_failure,
                         condition="all_episodes_failed", game=entry.game, count=entry.failed,
                         first_error=entry.first_error) for entry in lost]


def check_instances(stage: str, catalog, split: str, on_failure: str) -> list[FailureMark]:
    """Fail the stage when a configured game has no instance in ``split`` (a clembench game's instances are split
    by a hash of their key, or by the instance list: a small game can end up with none in a split)."""
    marks = []
    for game in catalog.games:
        if not catalog.instances(game, split):
            source = "the instance list names none" if catalog.instance_list is not None else "the hash split gave none"
            marks.append(fail_or_warn(stage, f"game {game} has no {split} instances ({source}; choose them with "
                                             f"games.instance_list)", on_failure, condition="no_instances", game=game))
    return marks


def check_not_empty(stage: str, what: str, count: int, context: str, on_failure: str, *,
                    condition: str) -> list[FailureMark]:
    """Fail the stage when ``count`` (of ``what``) is 0; ``context`` says what it came from."""
    if count:
        return []
    return [fail_or_warn(stage, f"no {what} ({context})", on_failure, condition=condition)]


def marks_metadata(marks: list[FailureMark]) -> dict:
    """The entry a stage adds to its output's provenance (or metrics) to record its marks."""
    return {MARKS_KEY: [mark.as_dict() for mark in marks]}


def read_failure_marks(path: str | Path) -> list[dict]:
    """The marks a stage output records: a parquet record file's provenance, or a metrics JSON (``.json``)."""
    path = Path(path)
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text()).get(MARKS_KEY, [])
        except (OSError, ValueError) as error:
            raise records.RecordFileError(f"cannot read the failure marks of {path}: {error}") from error
    return records.read_provenance(path).get(MARKS_KEY, [])
