"""Stage functions on real games with scripted policies: base rollouts records and the win filter."""

from __future__ import annotations

import pyarrow.parquet as pq

from clemprm import records
from clemprm.stages import rollouts
from tests.conftest import binary_search_answer, tiny_config


def test_base_rollouts_then_win_filter_make_playpen_interactions(scripted_policy, tmp_path):
    config = tiny_config(games={"builtin": ["guessnumber", "oddoneout"]})
    settings = {name: config[name] for name in ("seed", "model", "games", "base_rollouts")}

    def answer(messages):  # wins guessnumber, answers nonsense in oddoneout
        return binary_search_answer(messages) if "GUESS" in messages[0]["content"] else "hmm"

    policy = scripted_policy(answer, name="scripted-policy")
    episodes_path = tmp_path / "episodes.parquet"
    rows = rollouts.base_rollouts(settings, str(episodes_path), policy=policy)
    assert {row["game"] for row in rows} == {"guessnumber", "oddoneout"}
    assert records.read_provenance(episodes_path)["config"]["base_rollouts"] == config["base_rollouts"]

    sft_path = tmp_path / "sft.parquet"
    interactions = rollouts.win_filter({"win_filter": config["win_filter"]}, str(episodes_path), str(sft_path))
    wins = [row for row in rows if row["success"]]
    assert wins and len(interactions) == len(wins)  # one LLM player per guessnumber episode
    assert pq.read_schema(sft_path).names == ["messages", "meta"]
    for interaction in records.read_records(sft_path, records.INTERACTIONS):
        assert interaction["meta"]["game"] == "guessnumber" and interaction["meta"]["outcome"] == "success"
        assert interaction["meta"]["model"] == "scripted-policy"
        assert interaction["messages"][-1]["role"] == "assistant"
        assert interaction["messages"][-1]["content"].startswith("GUESS:")
        roles = [m["role"] for m in interaction["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_win_filter_threshold_on_bench_score(scripted_policy, tmp_path):
    config = tiny_config(games={"builtin": ["guessnumber"]})
    settings = {name: config[name] for name in ("seed", "model", "games", "base_rollouts")}
    episodes_path = tmp_path / "episodes.parquet"
    rows = rollouts.base_rollouts(settings, str(episodes_path), policy=scripted_policy(binary_search_answer))
    threshold = 50.0
    kept = rollouts.win_filter({"win_filter": {"require_success": True, "min_bench_score": threshold}},
                               str(episodes_path), str(tmp_path / "sft.parquet"))
    assert len(kept) == sum(row["bench_score"] >= threshold for row in rows) < len(rows)


def test_win_filter_refuses_eval_episodes_naming_the_file_and_the_split(scripted_policy, tmp_path):
    """An eval episodes file (the test split) given as base rollouts: the win filter learns only from train play."""
    import pytest

    config = tiny_config(games={"builtin": ["guessnumber"]})
    settings = {name: config[name] for name in ("seed", "model", "games", "base_rollouts")}
    rows = rollouts.base_rollouts(settings, str(tmp_path / "base.parquet"),
                                  policy=scripted_policy(binary_search_answer))
    eval_path = tmp_path / "greedy_base.parquet"
    records.write_records(eval_path, [{**row, "split": "test", "mode": "greedy_base", "policy_tokens": 0,
                                       "prm_pairs": 0, "search_nodes": 0} for row in rows],
                          records.EVAL_EPISODES, {})
    with pytest.raises(records.RecordFileError, match=f"record file {eval_path} holds {len(rows)} test rows "
                                                      rf"\(of {len(rows)}\), where this stage reads only train rows"):
        rollouts.win_filter({"win_filter": config["win_filter"]}, str(eval_path), str(tmp_path / "sft.parquet"))
    assert not (tmp_path / "sft.parquet").exists()
