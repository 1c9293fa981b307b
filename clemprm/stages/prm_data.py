"""The PRM's data (rule ``prm_adapter``, :mod:`clemprm.stages.prm`): the soft-label rows read and checked, one example
per row encoded as the PRM reads it (``prm.input``), sibling groups sampled whole, and the acceptance pre-training's
examples (answers labelled by the game's verdict). Rule ``prm_metrics`` reads the rows here too, with no model."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from clemprm import records
from clemprm.models.prm import encode_pair
from clemprm.stages.prm_metrics import indices_by_state

SIDES = ("train", "validation", "heldout")   # the examples a trained PRM is measured on (clemprm.stages.prm)
TRAINING_KEY = "training"   # where the predictions file's provenance holds the training record


@dataclass
class Example:
    """One branch point: the encoded pair, its soft label and its instance ``(game, experiment, game_id)``."""

    input_ids: list[int]
    truncated: bool
    label: float
    key: tuple[str, str, str]
    state_id: str = ""       # the state the candidate answers (its row's prefix_id): siblings share it
    row: int = -1            # index of its soft-label row
    multiplicity: int = 1    # how many of its state's sampled answers it is (the ranking metrics weigh by it)


def read_labels(path: str | Path) -> list[dict]:
    """The soft-label rows; an unreadable file, a label outside [0, 1] or a multiplicity below 1 is an error naming
    the file."""
    rows = records.read_records(path, records.SOFT_LABELS)
    for i, row in enumerate(rows):
        label = row["label"]
        if label is None or not 0.0 <= label <= 1.0:   # NaN fails both comparisons
            raise records.RecordFileError(f"record file {path}, row {i} ({row['bp_id']}): label {label!r} is not "
                                          f"in [0, 1]")
        if row["multiplicity"] is None or row["multiplicity"] < 1:
            raise records.RecordFileError(f"record file {path}, row {i} ({row['bp_id']}): multiplicity "
                                          f"{row['multiplicity']!r} is not a count of at least 1")
    return rows


def sibling_groups(examples: list[Example]) -> list[list[Example]]:
    """The examples grouped by ``state_id`` (siblings), groups in order of first appearance."""
    return [[examples[i] for i in group] for group in indices_by_state(examples)]


def sample_whole_groups(examples: list[Example], limit: int | None, seed: int) -> list[Example]:
    """At most ``limit`` examples (all when None) made of whole sibling groups: the groups in an order drawn by
    ``seed``, each taken while it fits (a pair-wise draw would split states and lose the pairs the ranking metrics
    and the pairwise loss compare)."""
    if limit is None or len(examples) <= limit:
        return examples
    groups = sibling_groups(examples)
    chosen, total = [], 0
    for group in random.Random(seed).sample(groups, len(groups)):
        if total + len(group) <= limit:
            chosen.extend(group)
            total += len(group)
    return chosen


def row_fields(index: int, row: dict) -> dict:
    """What the measures read of soft-label row ``index``: its label, instance, state (siblings share it), row and
    multiplicity (:class:`Example`'s fields after the text; :class:`clemprm.stages.prm_evaluation.Predicted`'s)."""
    return {"label": float(row["label"]), "key": records.instance_key(row["game"], row["experiment"], row["game_id"]),
            "state_id": row.get("prefix_id") or row["bp_id"], "row": index, "multiplicity": row["multiplicity"]}


def build_examples(rows: list[dict], tokenizer, chat_template_kwargs: dict, max_length: int,
                   prm_input: str = "candidate") -> list[Example]:
    """One example per soft-label row, its text as ``prm_input`` reads it (the game's reply only for
    ``candidate_with_reply``)."""
    reads_reply = prm_input == "candidate_with_reply"
    return [Example(*encode_pair(tokenizer, row["prefix"], row["candidate"], row["reply"] if reads_reply else "",
                                 chat_template_kwargs, max_length), **row_fields(index, row))
            for index, row in enumerate(rows)]


def acceptance_examples(answers_path: str, tokenizer, chat_template_kwargs: dict, max_length: int, limit: int,
                        seed: int) -> list[Example]:
    """Up to ``limit`` answers of the answers records (:data:`records.ANSWERS`, train split only: one row per
    distinct answer played in the run) as examples labelled by the game's verdict (``parse_ok``: 1 accepted,
    0 rejected), drawn by ``seed`` with as many of each verdict as the records allow; read as a PRM that reads the
    candidate alone reads them."""
    answers = records.read_records(answers_path, records.ANSWERS, splits=records.TRAIN_SPLITS)
    by_verdict = {verdict: [row for row in answers if row["parse_ok"] == verdict] for verdict in (True, False)}
    rng = random.Random(seed)
    for group in by_verdict.values():
        rng.shuffle(group)
    half = limit // 2
    rejected = by_verdict[False][:max(half, limit - len(by_verdict[True]))]
    chosen = by_verdict[True][:limit - len(rejected)] + rejected
    return [Example(*encode_pair(tokenizer, row["messages"], row["response"], "", chat_template_kwargs, max_length),
                    label=float(row["parse_ok"]), key=records.instance_key(row["game"], row["experiment"],
                                                                           row["game_id"]),
                    state_id=f"acceptance/{index}", row=-1 - index)
            for index, row in enumerate(chosen)]
