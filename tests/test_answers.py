"""The answers records (``gather_answers``): every answer the run played on the train split, with the game's verdict,
gathered from real played episodes, siblings and label continuations of the built-in games."""

from __future__ import annotations

import json
import math

import pytest

from clemprm import records
from clemprm.stages import answers, branch_points, labels, rollouts
from tests.conftest import binary_search_answer, tiny_config


def seen_policy(scripted_policy, seen: list):
    """Solves guessnumber on odd sampling seeds and breaks its rules ("No idea.") on even ones; records every
    (perspective, answer) it generated in ``seen``."""
    class CoinFlips(scripted_policy):
        def generate(self, perspectives, seeds=None, **sampling):
            texts = [binary_search_answer(m) if seed % 2 else "No idea." for m, seed in zip(perspectives, seeds)]
            seen.extend((json.dumps(m), text) for m, text in zip(perspectives, texts))
            return [scripted_policy(lambda _, text=text: text).generate([m], **sampling)[0]
                    for m, text in zip(perspectives, texts)]
    return CoinFlips(binary_search_answer)


@pytest.fixture(scope="module")
def played(tmp_path_factory, scripted_policy):
    """A guessnumber run up to the soft labels (base rollouts, SFT-policy trajectories with siblings and one held-out
    validation instance, two label shards), the answers gathered from it, and what the policy generated."""
    folder = tmp_path_factory.mktemp("answers")
    config = tiny_config(games={"builtin": ["guessnumber"]},
                         branch_points={"siblings": 3, "validation_instances": 1, "max_per_episode": 4},
                         labels={"k": 3, "max_rollout_rounds": 2, "shards": 2, "checkpoint_every": 4})
    settings = {name: config[name] for name in ("seed", "model", "games", "base_rollouts", "branch_points", "labels")}
    seen: list = []
    policy = seen_policy(scripted_policy, seen)
    paths = {name: str(folder / f"{name}.parquet") for name in ("base", "sft", "bp", "out")}
    rollouts.base_rollouts(settings, paths["base"], policy=policy)
    branch_points.branch_points(settings, None, paths["sft"], paths["bp"], policy=policy)
    shards = [str(folder / f"{s}-of-2.parquet") for s in range(2)]
    for shard, path in enumerate(shards):
        labels.soft_labels_shard(settings, paths["bp"], None, shard, 2, path, policy=policy)
    rows = answers.gather_answers(paths["base"], paths["sft"], paths["bp"], shards, paths["out"])
    return rows, paths, shards, seen


def same_rows(a: list[dict], b: list[dict]) -> bool:
    """Row lists equal, NaN included (an answer whose plays never ended won or lost has a NaN bench_score)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def key(game, experiment, game_id, player, messages, response, parse_ok) -> tuple:
    return game, experiment, game_id, player, json.dumps(messages), response, parse_ok


def row_key(row: dict) -> tuple:
    return key(row["game"], row["experiment"], row["game_id"], row["player"], row["messages"], row["response"],
               row["parse_ok"])


def test_the_records_have_their_schema_and_hold_train_answers_only(played):
    rows, paths, shards, _ = played
    assert same_rows(records.read_records(paths["out"], records.ANSWERS, splits=records.TRAIN_SPLITS), rows)
    assert records.read_provenance(paths["out"])["versions"]["clemprm"]
    held_out = [e for e in records.read_records(paths["sft"], records.EPISODES) if e["split"] == "validation"]
    assert held_out and {row["split"] for path in shards for row in records.read_records(path)} == {"train",
                                                                                                     "validation"}
    train_keys = {(e["game"], e["experiment"], e["game_id"]) for e in records.read_records(paths["base"])}
    assert {(row["game"], row["experiment"], row["game_id"]) for row in rows} <= train_keys
    assert len({row_key(row) for row in rows}) == len(rows)                      # deduplicated
    assert [row["source"] for row in rows] == sorted((row["source"] for row in rows),
                                                     key=records.ANSWER_SOURCES.index)   # in pipeline order


def test_every_answer_is_one_the_policy_played_with_the_games_verdict(played):
    """Every row is a (perspective, answer) the policy generated: also a continuation's perspective, rebuilt from the
    branch point's prefix and the shard's tail, is exactly what the player saw."""
    rows, _, _, seen = played
    generated = set(seen)
    assert all((json.dumps(row["messages"]), row["response"]) in generated for row in rows)
    for row in rows:   # the game accepts a guess and counts "No idea." as a rule violation
        assert row["parse_ok"] == row["response"].startswith("GUESS:")
    sources = {row["source"] for row in rows}
    assert sources == set(records.ANSWER_SOURCES)
    continued = [row for row in rows if row["source"] == "label_continuations"]
    assert {row["parse_ok"] for row in continued} == {True, False}
    assert all(row["episode_id"].rsplit("/", 1)[1].startswith("k") for row in continued)


def test_plays_are_counted_with_how_their_episodes_ended(played):
    rows, paths, shards, _ = played
    by_key = {row_key(row): row for row in rows}
    plays = 0
    for path in (paths["base"], paths["sft"]):
        for episode in records.read_records(path, records.EPISODES):
            if episode["split"] != "train":
                continue
            for turn in episode["turns"]:   # each turn of a played train episode is a row, its plays counted
                row = by_key[key(episode["game"], episode["experiment"], episode["game_id"], turn["player"],
                                 turn["messages"], turn["response"], turn["parse_ok"])]
                assert row["count"] >= 1
                ended = "aborted" if episode["aborted"] else "success" if episode["success"] else "lost"
                assert row[f"n_{ended}"] >= 1
                plays += 1
    siblings = [bp for bp in records.read_records(paths["bp"]) if bp["split"] == "train" and bp["bp_id"] != bp[
        "prefix_id"]]
    assert siblings
    for bp in siblings:
        assert key(bp["game"], bp["experiment"], bp["game_id"], bp["player"], bp["prefix"], bp["candidate"],
                   bp["parse_ok"]) in by_key
    shard_rows = [row for path in shards for row in records.read_records(path, records.SOFT_LABEL_SHARDS)]
    continuations = [c for row in shard_rows if row["split"] == "train" for c in row["continuations"]]
    assert {c["outcome"] for c in continuations} >= {"capped", "aborted"}   # max_rollout_rounds 2; "No idea." twice
    assert all(c["k"] in range(3) for c in continuations)
    plays += len(siblings) + sum(len(c["turns"]) for c in continuations)
    assert sum(row["count"] for row in rows) == plays
    for row in rows:
        ended = row["n_success"] + row["n_lost"] + row["n_aborted"]
        assert ended <= row["count"]
        assert math.isnan(row["bench_score"]) == (row["n_success"] + row["n_lost"] == 0)


def test_a_shard_keeps_its_continuations_through_its_checkpoint(played, scripted_policy, tmp_path):
    """A shard resumed from a checkpoint holds the continuations an uninterrupted one holds."""
    _, paths, shards, _ = played
    config = tiny_config(games={"builtin": ["guessnumber"]},
                         branch_points={"siblings": 3, "validation_instances": 1, "max_per_episode": 4},
                         labels={"k": 3, "max_rollout_rounds": 2, "shards": 2, "checkpoint_every": 4})
    settings = {name: config[name] for name in ("seed", "model", "games", "branch_points", "labels")}
    output = tmp_path / "0-of-2.parquet"
    checkpoint = labels.ShardCheckpoint(output, labels.shard_fingerprint(settings, paths["bp"], 0, 2))
    checkpoint.load()
    straight = records.read_records(shards[0], records.SOFT_LABEL_SHARDS)
    checkpoint.save(straight[:4])   # as a shard killed after its first chunk leaves it
    labels.soft_labels_shard(settings, paths["bp"], None, 0, 2, output, policy=seen_policy(scripted_policy, []))
    assert same_rows(records.read_records(output, records.SOFT_LABEL_SHARDS), straight)


def test_deduplicated_counts_each_distinct_answer_once_with_its_plays():
    answer = {"source": "base_rollouts", "episode_id": "g/e/0/0", "game": "g", "experiment": "e", "game_id": 0,
              "split": "train", "turn_idx": 0, "player": "Player 1", "game_role": "Guesser",
              "messages": [{"role": "user", "content": "Guess."}], "response": "GUESS: 5", "parse_ok": True}
    later = {**answer, "source": "label_continuations", "episode_id": "g/e/0/0/1/k0"}
    rejected = {**answer, "response": "No idea.", "parse_ok": False}
    rows = answers.deduplicated([(answer, "success", 40.0), (later, "lost", 0.0), (later, None, None),
                                 (answer, "aborted", math.nan), (rejected, None, None)])
    assert len(rows) == 2
    first, second = rows
    assert first["source"] == "base_rollouts" and first["episode_id"] == "g/e/0/0"   # named by its first play
    assert (first["count"], first["n_success"], first["n_lost"], first["n_aborted"]) == (4, 1, 1, 1)
    assert first["bench_score"] == 20.0                                              # won 40 and lost 0
    assert (second["count"], second["n_success"] + second["n_lost"] + second["n_aborted"]) == (1, 0)
    assert math.isnan(second["bench_score"])
