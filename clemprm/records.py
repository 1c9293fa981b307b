"""Record files: the parquet schemas of every stage's output, the one writer/reader for them, and the JSON writer.

Every file carries its provenance (config sections and package versions) in the parquet schema metadata
under the key ``clemprm``; :func:`read_provenance` returns it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from clemprm import distributed

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
MESSAGES = pa.list_(MESSAGE)

TURN = pa.struct([
    ("turn_idx", pa.int32()),          # index of this LLM call within the episode (0, 1, ...)
    ("player", pa.string()),           # clemcore player name, e.g. "Player 1"
    ("game_role", pa.string()),        # e.g. "Guesser"
    ("messages", MESSAGES),            # the player's perspective exactly as the model got it (roles merged)
    ("response", pa.string()),         # the answer the game saw (think text stripped)
    ("parse_ok", pa.bool_()),          # False when the game counted this answer as a rule violation
    ("prompt_tokens", pa.int32()),
    ("new_tokens", pa.int32()),
    ("reply", pa.string()),            # what the game answered (RolloutEngine.game_reply): its next message to this
                                       # player, "[to <role>] <message>" when another player moves next, or
                                       # "Game over: won|lost|aborted."; "" when the episode failed there
])

EPISODES = pa.schema([
    ("episode_id", pa.string()),       # "<game>/<experiment>/<game_id>/<repeat>"
    ("game", pa.string()),
    ("experiment", pa.string()),
    ("game_id", pa.int64()),
    ("split", pa.string()),
    ("policy", pa.string()),           # model name (spec + adapter)
    ("seed", pa.int64()),
    ("temperature", pa.float64()),
    ("n_turns", pa.int32()),
    ("aborted", pa.bool_()),
    ("lost", pa.bool_()),
    ("success", pa.bool_()),
    ("bench_score", pa.float64()),     # clembench BENCH_SCORE 0-100, NaN when aborted
    ("error", pa.string()),            # null, or the exception that ended this episode (then aborted)
    ("episode_scores", pa.string()),   # JSON of the game scorer's full "episode scores"
    ("turns", pa.list_(TURN)),
])

# playpen-data `interactions` layout: one row per LLM player perspective.
INTERACTIONS = pa.schema([
    ("messages", MESSAGES),
    ("meta", pa.struct([
        ("game", pa.string()),
        ("experiment", pa.string()),
        ("task_id", pa.int64()),
        ("player_name", pa.string()),
        ("game_role", pa.string()),
        ("model", pa.string()),
        ("outcome", pa.string()),      # success | lose | aborted
    ])),
])

# Where a turn was played: its instance (game, experiment, game_id), split, turn and player (branch points, answers).
TURN_PLACE_FIELDS = [
    ("game", pa.string()),
    ("experiment", pa.string()),
    ("game_id", pa.int64()),
    ("split", pa.string()),
    ("turn_idx", pa.int32()),
    ("player", pa.string()),
    ("game_role", pa.string()),
]

# One row per LLM turn of the SFT policy's trajectories (``branch_points``): the prefix the player saw and its answer.
BRANCH_POINT_FIELDS = [
    ("bp_id", pa.string()),            # "<episode_id>/<turn_idx>", a sibling "<episode_id>/<turn_idx>/s<j>"
    ("prefix_id", pa.string()),        # "<episode_id>/<turn_idx>": the state the candidate answers; siblings
                                       # (branch_points.siblings) share it
    ("episode_id", pa.string()),
    *TURN_PLACE_FIELDS,
    ("prefix", MESSAGES),              # the player's perspective before the candidate (roles merged)
    ("candidate", pa.string()),        # the answer the policy gave there
    ("history", pa.list_(pa.string())),  # every answer of the episode up to and including the candidate
                                       # (all players, in turn order): replaying it rebuilds the game state
    ("parse_ok", pa.bool_()),          # the game accepted the candidate (no rule violation)
    ("reply", pa.string()),            # the game's answer to the candidate (TURN's reply): part of the PRM's input
    ("seed", pa.int64()),              # the branch point's own seed (its continuations derive from it)
    ("episode_bench_score", pa.float64()),  # how the sampled trajectory itself ended (NaN when aborted)
    ("episode_success", pa.bool_()),
    ("episode_aborted", pa.bool_()),
    ("multiplicity", pa.int32()),      # how many of its state's sampled answers (the played one and the
                                       # branch_points.siblings - 1 others) were this candidate: >= 1, 1 without
                                       # siblings; a random pick among the samples picks it in that proportion
]
BRANCH_POINTS = pa.schema(BRANCH_POINT_FIELDS)

# Branch points with their Monte-Carlo soft label (``soft_labels``): K continuations played to the end.
SOFT_LABELS = pa.schema(BRANCH_POINT_FIELDS + [
    ("k", pa.int32()),                 # continuations played (0 when the candidate ended the game)
    ("terminal", pa.bool_()),          # the candidate ended the game: rollout_scores holds its own final score
    ("rollout_scores", pa.list_(pa.float64())),  # BENCH_SCORE (0-100) of each scored continuation; aborted ones
                                       # count as labels.aborted_value * 100, capped ones as the game's partial score
    ("n_aborted", pa.int32()),         # continuations that aborted (terminal: 1 when the candidate aborted the game)
    ("n_success", pa.int32()),         # continuations that won (terminal: 1 when the candidate won the game)
    ("n_capped", pa.int32()),          # continuations stopped at labels.max_rollout_rounds
    ("n_errors", pa.int32()),          # continuations the game failed on (its code, scorer or partial score
                                       # raised): left out of rollout_scores and the label
    ("new_tokens", pa.int64()),        # tokens the continuations generated (cost)
    ("label", pa.float64()),           # mean of rollout_scores / 100, in [0, 1]
])

# One continuation of a branch point as a soft-label shard keeps it: its answers with the game's verdict, how it ended.
CONTINUATION = pa.struct([
    ("k", pa.int32()),                 # its number j among the branch point's continuations (seeded from it)
    ("outcome", pa.string()),          # success | lost | aborted (the game ended it) | capped (stopped at
                                       # labels.max_rollout_rounds) | error (the game failed on it)
    ("bench_score", pa.float64()),     # BENCH_SCORE where the game ended it (NaN when aborted); null otherwise
    ("turns", pa.list_(pa.struct([     # its answers after the candidate, in turn order (all players)
        ("turn_idx", pa.int32()),
        ("player", pa.string()),
        ("game_role", pa.string()),
        ("shared", pa.int32()),        # leading messages of the perspective equal to the branch point's prefix's
        ("messages_tail", MESSAGES),   # the rest: perspective = prefix[:shared] + messages_tail (stored once)
        ("response", pa.string()),
        ("parse_ok", pa.bool_()),
    ]))),
])

# A soft-label shard (``results/labels/shards/<s>-of-<S>.parquet``): the soft labels with each branch point's
# continuations, which the answers records read (gather_soft_labels leaves them out of soft_labels.parquet).
SOFT_LABEL_SHARDS = pa.schema(list(SOFT_LABELS) + [("continuations", pa.list_(CONTINUATION))])

# Every answer played in the run on the train split with the game's verdict (``results/labels/answers.parquet``,
# clemprm.stages.answers): one row per distinct (instance, player, perspective, answer, verdict), with its plays.
ANSWER_SOURCES = ("base_rollouts", "sft_trajectories", "siblings", "label_continuations")
ANSWERS = pa.schema([
    ("source", pa.string()),           # the first stage that played it (ANSWER_SOURCES, in pipeline order)
    ("episode_id", pa.string()),       # that first play's episode (a sibling: its bp_id; a continuation:
                                       # "<bp_id>/k<j>")
    *TURN_PLACE_FIELDS,
    ("messages", MESSAGES),            # the player's perspective before the answer (roles merged)
    ("response", pa.string()),         # the answer
    ("parse_ok", pa.bool_()),          # the game's verdict: True accepted, False a rule violation
    ("count", pa.int32()),             # times it was played in the run (all sources)
    ("n_success", pa.int32()),         # plays whose episode the game then ended won,
    ("n_lost", pa.int32()),            # lost,
    ("n_aborted", pa.int32()),         # aborted; count - the three: plays whose episode did not end (a capped
                                       # continuation, a failed episode, a sibling not played on)
    ("bench_score", pa.float64()),     # mean BENCH_SCORE of the plays ended won or lost; NaN when none
])

# The trained PRM's predictions (``results/prm/predictions.parquet``, rule prm_adapter): one row per soft-label row it
# scored after training, on every side; the training record (steps, losses, examples...) in the provenance
# (``training``). Rule prm_metrics computes the metrics, baselines and gate from them with no model.
PRM_PREDICTIONS = pa.schema([
    ("row", pa.int64()),               # the soft-label row (its index in results/labels/soft_labels.parquet)
    ("bp_id", pa.string()),            # that row's bp_id (checked against the labels read beside it)
    ("side", pa.string()),             # train | validation (the slice of train instances) | heldout
    ("prediction", pa.float64()),      # the PRM's value in [0, 1] (NaN: a diverged PRM)
    ("policy_logprob", pa.float64()),  # the SFT policy's mean token log-probability of the candidate (a baseline);
                                       # null where no baseline reads it
])

# A turn where a search chose, on the path it played (eval episodes' ``choices``).
CHOICE = pa.struct([
    ("turn_idx", pa.int32()),          # the turn the chosen candidate was played as
    ("candidates", pa.list_(pa.string())),  # best-of-N: the N sampled answers; beam search: the distinct answers
                                       # its beam proposed there (one child each)
    ("scores", pa.list_(pa.float64())),  # the scorer's score of each (PRM, log-probability, random); -inf: a failed
                                       # generation, not scored
    ("chosen", pa.int32()),            # the index of the candidate played
])

# Evaluation episodes (``results/eval/<mode>.parquet``): the episode that counts, plus what its mode spent on it.
EVAL_EPISODES = pa.schema(list(EPISODES) + [
    ("mode", pa.string()),             # greedy_base | greedy_sft | random_of_n | best_of_n | beam_search
    ("policy_tokens", pa.int64()),     # tokens the policy generated for this episode, unplayed candidates included
    ("prm_pairs", pa.int64()),         # (perspective, candidate) pairs the PRM scored (0 for greedy)
    ("search_nodes", pa.int64()),      # candidate answers generated: the search tree's nodes (greedy: one per turn)
    ("choices", pa.list_(CHOICE)),     # the search's choices, in turn order (greedy: none; self_correct: null)
])

# Mode self_correct (``results/eval/self_correct.parquet``, clemprm.evaluation.self_correct): two attempts per
# episode id.
SELF_CORRECT_EPISODES = pa.schema(list(EVAL_EPISODES) + [
    ("attempt", pa.int32()),           # 1, or 2: the episode that started from attempt 1's transcript and outcome
    ("policy_role", pa.string()),      # sft (model + SFT adapter) | score (model + SCoRe adapter)
])

# Game states to train on single-turn (``rl.data: states``): the prompt at a state and the answers that reach it.
STATES = pa.schema([
    ("state_id", pa.string()),         # "<game>/<experiment>/<game_id>/<turn_idx>"
    ("game", pa.string()),
    ("experiment", pa.string()),
    ("game_id", pa.int64()),
    ("split", pa.string()),
    ("turn_idx", pa.int32()),          # answers played before the state (len(history))
    ("player", pa.string()),           # the player to move
    ("game_role", pa.string()),
    ("messages", MESSAGES),            # its perspective at the state (roles merged): the single-turn prompt
    ("history", pa.list_(pa.string())),  # every answer from the start up to the state: replaying them reaches it
    ("reference", pa.string()),        # the answer of the player that made the states (e.g. hanabi's rule-based one)
])


class RecordFileError(ValueError):
    """A record file that cannot be read or does not have the expected schema; names the file."""


def write_records(path: str | Path, rows: list[dict], schema: pa.Schema, provenance: dict) -> None:
    """Write ``rows`` as one parquet file, atomically (a killed job never leaves a half-written file); in a job of
    several processes, rank 0 alone writes (:mod:`clemprm.distributed`: every rank holds the gathered rows)."""
    if not distributed.is_main():
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    table = table.replace_schema_metadata({"clemprm": json.dumps(provenance, sort_keys=True)})
    with atomic_write(path) as tmp:
        pq.write_table(table, tmp)


class WriteFailed(OSError):
    """A file (a record, a JSON, an adapter) that could not be written; names it."""


SPACE_ERRORS = ("No space left on device", "File too large", "Disk quota exceeded")
"""How ENOSPC, EFBIG and EDQUOT read in an error's text (Python's OSError, pyarrow's, safetensors' Rust error)."""


def write_failed(what: str, error: BaseException) -> WriteFailed:
    """:class:`WriteFailed` naming ``what`` (e.g. ``record file <path>``) and the error, saying so when it is a lack of
    space (the errors of pyarrow, safetensors and a plain write name no file)."""
    space = " (is the disk full, or over a quota or a file size limit?)" if lack_of_space(error) else ""
    return WriteFailed(f"cannot write {what}: {type(error).__name__}: {error}{space}")


def lack_of_space(error: BaseException) -> bool:
    return any(text in str(error) for text in SPACE_ERRORS)


@contextlib.contextmanager
def atomic_write(path: Path):
    """A temporary file beside ``path`` to write, moved into place when the block ends; a write that fails removes it
    and raises :class:`WriteFailed` naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise write_failed(str(path), error) from error


PRODUCING_RULES = (("results/rollouts/", "base_rollouts"), ("results/sft/sft_data.parquet", "win_filter"),
                   ("results/labels/shards/", "soft_labels"),
                   ("results/labels/soft_labels.parquet", "gather_soft_labels"),
                   ("results/labels/answers.parquet", "gather_answers"), ("results/labels/", "branch_points"),
                   ("results/eval/", "eval_mode"), ("results/states/", "rl_states"),
                   ("results/prm/predictions.parquet", "prm_adapter"))
"""The rule that writes the record files under each path (the first prefix that matches; rules/*.smk)."""


def remake_hint(path: str | Path) -> str:
    """How to remake a record file of the pipeline that cannot be read: Snakemake remakes a file only when it is
    older than its inputs (or its params changed), so a corrupt one newer than its inputs stays until forced; '' for
    a file no rule writes."""
    text = Path(path).as_posix()
    rule = next((rule for prefix, rule in PRODUCING_RULES if f"/{prefix}" in f"/{text}"), None)
    if rule is None:
        return ""
    return (f" (rule {rule} writes it; Snakemake remakes it only when it is older than its inputs: "
            f"snakemake --forcerun {rule} remakes it)")


def read_table(path: str | Path, schema: pa.Schema | None = None) -> pa.Table:
    """Read a parquet record file; a missing, corrupt or mismatching file raises an error naming it (and the rule to
    force to remake it, :func:`remake_hint`)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        raise RecordFileError(f"cannot read record file {path}: {error}{remake_hint(path)}") from error
    if schema is not None:
        missing = [name for name in schema.names if name not in table.schema.names]
        if missing:   # a file of older code (e.g. without multiplicity) or of another stage
            raise RecordFileError(f"record file {path} lacks columns {missing} (has {table.schema.names})"
                                  f"{remake_hint(path)}")
        table = table.select(schema.names)
        mismatched = [f"{field.name} is {table.schema.field(field.name).type}, expected {field.type}"
                      for field in schema if not table.schema.field(field.name).type.equals(field.type)]
        if mismatched:
            raise RecordFileError(f"record file {path} does not have the expected schema: {'; '.join(mismatched)}")
    return table


def read_records(path: str | Path, schema: pa.Schema | None = None, *,
                 splits: tuple[str, ...] | None = None) -> list[dict]:
    """The rows of a record file (:func:`read_table`); ``splits``: the only splits the reading stage takes
    (:func:`check_splits`)."""
    rows = read_table(path, schema).to_pylist()
    if splits is not None:
        check_splits(path, rows, splits)
    if schema is not None and "prefix" in schema.names:
        check_prefixes(path, rows)
    return rows


def check_prefixes(path: str | Path, rows: list[dict]) -> None:
    """Raise :class:`RecordFileError` naming the file and the row (``bp_id``) whose ``prefix`` holds no user message:
    a branch point's prefix is the player's perspective before its answer, which starts with the game's prompt; the
    chat template would fail on it later with a jinja2 error that names neither."""
    for row in rows:
        if not any(message.get("role") == "user" for message in row.get("prefix") or []):
            raise RecordFileError(f"record file {path}: row bp_id {row.get('bp_id')!r} has a prefix with no user "
                                  f"message (prefix: {json.dumps(row.get('prefix'))[:120]}): a branch point's prefix "
                                  f"is the player's perspective before its answer, starting with the game's "
                                  f"prompt{remake_hint(path)}")


TRAIN_SPLITS = ("train",)
"""What a stage that learns from the policy's play reads (base rollouts -> win filter)."""
LABEL_SPLITS = ("train", "validation")
"""What the label stages read: branch points of train instances and of the PRM's held-out validation instances."""


def check_splits(path: str | Path, rows: list[dict], splits: tuple[str, ...]) -> None:
    """Raise :class:`RecordFileError` naming the file and the split when a row is not of ``splits``: a file of
    another split given in place of the stage's input (an eval episodes file as base rollouts, say)."""
    wrong: dict[str, int] = {}
    for row in rows:
        if row.get("split") not in splits:
            wrong[str(row.get("split"))] = wrong.get(str(row.get("split")), 0) + 1
    if wrong:
        found = ", ".join(f"{count} {split}" for split, count in sorted(wrong.items()))
        raise RecordFileError(f"record file {path} holds {found} rows (of {len(rows)}), where this stage reads only "
                              f"{' and '.join(splits)} rows: a file of another split (eval episodes, say) given "
                              f"in place of its input?")


def read_provenance(path: str | Path) -> dict:
    """The provenance a record file carries; a missing or corrupt file raises an error naming it."""
    try:
        metadata = pq.read_schema(path).metadata or {}
        return json.loads(metadata.get(b"clemprm", b"{}"))
    except (OSError, ValueError, pa.ArrowException) as error:   # JSONDecodeError and ArrowInvalid are ValueErrors
        raise RecordFileError(f"cannot read the provenance of record file {path}: {error}") from error


def instance_key(game, experiment, game_id) -> tuple[str, str, str]:
    """An instance's key ``(game, experiment, game_id)`` as text: clembench reuses ids across experiments, so an id
    alone names no instance (a playpen-data row's ``task_id`` is its ``game_id``)."""
    return str(game), str(experiment), str(game_id)


def write_json(path: str | Path, data: dict) -> None:
    """Write ``data`` as JSON atomically (no NaN: it is not JSON); rank 0 alone, as :func:`write_records`."""
    if not distributed.is_main():
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n"
    with atomic_write(path) as tmp:
        tmp.write_text(text)


def read_interactions(path: str | Path, schema=None) -> list[dict]:
    """Rows (``messages``, ``meta``) of a playpen-data interactions file: parquet, jsonl or json. ``schema`` (e.g.
    :data:`INTERACTIONS`, for the pipeline's own file) is the one a parquet file must have. Read by the SFT stage and
    at parse time (``sft.extra_data``: a file that is not such a table fails before any job)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"interactions file {path} does not exist")
    if path.suffix == ".parquet":
        rows = read_table(path, schema).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        text = path.read_text()
        try:
            if path.suffix == ".json" and text.lstrip().startswith("["):
                rows = json.loads(text)
            else:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(f"cannot read interactions file {path}: {error}") from error
    else:
        raise ValueError(f"interactions file {path}: unsupported format {path.suffix!r} (use .parquet or .jsonl)")
    for i, row in enumerate(rows):
        if not (isinstance(row, dict) and isinstance(row.get("messages"), list)
                and isinstance(row.get("meta"), dict)):
            raise ValueError(f"interactions file {path}, row {i}: needs `messages` (a list) and `meta` (a mapping), "
                             f"the playpen-data interactions layout")
    return rows
