"""The rollout engine on real built-in games: lockstep batching, outcomes, forks, error isolation, records."""

from __future__ import annotations

import dataclasses
import math

import pytest

from clemprm import records
from clemprm.play.catalog import GameCatalog
from clemprm.play.clemcore_setup import import_clemcore_backends
from clemprm.play.chat import merge_roles
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from tests.conftest import binary_search_answer, tiny_config


@pytest.fixture(scope="module")
def catalog():
    return GameCatalog(tiny_config()["games"])


def play(catalog, policy, game, split="train", repeats=1, sampling=Sampling()):
    engine = RolloutEngine(catalog, sampling)
    return engine.play(catalog.instances(game, split), [policy], repeats=repeats, base_seed=1, stage="test",
                       policy_name=policy.name)


def test_perfect_player_wins_with_speed_score(catalog, scripted_policy):
    rows = play(catalog, scripted_policy(binary_search_answer), "guessnumber")
    assert rows and all(row["success"] and not row["aborted"] and row["error"] is None for row in rows)
    for row in rows:
        guesses = sum(turn["parse_ok"] for turn in row["turns"])
        assert row["bench_score"] == pytest.approx(100 / guesses)
        assert row["turns"][0]["messages"][0]["role"] == "user"
        assert "GUESS" in row["turns"][0]["messages"][0]["content"]


def test_rule_breaking_answers_abort_the_episode_not_the_run(catalog, scripted_policy):
    rows = play(catalog, scripted_policy(lambda messages: "I have no idea."), "guessnumber", repeats=2)
    assert len(rows) == 2 * len(catalog.instances("guessnumber", "train"))
    for row in rows:
        assert row["aborted"] and not row["success"] and not row["lost"] and math.isnan(row["bench_score"])
        assert row["error"] is None
        assert [turn["parse_ok"] for turn in row["turns"]] == [False, False]  # reprompted once, then aborted
        assert "I have no idea." in [m["content"] for m in row["turns"][1]["messages"]]


def test_all_waiting_games_share_one_generate_call_per_step(catalog, scripted_policy):
    policy = scripted_policy(binary_search_answer)
    n_instances = len(catalog.instances("guessnumber", "train"))
    rows = play(catalog, policy, "guessnumber", repeats=3)
    assert policy.calls[0] == 3 * n_instances  # first step: every episode in one call
    assert sum(policy.calls) == sum(row["n_turns"] for row in rows)
    assert policy.calls == sorted(policy.calls, reverse=True)  # finished games drop out


def test_two_player_self_play_records_both_roles(catalog, scripted_policy):
    rows = play(catalog, scripted_policy(lambda messages: "DESCRIPTION: something you can hold"), "wordref")
    roles = {turn["game_role"] for row in rows for turn in row["turns"]}
    assert len(roles) == 2
    assert all(row["error"] is None for row in rows)


def test_an_exception_in_one_episode_is_recorded_and_others_go_on(catalog, scripted_policy):
    instances = catalog.instances("guessnumber", "train")
    broken = dataclasses.replace(instances[0], instance={"game_id": 99, "target": "not a number"})

    def answer(messages):  # a too-long prompt for one game (as the model reports it), normal play elsewhere
        if "from 1 to 20" in messages[0]["content"]:
            return ValueError("context too long: 5000 > 2048 tokens")
        return binary_search_answer(messages)

    engine = RolloutEngine(catalog, Sampling())
    policy = scripted_policy(answer)
    episodes = [engine.start(instance, [policy], f"e{i}", seed=i) for i, instance in enumerate([broken] + instances)]
    engine.run(episodes)
    rows = [episode.record(policy.name, engine.sampling) for episode in episodes]
    assert "not a number" in rows[0]["error"] or "invalid literal" in rows[0]["error"]
    too_long = [row for row, inst in zip(rows[1:], instances) if inst.experiment["max_number"] == 20]
    normal = [row for row, inst in zip(rows[1:], instances) if inst.experiment["max_number"] != 20]
    assert too_long and normal
    assert all("context too long" in row["error"] and row["aborted"] for row in too_long)
    assert all(row["success"] and row["error"] is None for row in normal)


def test_fork_copies_the_game_not_the_model(catalog, scripted_policy):
    policy = scripted_policy(binary_search_answer)
    engine = RolloutEngine(catalog, Sampling())
    episode = engine.start(catalog.instances("guessnumber", "train")[0], [policy], "e", seed=3)
    engine.step([episode])
    fork = episode.fork("e-fork", seed=4)
    assert fork.env is not episode.env and fork.env.game_master is not episode.env.game_master
    assert fork.env.game_master.get_players()[0].model is policy
    assert fork.turns == episode.turns and fork.turns is not episode.turns
    engine.run([fork])
    assert fork.done and not episode.done  # the original did not move
    engine.run([episode])
    a, b = episode.record("p", engine.sampling), fork.record("p", engine.sampling)
    assert a["turns"] == b["turns"] and a["bench_score"] == b["bench_score"]


def test_episodes_of_one_game_do_not_share_game_state(catalog, scripted_policy):
    policy = scripted_policy(binary_search_answer)
    engine = RolloutEngine(catalog, Sampling())
    first, second = (engine.start(catalog.instances("guessnumber", "train")[0], [policy], name, seed=0)
                     for name in ("a", "b"))
    assert first.env is not second.env and first.env.game_master is not second.env.game_master
    for name in ("rewards", "terminations", "infos", "agents", "observation_spaces"):
        assert getattr(first.env, name) is not getattr(second.env, name)
    engine.run([first])
    assert first.done and not second.done and second.env.agents  # the other game did not move
    engine.run([second])
    assert first.record("p", engine.sampling)["turns"] == second.record("p", engine.sampling)["turns"]


@pytest.mark.parametrize("roles", [[], ["user"], ["system", "user", "assistant", "user"], ["user", "user"],
                                   ["system", "system", "user"], ["user", "assistant", "assistant", "user"],
                                   ["empty system", "user", "assistant"], ["empty system", "system", "user"]])
def test_merge_roles_is_clemcores_rule(roles):
    import_clemcore_backends()
    from clemcore.backends.utils import ensure_alternating_roles

    messages = [{"role": role.split()[-1], "content": "" if role.startswith("empty") else f"m{i}", "extra": 1}
                for i, role in enumerate(roles)]
    expected = ensure_alternating_roles([{"role": m["role"], "content": m["content"]} for m in messages]) \
        if messages else []
    assert merge_roles(messages) == expected


def test_episode_records_round_trip_through_parquet(catalog, scripted_policy, tmp_path):
    rows = play(catalog, scripted_policy(binary_search_answer), "guessnumber", repeats=2)
    path = tmp_path / "episodes.parquet"
    records.write_records(path, rows, records.EPISODES, {"config": {"x": 1}})
    assert records.read_records(path, records.EPISODES) == rows
    assert records.read_provenance(path) == {"config": {"x": 1}}
    ids = [row["episode_id"] for row in rows]
    assert len(set(ids)) == len(ids) and len({row["seed"] for row in rows}) == len(rows)


def test_corrupt_record_file_error_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(records.RecordFileError, match="broken.parquet"):
        records.read_records(path, records.EPISODES)


def test_built_in_games_draw_nothing_from_the_process_generators(scripted_policy):
    """Built-in games play without per-episode generators (catalog.draws_global_randomness): that is only right
    while their code never touches Python's `random` or NumPy's global generator. Play every built-in game (won,
    lost and aborted turns) and check both process states are untouched."""
    import random

    import numpy as np

    from clemprm.games import BUILTIN_GAMES

    catalog = GameCatalog(tiny_config(games={"builtin": list(BUILTIN_GAMES)})["games"])
    assert not any(catalog.draws_global_randomness(game) for game in catalog.games)
    random.seed(3)
    np.random.seed(3)
    before = random.getstate(), np.random.get_state()[1].copy()
    plays = [("guessnumber", binary_search_answer)] + [
        (game, answer) for game in catalog.games for answer in (lambda m: "I have no idea.", lambda m: "GUESS: 5")]
    for game, answer in plays:
        rows = play(catalog, scripted_policy(answer), game)
        assert rows and all(row["error"] is None for row in rows)
    assert random.getstate() == before[0]
    assert (np.random.get_state()[1] == before[1]).all()
