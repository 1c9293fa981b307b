"""Branch points and their K-rollout Monte-Carlo soft labels (the ``branch_points`` and ``soft_labels`` stages).

Branch points
    The SFT policy (base + SFT adapter) plays the train split; every LLM turn is a branch point: the prefix
    the player saw, its answer (the candidate), and the answers of the whole episode up to it (``history``).
    A trajectory with more turns than ``branch_points.max_per_episode`` is subsampled evenly along it.

Soft labels
    A branch point's game state is rebuilt by replaying its ``history`` (games are deterministic given the
    instance and the answers; a replay that does not reproduce the recorded prefix is skipped and logged).
    From there K forks are played to the end by the SFT policy, all continuations of all branch points of a
    chunk in lockstep through the one rollout engine. Each continuation is scored by the game's own
    BENCH_SCORE; an aborted one counts ``labels.aborted_value`` x 100; one stopped after
    ``labels.max_rollout_rounds`` turns past the branch point is scored with the game's partial score at the
    cutoff (the game master's ``partial_bench_score()`` when it has one, else 0: the game counts as lost).
    label = mean(scores) / 100. A candidate that ended the game is labelled with its own final score.

Sharding and resumption
    Shard s of S takes branch points s, s+S, s+2S, ... Every random choice derives from the branch point's own
    seed, never from the shard or the batch, so the gathered labels do not depend on S. A shard labels its
    branch points in chunks of ``labels.checkpoint_every`` and appends each finished chunk to a checkpoint folder
    beside its output; a shard that is killed and rerun skips what its checkpoint holds (the checkpoint is
    discarded when the settings or the branch points changed; an unreadable part alone, with a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

from clemprm import records
from clemprm.catalog import GameCatalog, Instance
from clemprm.config import provenance
from clemprm.engine import Episode, RolloutEngine, Sampling, derive_seed

log = logging.getLogger(__name__)


def sft_policy_settings(model_settings: dict, sft_adapter: str | None) -> dict:
    """The ``model`` section of the SFT policy: the base model with the SFT adapter (None: the base policy)."""
    return {**model_settings, "adapter": str(sft_adapter)} if sft_adapter else dict(model_settings)


# ------------------------------------------------------------------------------------------ branch points


def evenly_spaced(n: int, cap: int) -> list[int]:
    """``min(n, cap)`` indices spread evenly over ``range(n)``, always including the first and the last."""
    if n <= cap:
        return list(range(n))
    if cap == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (cap - 1)) for i in range(cap)})


def branch_points_of(episode: dict, max_per_episode: int, base_seed: int) -> list[dict]:
    """The branch point rows of one episode record (:data:`records.EPISODES`); none for a failed episode."""
    if episode["error"] is not None:
        return []
    turns = episode["turns"]
    history = [turn["response"] for turn in turns]
    rows = []
    for index in evenly_spaced(len(turns), max_per_episode):
        turn = turns[index]
        bp_id = f"{episode['episode_id']}/{turn['turn_idx']}"
        rows.append({
            "bp_id": bp_id, "episode_id": episode["episode_id"], "game": episode["game"],
            "experiment": episode["experiment"], "game_id": episode["game_id"], "split": episode["split"],
            "turn_idx": turn["turn_idx"], "player": turn["player"], "game_role": turn["game_role"],
            "prefix": turn["messages"], "candidate": turn["response"], "history": history[:index + 1],
            "parse_ok": turn["parse_ok"], "seed": derive_seed(base_seed, "soft_labels", bp_id),
            "episode_bench_score": episode["bench_score"], "episode_success": episode["success"],
            "episode_aborted": episode["aborted"]})
    return rows


def branch_points(settings: dict, sft_adapter: str | None, episodes_output: str, output: str,
                  cache_dir: str | None = None, policy=None) -> list[dict]:
    """The SFT policy plays the train split; write its episodes and their branch points."""
    from clemprm.stages import load_policy, summarize

    bp_settings = settings["branch_points"]
    catalog = GameCatalog(settings["games"])
    policy = policy or load_policy(sft_policy_settings(settings["model"], sft_adapter), cache_dir)
    engine = RolloutEngine(catalog, Sampling(bp_settings["temperature"], bp_settings["top_p"],
                                             bp_settings["max_new_tokens"]))
    episodes = engine.play(catalog.all_instances("train"), [policy], repeats=bp_settings["episodes_per_instance"],
                           base_seed=settings["seed"], stage="branch_points", policy_name=policy.name)
    rows = [row for episode in episodes
            for row in branch_points_of(episode, bp_settings["max_per_episode"], settings["seed"])]
    records.write_records(episodes_output, episodes, records.EPISODES, provenance(settings))
    records.write_records(output, rows, records.BRANCH_POINTS, provenance(settings))
    log.info("branch points: %d from %d SFT-policy episodes -> %s\n%s", len(rows), len(episodes), output,
             summarize(episodes))
    return rows


# ------------------------------------------------------------------------------------------ soft labels


def continuation_score(episode: Episode, capped: bool, aborted_value: float) -> tuple[float, bool, bool]:
    """``(score 0-100, aborted, success)`` of a finished or capped continuation."""
    if capped:
        partial = getattr(episode.env.game_master, "partial_bench_score", None)
        return (float(partial()) if partial else 0.0), False, False
    row = episode.record("", Sampling())
    if row["aborted"]:
        return 100.0 * aborted_value, True, False
    return row["bench_score"], False, row["success"]


def label_row(bp: dict, scores: list[float], aborted: list[bool], success: list[bool], capped: int,
              new_tokens: int, terminal: bool) -> dict:
    return {**bp, "k": 0 if terminal else len(scores), "terminal": terminal, "rollout_scores": scores,
            "n_aborted": sum(aborted), "n_success": sum(success), "n_capped": capped, "new_tokens": new_tokens,
            "label": sum(scores) / len(scores) / 100.0}


class BranchPointStates:
    """Rebuilds the game state right after each branch point's candidate, replaying each episode once:
    branch points of one episode (sorted by turn) fork from one replay as it moves along."""

    def __init__(self, engine: RolloutEngine, catalog: GameCatalog, policy):
        self.engine, self.catalog, self.policy = engine, catalog, policy
        self._instances: dict[tuple, Instance] = {}

    def instance(self, bp: dict) -> Instance:
        key = (bp["game"], bp["experiment"], bp["game_id"])
        if key not in self._instances:
            for instance in self.catalog.instances(bp["game"], bp["split"]):
                self._instances[instance.key] = instance
        if key not in self._instances:
            raise KeyError(f"branch point {bp['bp_id']}: instance {key} is not among the configured games' "
                           f"{bp['split']} instances")
        return self._instances[key]

    def states(self, bps: list[dict]) -> list[Episode | None]:
        """One episode per branch point, at the state after its candidate (None when the replay diverged)."""
        by_episode: dict[str, list[int]] = {}
        for index, bp in enumerate(bps):
            by_episode.setdefault(bp["episode_id"], []).append(index)
        states: list[Episode | None] = [None] * len(bps)
        for indices in by_episode.values():
            indices.sort(key=lambda i: bps[i]["turn_idx"])
            replay = self.engine.start(self.instance(bps[indices[0]]), [self.policy], bps[indices[0]]["episode_id"], 0)
            for index in indices:
                bp = bps[index]
                self.engine.replay(replay, bp["history"][len(replay.turns):])
                if self._reproduces(replay, bp):
                    states[index] = replay.fork(bp["bp_id"], seed=bp["seed"])
        return states

    @staticmethod
    def _reproduces(replay: Episode, bp: dict) -> bool:
        last = replay.turns[-1] if len(replay.turns) == len(bp["history"]) else None
        if replay.error is None and last and last["response"] == bp["candidate"] and last["messages"] == bp["prefix"]:
            return True
        log.warning("branch point %s skipped: replaying its history did not reproduce the recorded prefix (%s)",
                    bp["bp_id"], replay.error or "a different game state")
        return False


def label_chunk(engine: RolloutEngine, states: BranchPointStates, bps: list[dict], label_settings: dict) -> list[dict]:
    """Soft-label a chunk of branch points: all K continuations of all of them in lockstep."""
    k, cap, aborted_value = label_settings["k"], label_settings["max_rollout_rounds"], label_settings["aborted_value"]
    roots = states.states(bps)
    continuations: list[tuple[int, Episode, int]] = []  # (branch point index, fork, turns before it)
    rows: dict[int, dict] = {}
    for index, (bp, root) in enumerate(zip(bps, roots)):
        if root is None:
            continue
        if root.done:  # the candidate ended the game
            score, aborted, success = continuation_score(root, False, aborted_value)
            rows[index] = label_row(bp, [score], [aborted], [success], 0, 0, terminal=True)
            continue
        for j in range(k):
            fork = root.fork(f"{bp['bp_id']}/k{j}", seed=derive_seed(bp["seed"], "continuation", j))
            continuations.append((index, fork, len(root.turns)))
    engine.run([fork for _, fork, _ in continuations], label="soft label continuations", max_turns=cap)

    results: dict[int, list] = {}
    for index, fork, start in continuations:
        capped = not fork.done
        results.setdefault(index, []).append(
            (*continuation_score(fork, capped, aborted_value), capped,
             sum(turn["new_tokens"] for turn in fork.turns[start:])))
    for index, outcomes in results.items():
        scores, aborted, success, capped, tokens = (list(column) for column in zip(*outcomes))
        rows[index] = label_row(bps[index], scores, aborted, success, sum(capped), sum(tokens), terminal=False)
    return [rows[index] for index in sorted(rows)]


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
                rows += records.read_records(part, records.SOFT_LABELS)
            except records.RecordFileError as error:   # e.g. cut short by a full disk: label its branch points again
                log.warning("checkpoint part %s is unreadable and is discarded; its branch points are labelled "
                            "again: %s", part, error)
                part.unlink()
        return rows

    def save(self, rows: list[dict]) -> None:
        """Write ``rows`` as the next part (numbered after the last one, also when an earlier one was discarded)."""
        last = max((int(part.stem.removeprefix("part-")) for part in self._parts()), default=-1)
        records.write_records(self.folder / f"part-{last + 1:05d}.parquet", rows, records.SOFT_LABELS, {})

    def _parts(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.parquet"))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def shard_fingerprint(settings: dict, bp_path: str | Path, shard: int, shards: int) -> str:
    digest = hashlib.sha256(json.dumps([settings, shard, shards], sort_keys=True, default=str).encode())
    digest.update(Path(bp_path).read_bytes())
    return digest.hexdigest()


def soft_labels_shard(settings: dict, bp_path: str, sft_adapter: str | None, shard: int, shards: int, output: str,
                      cache_dir: str | None = None, threads: int | None = None, policy=None) -> list[dict]:
    """Label branch points ``shard, shard + shards, ...`` of ``bp_path``, resuming from the shard's checkpoint.
    ``threads`` (the job's threads) overrides ``model.threads``, so shards can share a machine."""
    label_settings = settings["labels"]
    mine = records.read_records(bp_path, records.BRANCH_POINTS)[shard::shards]
    checkpoint = ShardCheckpoint(output, shard_fingerprint(settings, bp_path, shard, shards))
    done = {row["bp_id"]: row for row in checkpoint.load()}
    todo = [bp for bp in mine if bp["bp_id"] not in done]
    log.info("soft labels shard %d/%d: %d branch points, %d done in the checkpoint, %d to label (K=%d)",
             shard, shards, len(mine), len(done), len(todo), label_settings["k"])
    if todo:
        from clemprm.stages import load_policy

        model_settings = sft_policy_settings(settings["model"], sft_adapter)
        policy = policy or load_policy({**model_settings, "threads": threads or model_settings["threads"]}, cache_dir)
        engine = RolloutEngine(GameCatalog(settings["games"]), Sampling(
            label_settings["temperature"], label_settings["top_p"], label_settings["max_new_tokens"]))
        states = BranchPointStates(engine, engine.catalog, policy)
        step = label_settings["checkpoint_every"]
        for start in range(0, len(todo), step):
            rows = label_chunk(engine, states, todo[start:start + step], label_settings)
            checkpoint.save(rows)
            done.update((row["bp_id"], row) for row in rows)
            log.info("soft labels shard %d/%d: %d/%d branch points labelled", shard, shards, len(done), len(mine))
    rows = [done[bp["bp_id"]] for bp in mine if bp["bp_id"] in done]
    records.write_records(output, rows, records.SOFT_LABELS, provenance(settings))
    checkpoint.remove()
    return rows


def gather_soft_labels(settings: dict, bp_path: str, shard_paths: list[str], output: str) -> list[dict]:
    """Concatenate the shards in branch point order into one soft-labels file."""
    by_id = {}
    for path in shard_paths:
        for row in records.read_records(path, records.SOFT_LABELS):
            if row["bp_id"] in by_id:
                raise ValueError(f"branch point {row['bp_id']} is in two shards (again in {path})")
            by_id[row["bp_id"]] = row
    order = [bp["bp_id"] for bp in records.read_records(bp_path, records.BRANCH_POINTS)]
    rows = [by_id[bp_id] for bp_id in order if bp_id in by_id]
    records.write_records(output, rows, records.SOFT_LABELS, provenance(settings))
    log.info("soft labels: %d of %d branch points labelled (%d skipped) -> %s\n%s", len(rows), len(order),
             len(order) - len(rows), output, summarize_labels(rows))
    return rows


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
                     f"{100 * sum(r['n_capped'] for r in continued) / k:.0f}% capped")
    return "\n".join(lines)
