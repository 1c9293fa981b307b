"""Transcripts of our own (clemprm/evaluation/transcript.py) on episodes the tiny model played in three eval modes:
greedy play, best-of-N with a scripted PRM and beam search ranked by the policy's own log-probability. The searches'
``choices``, the episode and choices pages, the ``eval_transcripts`` stage, ``clemprm inspect --transcript``."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clemprm import records
from clemprm.cli import main
from clemprm.config import sections
from clemprm.evaluation import evaluate
from clemprm.evaluation.transcript import (choices_html, dialogue, episode_html, outcome_line, picked_episodes,
                                           write_transcripts)
from tests.conftest import tiny_config
from tests.test_search import ScriptedPRM

MODES = ("greedy_base", "best_of_n", "beam_search_logprob")
N = 3
SETTINGS = sections(tiny_config(games={"max_instances": {"validation": 2}},
                                eval={"max_new_tokens": 6, "n": N, "num_beam_iterations": 3}),
                    "seed", "model", "games", "eval")


def prm_value(messages, candidate):
    """The scripted PRM prefers longer answers."""
    return len(candidate) / 100


@pytest.fixture(scope="module")
def played(tmp_path_factory, test_cache_dir):
    """``{mode: (path, rows)}``: the tiny model's episodes in each mode of MODES."""
    from clemprm.models.generation import load_policy

    folder = tmp_path_factory.mktemp("transcripts")
    policy = load_policy(SETTINGS["model"], test_cache_dir)
    result = {}
    for mode in MODES:
        path = str(folder / f"{mode}.parquet")
        evaluate.evaluate_mode(mode, SETTINGS, path, policy=policy,
                               prm=ScriptedPRM(prm_value) if mode == "best_of_n" else None)
        result[mode] = path, records.read_records(path, records.EVAL_EPISODES)
    return result


def played_answer(row: dict, choice: dict) -> str | None:
    turns = {turn["turn_idx"]: turn for turn in row["turns"]}
    return turns[choice["turn_idx"]]["response"] if choice["turn_idx"] in turns else None


def test_the_searches_record_their_choices_on_the_played_path(played):
    _, greedy = played["greedy_base"]
    assert greedy and all(row["choices"] == [] for row in greedy)
    _, best_of_n = played["best_of_n"]
    for row in best_of_n:
        assert [choice["turn_idx"] for choice in row["choices"]] == list(range(row["n_turns"]))
        for choice in row["choices"]:
            assert len(choice["candidates"]) == N
            assert choice["scores"] == [prm_value(None, candidate) for candidate in choice["candidates"]]
            assert choice["chosen"] == choice["scores"].index(max(choice["scores"]))   # ties: the first
            assert choice["candidates"][choice["chosen"]] == played_answer(row, choice)
    _, beam = played["beam_search_logprob"]
    for row in beam:
        assert [choice["turn_idx"] for choice in row["choices"]] == list(range(row["n_turns"]))
        for choice in row["choices"]:
            assert 1 <= len(choice["candidates"]) == len(set(choice["candidates"])) <= N   # one child per answer
            assert len(choice["scores"]) == len(choice["candidates"]) and all(s <= 0 for s in choice["scores"])
            assert choice["candidates"][choice["chosen"]] == played_answer(row, choice)


def test_the_episode_page_shows_the_dialogue_the_answers_and_the_outcome(played):
    for _, rows in played.values():
        for row in rows:
            page = episode_html(row)
            assert html.escape(outcome_line(row)) in page
            for name in json.loads(row["episode_scores"]):
                assert f"<th>{html.escape(name)}</th>" in page
            for turn in row["turns"]:
                assert f'{html.escape(turn["player"])} ({html.escape(turn["game_role"])})</div>' in page
                assert f"<pre>{html.escape(turn['response'])}</pre>" in page
            for line in dialogue(row):
                assert f"<pre>{html.escape(line.text)}</pre>" in page
            # every message of every perspective is shown once: the messages since the player's previous answer
            assert sum(not line.answer for line in dialogue(row)) == sum(
                len(turn["messages"]) - last_answer(turn["messages"]) - 1 for turn in row["turns"])


def last_answer(messages: list[dict]) -> int:
    return max((i for i, message in enumerate(messages) if message["role"] == "assistant"), default=-1)


CANDIDATE_ROW = re.compile(r'<tr( class="chosen")?><td>(\d+)</td><td><pre>(.*?)</pre></td><td>(.*?)</td>'
                           r"<td>(.*?)</td></tr>", re.S)


def test_the_choices_page_lists_every_candidate_with_its_score_and_marks_the_played_one(played):
    for mode in ("best_of_n", "beam_search_logprob"):
        _, rows = played[mode]
        assert any(row["choices"] for row in rows)
        for row in rows:
            page = choices_html(row)
            expected = [(' class="chosen"' if j == choice["chosen"] else "", str(j), html.escape(candidate),
                         f"{score:.4f}", "played" if j == choice["chosen"] else "")
                        for choice in row["choices"]
                        for j, (candidate, score) in enumerate(zip(choice["candidates"], choice["scores"]))]
            assert CANDIDATE_ROW.findall(page) == expected
            assert page.count("<h2>turn ") == len(row["choices"])
            scorer = "the PRM's P(success)" if mode == "best_of_n" else "the policy's mean token log-probability"
            assert f"Scores: {html.escape(scorer)}." in page


def test_the_stage_writes_a_won_and_a_lost_episode_per_mode_and_game(played, tmp_path):
    written = write_transcripts([path for path, _ in played.values()], str(tmp_path / "transcripts"))
    assert sorted(written) == sorted((tmp_path / "transcripts").rglob("*.html"))
    for mode, (_, rows) in played.items():
        for game in {row["game"] for row in rows}:
            games = [row for row in rows if row["game"] == game]
            won = [row for row in games if row["success"]]
            # a lost episode played to the end where there is one, else an aborted one
            lost = ([row for row in games if not row["success"] and not row["aborted"]]
                    or [row for row in games if row["aborted"]])
            for page, candidates in (("won", won), ("lost", lost)):
                folder = tmp_path / "transcripts" / mode / game
                assert (folder / f"{page}.html").exists() == bool(candidates)
                assert (folder / f"{page}_choices.html").exists() == bool(candidates and mode != "greedy_base")
                if candidates:
                    assert (folder / f"{page}.html").read_text(encoding="utf-8") == episode_html(candidates[0])
    assert picked_episodes([]) == {}


def test_inspect_prints_an_episode_as_a_transcript(played, capsys):
    path, rows = played["best_of_n"]
    index = len(rows) - 1
    assert main(["inspect", path, "--transcript", str(index)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = rows[index]
    assert lines[0] == f"{row['episode_id']} (mode best_of_n, policy {row['policy']})"
    assert lines[-1] == outcome_line(row) and lines[-1].startswith("outcome: ")
    answers = [line for line in lines if not line.startswith(("Game Master → ", "System → "))][1:-1]
    assert answers == [f'{turn["player"]} ({turn["game_role"]}): "{turn["response"]}"'.replace("\n", "\\n")
                       for turn in row["turns"]]
    assert len(lines) == len(dialogue(row)) + 2   # one line per message


def test_inspect_transcript_refuses_a_missing_row_or_a_file_without_episodes(played, capsys, tmp_path):
    path, rows = played["greedy_base"]
    assert main(["inspect", path, "--transcript", str(len(rows))]) == 2
    assert capsys.readouterr().err == f"clemprm inspect: record file {path} has no row {len(rows)} (it has " \
                                      f"{len(rows)} rows)\n"
    pq.write_table(pa.table({"label": [0.5]}), tmp_path / "labels.parquet")
    assert main(["inspect", str(tmp_path / "labels.parquet"), "--transcript", "0"]) == 2
    assert "holds no episodes (no turns column)" in capsys.readouterr().err


def test_a_reader_that_stops_early_ends_the_transcript_quietly(played):
    """``clemprm inspect FILE --transcript N | head``: no BrokenPipeError traceback, the status of SIGPIPE."""
    import os
    import signal

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "clemprm", "inspect", played["best_of_n"][0], "--transcript", "0"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 128 + signal.SIGPIPE
