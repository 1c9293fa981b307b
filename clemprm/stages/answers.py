"""The ``gather_answers`` stage: every answer the run played on the train split, with the game's verdict on it.

Each stage that plays keeps what it played, so gathering them plays nothing again:

- ``base_rollouts``: the base policy's episodes (``results/rollouts/base_train.parquet``);
- ``sft_trajectories``: the SFT policy's episodes the branch points come from
  (``results/labels/sft_train_episodes.parquet``);
- ``siblings``: the answers sampled beside a branch point's candidate and played one step
  (``results/labels/branch_points.parquet``, ``branch_points.siblings`` > 1);
- ``label_continuations``: every turn of every K-rollout continuation (the soft-label shards,
  :data:`clemprm.records.SOFT_LABEL_SHARDS`).

A turn's verdict (``parse_ok``: the game accepted the answer or counted a rule violation) is a function of the
player's perspective and the answer, known for free on every turn, where a soft label costs K continuations. Rows
are deduplicated: one per distinct (instance, player, perspective, answer, verdict), with ``count``, the times it
was played, and how the episodes of those plays ended (``n_success``, ``n_lost``, ``n_aborted``, the mean
``bench_score``; a continuation capped at ``labels.max_rollout_rounds``, an episode the game or model failed on
and a sibling not played on did not end). The first play names the row (its source, episode and turn), sources
taken in the order above. Validation-split rows (the PRM's held-out states) are left out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

from clemprm import records
from clemprm.config import provenance

log = logging.getLogger(__name__)


def episode_plays(path: str, source: str) -> Iterator[tuple[dict, str | None, float | None]]:
    """``(answer, outcome, bench_score)`` of every turn of the train episodes of ``path`` (:data:`records.EPISODES`);
    outcome ``success | lost | aborted`` where the game ended the episode, None where it failed (``error``)."""
    for episode in records.read_records(path, records.EPISODES):
        if episode["split"] != "train":
            continue
        outcome = (None if episode["error"] is not None else "aborted" if episode["aborted"]
                   else "success" if episode["success"] else "lost")
        for turn in episode["turns"]:
            answer = answer_of(source, episode["episode_id"], episode, turn, turn["messages"])
            yield answer, outcome, episode["bench_score"]


def sibling_plays(bp_path: str, shard_rows: list[dict]) -> Iterator[tuple[dict, str | None, float | None]]:
    """The train siblings of ``bp_path`` (:data:`records.BRANCH_POINTS` rows sampled beside the played candidate),
    each ended as its soft-label row says when it ended the game (a terminal row), else not ended."""
    ended = {row["bp_id"]: terminal_outcome(row) for row in shard_rows if row["terminal"]}
    for bp in records.read_records(bp_path, records.BRANCH_POINTS):
        if bp["split"] != "train" or bp["bp_id"] == bp["prefix_id"]:
            continue
        turn = {"turn_idx": bp["turn_idx"], "player": bp["player"], "game_role": bp["game_role"],
                "response": bp["candidate"], "parse_ok": bp["parse_ok"]}
        yield (answer_of("siblings", bp["bp_id"], bp, turn, bp["prefix"]), *ended.get(bp["bp_id"], (None, None)))


def terminal_outcome(row: dict) -> tuple[str, float]:
    """How a candidate that ended the game ended, from its terminal soft-label row (its own score)."""
    if row["n_aborted"]:
        return "aborted", math.nan
    return ("success" if row["n_success"] else "lost"), row["rollout_scores"][0]


def continuation_plays(shard_rows: list[dict]) -> Iterator[tuple[dict, str | None, float | None]]:
    """Every turn of the train branch points' continuations (:data:`records.CONTINUATION`), its perspective rebuilt
    from the branch point's prefix."""
    for row in shard_rows:
        if row["split"] != "train":
            continue
        for continuation in row["continuations"] or []:
            ended = continuation["outcome"] in ("success", "lost", "aborted")
            for turn in continuation["turns"]:
                messages = row["prefix"][:turn["shared"]] + turn["messages_tail"]
                yield (answer_of("label_continuations", f"{row['bp_id']}/k{continuation['k']}", row, turn, messages),
                       continuation["outcome"] if ended else None, continuation["bench_score"])


def answer_of(source: str, episode_id: str, where: dict, turn: dict, messages: list[dict]) -> dict:
    """The identifying columns of one play (:data:`records.ANSWERS` without the counts)."""
    return {"source": source, "episode_id": episode_id, "game": where["game"], "experiment": where["experiment"],
            "game_id": where["game_id"], "split": where["split"], "turn_idx": turn["turn_idx"],
            "player": turn["player"], "game_role": turn["game_role"], "messages": messages,
            "response": turn["response"], "parse_ok": turn["parse_ok"]}


def deduplicated(plays) -> list[dict]:
    """One row per distinct (instance, player, perspective, answer, verdict), the first play's columns, counting the
    plays and how their episodes ended."""
    rows: dict[tuple, dict] = {}
    scores: dict[tuple, list[float]] = {}
    for answer, outcome, bench_score in plays:
        key = (answer["game"], answer["experiment"], answer["game_id"], answer["player"],
               tuple((m["role"], m["content"]) for m in answer["messages"]), answer["response"], answer["parse_ok"])
        row = rows.setdefault(key, {**answer, "count": 0, "n_success": 0, "n_lost": 0, "n_aborted": 0})
        row["count"] += 1
        if outcome is not None:
            row[f"n_{outcome}"] += 1
        if outcome in ("success", "lost") and bench_score is not None and math.isfinite(bench_score):
            scores.setdefault(key, []).append(bench_score)
    for key, row in rows.items():
        row["bench_score"] = sum(scores[key]) / len(scores[key]) if key in scores else math.nan
    return list(rows.values())


def gather_answers(rollouts_path: str, sft_episodes_path: str, bp_path: str, shard_paths: list[str],
                   output: str) -> list[dict]:
    """Write the answers records (:data:`records.ANSWERS`) of the run's played train answers; return the rows."""
    shard_rows = [row for path in shard_paths for row in records.read_records(path, records.SOFT_LABEL_SHARDS)]

    def plays():
        yield from episode_plays(rollouts_path, "base_rollouts")
        yield from episode_plays(sft_episodes_path, "sft_trajectories")
        yield from sibling_plays(bp_path, shard_rows)
        yield from continuation_plays(shard_rows)

    rows = deduplicated(plays())
    records.write_records(output, rows, records.ANSWERS, provenance({}))
    log.info("answers: %d distinct train answers of %d plays -> %s\n%s", len(rows), sum(r["count"] for r in rows),
             output, summarize_answers(rows))
    return rows


def summarize_answers(rows: list[dict]) -> str:
    """One line per source: distinct answers, plays, and the share the game accepted."""
    lines = []
    for source in records.ANSWER_SOURCES:
        mine = [row for row in rows if row["source"] == source]
        if mine:
            lines.append(f"{source}: {len(mine)} distinct answers ({sum(r['count'] for r in mine)} plays), "
                         f"{100 * sum(r['parse_ok'] for r in mine) / len(mine):.0f}% accepted")
    return "\n".join(lines)
