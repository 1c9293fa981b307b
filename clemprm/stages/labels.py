"""K-rollout Monte-Carlo soft labels of the branch points (the ``soft_labels`` and ``gather_soft_labels`` stages).

Soft labels
    A branch point's game state is rebuilt by replaying its ``history``
    (:class:`~clemprm.stages.branch_points.BranchPointStates`; a replay that does not reproduce the recorded prefix
    fails the shard, naming the game and the branch point). From there K forks are played to the end by the SFT
    policy, all continuations of all branch points of a chunk in lockstep through the one rollout engine. Each
    continuation is scored by the game's own BENCH_SCORE (a game that draws random numbers during play draws them
    afresh in each continuation, from the continuation's seed); an aborted one counts ``labels.aborted_value`` x 100;
    one stopped after ``labels.max_rollout_rounds`` turns past the branch point is scored with the game's partial
    score at the cutoff (:mod:`clemprm.stages.continuation_scores`). label = mean(scores) / 100. A candidate that
    ended the game is labelled with its own final score.

    With ``labels.k_first`` (1 <= k_first < K; at K or above, one round of K) the continuations are played in two
    rounds: k_first per candidate first, then the other K - k_first only for the states where some first-round score
    differs from another (the siblings' and the continuations' own): a state whose every continuation lost alike
    keeps its k_first (its labels are alike either way), and every other label is the one all K at once give,
    continuation for continuation. The labelling budget goes to the states a PRM can learn to rank from.

    A continuation whose game raises (its code, its scorer, its ``partial_bench_score``, its scorer on an episode
    with answers closed as lost) is an error: it is left
    out of the label (``n_errors`` counts it, ``rollout_scores`` holds only the scored ones) and logged with its
    game; a branch point left without any scored continuation gets no label. The shard goes on either way.

    A shard file also keeps every continuation's answers with the game's verdict on each and how it ended
    (:data:`clemprm.records.SOFT_LABEL_SHARDS`), for the answers records (:mod:`clemprm.stages.answers`); the
    gathered soft labels leave them out.

Sharding and resumption
    Shard s of S takes the prefixes s, s+S, s+2S, ... with all their siblings (one replay of a state serves them
    all, and their continuations share the prefix in the generator's batches). Every random choice derives from
    the branch point's own seed, never from the shard or the batch, so the gathered labels do not depend on S. A
    shard labels its branch points in chunks of about ``labels.checkpoint_every`` (whole states) and appends each
    finished chunk to a checkpoint folder beside its output; a shard that is killed and rerun skips what its
    checkpoint holds (the checkpoint is discarded when the settings or the branch points changed; an unreadable part
    alone, with a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

from clemprm import distributed, records
from clemprm.checks.run_time import check_not_empty, fail_or_warn, marks_metadata
from clemprm.config import provenance
from clemprm.models.loader import policy_settings
from clemprm.play.catalog import GameCatalog
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.play.episode import Episode, seeded_generator_states
from clemprm.stages.branch_points import BranchPointStates
from clemprm.stages.continuation_scores import ErrorCounts, scored
from clemprm.stats import derive_seed

log = logging.getLogger(__name__)


def label_row(bp: dict, scores: list[float], aborted: list[bool], success: list[bool], capped: int,
              new_tokens: int, terminal: bool, errors: int = 0) -> dict | None:
    """The soft-label row of a branch point from its scored continuations (None: none was scored)."""
    if not scores:
        return None
    return {**bp, "k": 0 if terminal else len(scores) + errors, "terminal": terminal, "rollout_scores": scores,
            "n_aborted": sum(aborted), "n_success": sum(success), "n_capped": capped, "n_errors": errors,
            "new_tokens": new_tokens, "label": sum(scores) / len(scores) / 100.0}


def label_chunk(engine: RolloutEngine, states: BranchPointStates, bps: list[dict], label_settings: dict,
                errors: ErrorCounts | None = None) -> list[dict]:
    """Soft-label a chunk of branch points: all K continuations of all of them in lockstep; with
    ``labels.k_first`` in two rounds (:func:`settled_states`). Branch points without any scored continuation get
    no row (their errors are counted in ``errors``). Each row also holds its ``continuations``
    (:data:`records.CONTINUATION`: every one played, its answers with the game's verdicts and how it ended; none for
    a terminal candidate), which the answers records read."""
    errors = errors if errors is not None else ErrorCounts()
    k, aborted_value = label_settings["k"], label_settings["aborted_value"]
    first = min(label_settings["k_first"] or k, k)   # k_first >= K: one round of K (a config that lowers K alone)
    roots = states.states(bps)
    outcomes: dict[int, list] = {}   # branch point index -> (score, aborted, success, capped) of each scored one
    failed: dict[int, int] = {}
    tokens: dict[int, int] = {}
    played: dict[int, list[dict]] = {}   # branch point index -> its continuations (records.CONTINUATION)
    terminal, live = {}, []
    for index, (bp, root) in enumerate(zip(bps, roots)):
        if not root.done:
            live.append(index)
            continue
        outcome = scored(root, False, aborted_value, errors)   # the candidate ended the game
        if outcome is not None:
            terminal[index] = outcome
    play_continuations(engine, bps, roots, live, range(first), label_settings, errors, outcomes, failed, tokens,
                       played)
    if first < k:
        settled = settled_states(bps, terminal, outcomes)
        rest = [index for index in live if bps[index]["prefix_id"] not in settled]
        log.info("soft labels, k_first %d: %d of %d states settled (every first continuation scored alike); "
                 "%d of %d candidates get the other %d continuations", first, len(settled),
                 len({bp["prefix_id"] for bp in bps}), len(rest), len(live), k - first)
        play_continuations(engine, bps, roots, rest, range(first, k), label_settings, errors, outcomes, failed,
                           tokens, played)
    rows = {index: label_row(bps[index], [score], [aborted], [success], 0, 0, terminal=True)
            for index, (score, aborted, success) in terminal.items()}
    for index in live:
        scores, aborted, success, capped = ([list(column) for column in zip(*outcomes[index])] if index in outcomes
                                            else [[]] * 4)
        rows[index] = label_row(bps[index], scores, aborted, success, sum(capped), tokens.get(index, 0),
                                terminal=False, errors=failed.get(index, 0))
    return [{**rows[index], "continuations": played.get(index, [])} for index in sorted(rows)
            if rows[index] is not None]


def play_continuations(engine: RolloutEngine, bps: list[dict], roots: list[Episode], indices: list[int],
                       continuations: range, label_settings: dict, errors: ErrorCounts, outcomes: dict,
                       failed: dict, tokens: dict, played: dict) -> None:
    """Play continuations ``continuations`` (their numbers j) of the branch points ``indices`` to the end in
    lockstep and add their scores to ``outcomes``, their failures to ``failed``, their new tokens to ``tokens``,
    their answers and ends to ``played`` (:func:`continuation_record`).
    Continuation j of a branch point is seeded from the branch point and j alone, so it is the same continuation
    in either round and in any chunk."""
    forks: list[tuple[int, int, Episode, int]] = []  # (branch point index, j, fork, turns before it)
    for index in indices:
        bp, root = bps[index], roots[index]
        for j in continuations:
            fork = root.fork(f"{bp['bp_id']}/k{j}", seed=derive_seed(bp["seed"], "continuation", j))
            # each continuation meets its own game randomness (a game that draws during play), seeded like its answers
            if fork.generator_states is not None:
                fork.generator_states = seeded_generator_states(derive_seed(bp["seed"], "continuation", j, "game"))
            forks.append((index, j, fork, len(root.turns)))
    if not forks:
        return
    engine.run([fork for _, _, fork, _ in forks], label="soft label continuations",
               max_turns=label_settings["max_rollout_rounds"])
    for index, j, fork, start in forks:
        capped = not fork.done
        tokens[index] = tokens.get(index, 0) + sum(turn["new_tokens"] for turn in fork.turns[start:])
        outcome = scored(fork, capped, label_settings["aborted_value"], errors)
        played.setdefault(index, []).append(continuation_record(bps[index]["prefix"], j, fork.turns[start:], outcome,
                                                                capped))
        if outcome is None:
            failed[index] = failed.get(index, 0) + 1
        else:
            outcomes.setdefault(index, []).append((*outcome, capped))


def continuation_record(prefix: list[dict], j: int, turns: list[dict], outcome: tuple | None, capped: bool) -> dict:
    """Continuation ``j`` as a shard keeps it (:data:`records.CONTINUATION`): its ``turns`` (answers, verdicts) and
    how it ended (``outcome``: :func:`~clemprm.stages.continuation_scores.scored`'s, None when the game failed on
    it). A perspective is stored as what follows the leading messages it shares with the branch point's ``prefix``:
    a continuation's perspectives all start with that prefix, so a shard does not hold it again for every turn of
    every continuation."""
    if outcome is None or capped:
        end, bench_score = ("error" if outcome is None else "capped"), None
    else:
        score, aborted, success = outcome
        end = "aborted" if aborted else "success" if success else "lost"
        bench_score = math.nan if aborted else score
    kept = []
    for turn in turns:
        shared = 0
        for mine, theirs in zip(turn["messages"], prefix):
            if mine != theirs:
                break
            shared += 1
        kept.append({"turn_idx": turn["turn_idx"], "player": turn["player"], "game_role": turn["game_role"],
                     "shared": shared, "messages_tail": turn["messages"][shared:], "response": turn["response"],
                     "parse_ok": turn["parse_ok"]})
    return {"k": j, "outcome": end, "bench_score": bench_score, "turns": kept}


def settled_states(bps: list[dict], terminal: dict, outcomes: dict) -> set[str]:
    """The states (prefix ids) whose candidates' first-round outcomes all scored alike (a terminal candidate by its
    own score): no difference between or within their candidates seen, so they keep their ``k_first``
    continuations. The others get all K: their labels are those of a run with all K at once."""
    scores: dict[str, set[float]] = {}
    for index, bp in enumerate(bps):
        seen = [terminal[index][0]] if index in terminal else [outcome[0] for outcome in outcomes.get(index, [])]
        scores.setdefault(bp["prefix_id"], set()).update(seen)
    return {prefix for prefix, seen in scores.items() if len(seen) <= 1}


def label_chunk_split(engine: RolloutEngine, states: BranchPointStates, bps: list[dict], label_settings: dict,
                      errors: ErrorCounts) -> list[dict]:
    """:func:`label_chunk` of ``bps``; in a job of several processes each labels its share of the prefixes (a prefix
    with all its siblings: one replay serves them) and every one gets all rows, in the order of ``bps``."""
    prefixes = list(dict.fromkeys(bp["prefix_id"] for bp in bps))

    def label_share(share: list[str]) -> list[list[dict]]:
        mine = set(share)
        rows = label_chunk(engine, states, [bp for bp in bps if bp["prefix_id"] in mine], label_settings, errors)
        return [[row for row in rows if row["prefix_id"] == prefix] for prefix in share]

    labelled = {row["bp_id"]: row for group in distributed.map_split(prefixes, label_share) for row in group}
    return [labelled[bp["bp_id"]] for bp in bps if bp["bp_id"] in labelled]


class ShardCheckpoint:
    """Finished chunks of a shard as parquet parts in ``<output>.ckpt/``, valid for one fingerprint only."""

    def __init__(self, output: str | Path, fingerprint: str):
        self.folder = Path(f"{output}.ckpt")
        self.fingerprint = fingerprint

    def load(self) -> list[dict]:
        stamp = self.folder / "fingerprint"
        if self.folder.exists() and (not stamp.exists() or stamp.read_text() != self.fingerprint):
            log.info("checkpoint %s was made with other settings or branch points: starting over", self.folder)
            shutil.rmtree(self.folder)
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            stamp.write_text(self.fingerprint)
            return []
        rows = []
        for part in self._parts():
            try:
                rows += records.read_records(part, records.SOFT_LABEL_SHARDS)
            except records.RecordFileError as error:   # e.g. cut short by a full disk: label its branch points again
                log.warning("checkpoint part %s is unreadable and is discarded; its branch points are labelled "
                            "again: %s", part, error)
                part.unlink()
        return rows

    def save(self, rows: list[dict]) -> None:
        """Write ``rows`` as the next part (numbered after the last one, also when an earlier one was discarded)."""
        last = max((int(part.stem.removeprefix("part-")) for part in self._parts()), default=-1)
        records.write_records(self.folder / f"part-{last + 1:05d}.parquet", rows, records.SOFT_LABEL_SHARDS, {})

    def _parts(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.parquet"))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def shard_fingerprint(settings: dict, bp_path: str | Path, shard: int, shards: int) -> str:
    digest = hashlib.sha256(json.dumps([settings, shard, shards], sort_keys=True, default=str).encode())
    digest.update(Path(bp_path).read_bytes())
    return digest.hexdigest()


def whole_states(bps: list[dict], size: int) -> list[list[dict]]:
    """``bps`` in chunks of at least ``size`` branch points (the last one may be smaller) that split no state: a
    state's siblings are labelled in one chunk, where ``labels.k_first`` compares them."""
    by_state: dict[str, list[dict]] = {}
    for bp in bps:
        by_state.setdefault(bp["prefix_id"], []).append(bp)
    chunks, chunk = [], []
    for state in by_state.values():
        if len(chunk) >= size:
            chunks.append(chunk)
            chunk = []
        chunk += state
    return chunks + ([chunk] if chunk else [])


def shard_rows(bps: list[dict], shard: int, shards: int) -> list[dict]:
    """The branch points of prefixes ``shard, shard + shards, ...`` (in order of first appearance), siblings
    included; with one candidate per prefix, branch points ``shard, shard + shards, ...``."""
    prefixes = list(dict.fromkeys(bp["prefix_id"] for bp in bps))
    mine = set(prefixes[shard::shards])
    return [bp for bp in bps if bp["prefix_id"] in mine]


def soft_labels_shard(settings: dict, bp_path: str, sft_adapter: str | None, shard: int, shards: int, output: str,
                      cache_dir: str | None = None, threads: int | None = None, policy=None,
                      errors: ErrorCounts | None = None) -> list[dict]:
    """Label branch points ``shard, shard + shards, ...`` of ``bp_path``, resuming from the shard's checkpoint.
    ``threads`` (the job's threads) overrides ``model.threads``, so shards can share a machine. ``errors``, if
    given, counts the continuations the games failed on in this call (this process's share), also those of branch
    points left without a label, which the returned rows do not hold. Returns the soft-label rows
    (:data:`records.SOFT_LABELS`); the shard file also holds each one's continuations
    (:data:`records.SOFT_LABEL_SHARDS`)."""
    label_settings = settings["labels"]
    branch_points = records.read_records(bp_path, records.BRANCH_POINTS, splits=records.LABEL_SPLITS)
    mine = shard_rows(branch_points, shard, shards)
    checkpoint = ShardCheckpoint(output, shard_fingerprint(settings, bp_path, shard, shards))
    # rank 0 reads (and may discard) the checkpoint; every rank labels its share of what is left
    done = {row["bp_id"]: row for row in distributed.from_main(checkpoint.load() if distributed.is_main() else None)}
    todo = [bp for bp in mine if bp["bp_id"] not in done]
    log.info("soft labels shard %d/%d: %d branch points, %d done in the checkpoint, %d to label (K=%d)",
             shard, shards, len(mine), len(done), len(todo), label_settings["k"])
    if todo:
        from clemprm.models.generation import load_policy

        model_settings = policy_settings(settings["model"], sft_adapter)
        policy = policy or load_policy({**model_settings, "threads": threads or model_settings["threads"]}, cache_dir)
        engine = RolloutEngine(GameCatalog(settings["games"], settings["seed"]), Sampling(
            label_settings["temperature"], label_settings["top_p"], label_settings["max_new_tokens"]))
        states = BranchPointStates(engine, engine.catalog, policy, settings["seed"])
        step, errors = label_settings["checkpoint_every"], errors if errors is not None else ErrorCounts()
        for chunk in whole_states(todo, step):
            rows = label_chunk_split(engine, states, chunk, label_settings, errors)
            checkpoint.save(rows)
            done.update((row["bp_id"], row) for row in rows)
            log.info("soft labels shard %d/%d: %d/%d branch points labelled", shard, shards, len(done), len(mine))
        if errors.count:
            log.warning("soft labels shard %d/%d: continuations the games failed on (left out of the labels):\n%s",
                        shard, shards, errors.lines())
    rows = [done[bp["bp_id"]] for bp in mine if bp["bp_id"] in done]
    records.write_records(output, rows, records.SOFT_LABEL_SHARDS, provenance(settings))
    if distributed.is_main():
        checkpoint.remove()
    return [{name: row[name] for name in records.SOFT_LABELS.names} for row in rows]


def gather_soft_labels(settings: dict, bp_path: str, shard_paths: list[str], output: str,
                       on_failure: str = "stop") -> list[dict]:
    """Concatenate the shards in branch point order into one soft-labels file. Fails when no label has any
    variance (nothing for a PRM to learn), unless ``on_failure`` is continue (then the file's provenance records
    it)."""
    by_id = {}
    for path in shard_paths:
        for row in records.read_records(path, records.SOFT_LABELS, splits=records.LABEL_SPLITS):
            if row["bp_id"] in by_id:
                raise ValueError(f"branch point {row['bp_id']} is in two shards (again in {path})")
            by_id[row["bp_id"]] = row
    order = [bp["bp_id"] for bp in records.read_records(bp_path, records.BRANCH_POINTS,
                                                         splits=records.LABEL_SPLITS)]
    rows = [by_id[bp_id] for bp_id in order if bp_id in by_id]
    log.info("soft labels: %d of %d branch points labelled (%d without any scored continuation)\n%s", len(rows),
             len(order), len(order) - len(rows), summarize_labels(rows))
    marks = check_not_empty("gather_soft_labels", "soft labels", len(rows), f"{len(order)} branch points", on_failure,
                            condition="no_soft_labels")
    if rows and len({row["label"] for row in rows}) == 1:
        marks.append(fail_or_warn(
            "gather_soft_labels", f"no soft label with any variance: all {len(rows)} labels are "
            f"{rows[0]['label']:.3f}, nothing for a PRM to learn ({summarize_labels(rows)})", on_failure,
            condition="no_label_variance", count=len(rows)))
    records.write_records(output, rows, records.SOFT_LABELS, {**provenance(settings), **marks_metadata(marks)})
    log.info("soft labels -> %s", output)
    return rows


def labelling_counts(branch_points: list[dict], rows: list[dict], errors: ErrorCounts) -> str:
    """One line on a labelling of ``branch_points``: how many got a label (``rows``; terminal: the candidate ended
    the game), the continuations scored (the capped ones among them) and those the games failed on, counted in
    ``errors`` (:func:`soft_labels_shard`'s), which also holds the failures of the branch points left without a
    label (every continuation failed; for a terminal one, its own score)."""
    continued = [row for row in rows if not row["terminal"]]
    scored = sum(len(row["rollout_scores"]) for row in continued)
    return (f"{len(rows)}/{len(branch_points)} labelled ({len(rows) - len(continued)} terminal), "
            f"{scored} continuations scored ({sum(row['n_capped'] for row in continued)} capped), "
            f"{sum(errors.count.values())} failed")


def summarize_labels(rows: list[dict]) -> str:
    """One line per game: branch points, label mean, continuations, their abort and success rates."""
    lines = []
    for game in sorted({row["game"] for row in rows}):
        game_rows = [row for row in rows if row["game"] == game]
        labels = [row["label"] for row in game_rows]
        mean = sum(labels) / len(labels)
        std = math.sqrt(sum((x - mean) ** 2 for x in labels) / len(labels))
        continued = [row for row in game_rows if not row["terminal"]]
        k = sum(row["k"] for row in continued) or 1
        lines.append(f"{game}: {len(game_rows)} branch points, label mean {mean:.3f} (std {std:.3f}), "
                     f"{len(game_rows) - len(continued)} terminal; {k} continuations of the others: "
                     f"{100 * sum(r['n_aborted'] for r in continued) / k:.0f}% aborted, "
                     f"{100 * sum(r['n_success'] for r in continued) / k:.0f}% success, "
                     f"{100 * sum(r['n_capped'] for r in continued) / k:.0f}% capped, "
                     f"{sum(r['n_errors'] for r in continued)} failed (left out)")
    return "\n".join(lines)
