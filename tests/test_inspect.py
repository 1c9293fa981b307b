"""``clemprm inspect``: schema, provenance, per-game statistics and shortened examples of real record files."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from clemprm import records
from clemprm.checks.run_time import check_not_empty, marks_metadata
from clemprm.cli import main
from clemprm.evaluation.inspect import group_stats, histogram, inspect_file

PROVENANCE = {"config": {"games": {"names": ["guessnumber", "wordref"]}, "labels": {"k": 4}, "seed": 1},
              "versions": {"clemprm": "0.1.0", "clemcore": "3.7.2", "transformers": "5.24.0", "torch": "2.13"}}
LONG_PROMPT = "Guess a number between 1 and 100. " * 20
GAMES = ("guessnumber", "wordref")


def messages(n: int) -> list[dict]:
    """``n`` alternating messages, starting with the long game prompt and ending with an answer."""
    return [{"role": "user", "content": LONG_PROMPT if i == 0 else f"feedback {i}"} if i % 2 == 0
            else {"role": "assistant", "content": f"GUESS: {i}"} for i in range(n)]


def episode(game: str, index: int, aborted: bool, success: bool) -> dict:
    turns = [{"turn_idx": t, "player": "Player 1", "game_role": "Guesser", "messages": messages(2 * t + 1),
              "response": f"GUESS: {t}", "parse_ok": True, "prompt_tokens": 100, "new_tokens": 4,
              "reply": "Higher."}
             for t in range(index + 1)]
    return {"episode_id": f"{game}/e1/{index}/0", "game": game, "experiment": "e1", "game_id": index,
            "split": "train", "policy": "tiny", "seed": index, "temperature": 0.7, "n_turns": len(turns),
            "aborted": aborted, "lost": not (aborted or success), "success": success,
            "bench_score": float("nan") if aborted else 100.0 * success + 10 * index, "error": None,
            "episode_scores": '{"Main Score": 100}', "turns": turns}


EPISODE_OUTCOMES = {"guessnumber": [(True, False), (False, True), (False, True), (False, False)],
                    "wordref": [(False, True), (True, False)]}


@pytest.fixture
def episodes_file():
    rows = [episode(game, index, aborted, success) for game, outcomes in EPISODE_OUTCOMES.items()
            for index, (aborted, success) in enumerate(outcomes)]
    records.write_records("episodes.parquet", rows, records.EPISODES, PROVENANCE)
    return Path("episodes.parquet"), rows


@pytest.fixture
def interactions_file():
    rows = [{"messages": messages(6), "meta": {"game": game, "experiment": "e1", "task_id": index,
                                               "player_name": "Player 1", "game_role": "Guesser",
                                               "model": "tiny", "outcome": outcome}}
            for game in GAMES for index, outcome in enumerate(["success", "lose", "success", "aborted"])]
    records.write_records("interactions.parquet", rows, records.INTERACTIONS, PROVENANCE)
    return Path("interactions.parquet"), rows


def branch_point(game: str, index: int) -> dict:
    return {"bp_id": f"{game}/e1/{index}/0/0", "episode_id": f"{game}/e1/{index}/0", "game": game,
            "experiment": "e1", "game_id": index, "split": "train", "turn_idx": 0, "player": "Player 1",
            "game_role": "Guesser", "prefix": messages(3), "candidate": "GUESS: 50",
            "history": ["GUESS: 50"], "parse_ok": True, "seed": 7 + index, "episode_bench_score": 50.0,
            "episode_success": index % 2 == 0, "episode_aborted": False}


LABELS = {"guessnumber": [0.0, 0.25, 0.25, 1.0, 0.55], "wordref": [0.5, 0.75, 0.95]}


@pytest.fixture
def soft_labels_file():
    rows = []
    for game, labels in LABELS.items():
        for index, label in enumerate(labels):
            k = 0 if index == 0 else 4
            n_aborted = index % 3 if k else 0
            rows.append({**branch_point(game, index), "k": k, "terminal": k == 0,
                         "rollout_scores": [100.0 * label] * max(k, 1), "n_aborted": n_aborted,
                         "n_success": k - n_aborted, "n_capped": 0, "new_tokens": 40 * k, "label": label})
    records.write_records("soft_labels.parquet", rows, records.SOFT_LABELS, PROVENANCE)
    return Path("soft_labels.parquet"), rows


def answer(game: str, source: str, response: str, count: int, ended: tuple[int, int, int]) -> dict:
    n_success, n_lost, n_aborted = ended
    return {"source": source, "episode_id": f"{game}/e1/0/0", "game": game, "experiment": "e1", "game_id": 0,
            "split": "train", "turn_idx": 0, "player": "Player 1", "game_role": "Guesser", "messages": messages(1),
            "response": response, "parse_ok": response.startswith("GUESS"), "count": count, "n_success": n_success,
            "n_lost": n_lost, "n_aborted": n_aborted,
            "bench_score": 50.0 if n_success + n_lost else float("nan")}


@pytest.fixture
def answers_file():
    rows = [answer("guessnumber", "base_rollouts", "GUESS: 5", 3, (1, 1, 0)),
            answer("guessnumber", "base_rollouts", "No idea.", 1, (0, 0, 1)),
            answer("guessnumber", "label_continuations", "GUESS: 7", 4, (0, 0, 0)),
            answer("wordref", "siblings", "GUESS: 1", 2, (2, 0, 0))]
    records.write_records("answers.parquet", rows, records.ANSWERS, PROVENANCE)
    return Path("answers.parquet"), rows


def test_answers_records_count_plays_verdicts_and_ends_per_game(answers_file, capsys):
    path, _ = answers_file
    groups = group_stats(records.read_table(path))
    guessnumber = groups["guessnumber"]["answers"]
    assert (guessnumber["distinct"], guessnumber["plays"]) == (3, 8)
    assert guessnumber["accepted"] == pytest.approx(2 / 3) and guessnumber["accepted_plays"] == pytest.approx(7 / 8)
    assert guessnumber["ended"] == {"won": 1 / 8, "lost": 1 / 8, "aborted": 1 / 8}
    assert guessnumber["sources"] == {"base_rollouts": 2, "label_continuations": 1}
    assert groups["all"]["answers"]["plays"] == 10
    assert main(["inspect", str(path)]) == 0   # what clemprm inspect prints of them
    report = capsys.readouterr().out.splitlines()
    assert ("    answers: 3 distinct, 8 plays; accepted 66.7% (of the plays 87.5%); plays ended won 12.5%, lost 12.5%, "
            "aborted 12.5%") in report
    assert "    first played in: base_rollouts 2, label_continuations 1" in report
    assert "  parse_ok: bool" in report and "  count: int32" in report


def test_schema_rows_and_provenance(soft_labels_file):
    path, rows = soft_labels_file
    report = inspect_file(path).splitlines()
    assert f"rows: {len(rows)}" in report
    assert "  bp_id: string" in report
    assert "  prefix: list<struct<role: string, content: string>>" in report
    assert "  history: list<string>" in report
    assert "  rollout_scores: list<double>" in report
    assert "provenance: config sections games, labels, seed; clemprm 0.1.0, clemcore 3.7.2, transformers 5.24.0" \
        in report


def test_nested_episode_schema_is_compact(episodes_file):
    report = inspect_file(episodes_file[0]).splitlines()
    assert ("  turns: list<struct<turn_idx: int32, player: string, game_role: string, "
            "messages: list<struct<role: string, content: string>>, response: string, parse_ok: bool, "
            "prompt_tokens: int32, new_tokens: int32, reply: string>>") in report


def test_label_statistics_and_histogram_per_game(soft_labels_file):
    path, rows = soft_labels_file
    groups = group_stats(records.read_table(path), bins=4)
    assert list(groups) == ["guessnumber", "wordref", "all"]
    for game, labels in LABELS.items():
        label = groups[game]["label"]
        assert label["mean"] == pytest.approx(statistics.fmean(labels))
        assert label["std"] == pytest.approx(statistics.pstdev(labels))
        assert (label["min"], label["max"]) == (min(labels), max(labels))
    assert groups["guessnumber"]["label"]["histogram"] == [1, 2, 1, 1]  # 1.0 falls in the last bin
    assert groups["wordref"]["label"]["histogram"] == [0, 0, 1, 2]
    assert groups["all"]["label"]["histogram"] == [1, 2, 2, 3]
    assert groups["all"]["rows"] == len(rows)


def test_continuation_rates(soft_labels_file):
    path, rows = soft_labels_file
    stats = group_stats(records.read_table(path))["guessnumber"]
    game_rows = [row for row in rows if row["game"] == "guessnumber"]
    played = sum(row["k"] for row in game_rows)
    assert stats["mean_k"] == pytest.approx(statistics.fmean(row["k"] for row in game_rows))
    assert stats["continuation_abort_rate"] == pytest.approx(sum(row["n_aborted"] for row in game_rows) / played)
    assert stats["continuation_success_rate"] == pytest.approx(sum(row["n_success"] for row in game_rows) / played)
    assert stats["success_rate"] == pytest.approx(3 / 5) and stats["outcome_of"] == "episode"


def test_histogram_bars_scale_to_the_width(soft_labels_file):
    report = inspect_file(soft_labels_file[0], width=60, bins=4).splitlines()
    bars = [line for line in report if line.lstrip().startswith("[")]
    assert len(bars) == 3 * 4  # two games and all
    assert max(len(line) for line in bars) == 60
    assert bars[4].strip() == "[0.00, 0.25) 0"
    assert "[0.75, 1.00] 1 #" in bars[3] and bars[3].count("#") == bars[2].count("#")
    assert bars[1].count("#") > bars[0].count("#")


def test_episode_abort_success_score_and_turns(episodes_file):
    path, rows = episodes_file
    groups = group_stats(records.read_table(path))
    guessnumber = groups["guessnumber"]
    assert guessnumber["abort_rate"] == pytest.approx(1 / 4)
    assert guessnumber["success_rate"] == pytest.approx(2 / 4)
    played = [row["bench_score"] for row in rows if row["game"] == "guessnumber" and not row["aborted"]]
    assert guessnumber["bench_score"] == pytest.approx(statistics.fmean(played))
    assert guessnumber["mean_turns"] == pytest.approx(statistics.fmean([1, 2, 3, 4]))
    assert groups["wordref"]["abort_rate"] == pytest.approx(1 / 2)
    report = inspect_file(path)
    assert "  guessnumber: 4 rows, abort 25.0%, success 50.0%, bench_score 86.7, turns 2.50" in report


def test_turns_counted_from_the_nested_list_when_n_turns_is_absent(episodes_file):
    table = records.read_table(episodes_file[0]).drop_columns(["n_turns"])
    assert group_stats(table)["wordref"]["mean_turns"] == pytest.approx(1.5)


def test_interactions_group_by_meta_game_and_count_outcomes(interactions_file):
    groups = group_stats(records.read_table(interactions_file[0]))
    assert groups["wordref"]["rows"] == 4
    assert groups["guessnumber"]["outcomes"] == {"aborted": 1, "lose": 1, "success": 2}


def test_eval_episodes_group_by_game_and_mode(episodes_file):
    import pyarrow as pa

    table = records.read_table(episodes_file[0])
    table = table.append_column("mode", pa.array(["greedy", "prm"] * (table.num_rows // 2)))
    assert list(group_stats(table)) == ["guessnumber / greedy", "guessnumber / prm", "wordref / greedy",
                                        "wordref / prm", "all"]


def test_examples_are_shortened_and_messages_summarized(interactions_file, episodes_file):
    report = inspect_file(interactions_file[0], examples=2, width=80).splitlines()
    examples = report[report.index("example row 0:"):]
    assert "example row 7:" in examples  # spread to the last row
    assert all(len(line) <= 80 for line in examples)
    messages_line = next(line for line in examples if line.startswith("  messages: "))
    assert messages_line.startswith('  messages: [6 messages] user: "Guess a number')
    assert messages_line.endswith('… assistant: "GUESS: 5"')
    assert '…" …' in messages_line  # the long prompt is cut
    episode_report = inspect_file(episodes_file[0], examples=1, width=70)
    assert '  turns: [1 turn] Guesser: "GUESS: 0"' in episode_report
    assert '  episode_id: "guessnumber/e1/0/0"' in episode_report


def test_empty_file(tmp_path):
    records.write_records("empty.parquet", [], records.SOFT_LABELS, PROVENANCE)
    report = inspect_file("empty.parquet")
    assert "rows: 0" in report and "per game:" not in report and "example row" not in report


def test_histogram_edges():
    assert histogram([0.0, 0.1, 0.0999, 0.5, 1.0], 10) == [2, 1, 0, 0, 0, 1, 0, 0, 0, 1]


@pytest.mark.parametrize("content", [None, b"not a parquet file at all"])
def test_unreadable_file_exits_2_naming_it(capsys, content):
    if content is not None:
        Path("broken.parquet").write_bytes(content)
    assert main(["inspect", "broken.parquet"]) == 2
    error = capsys.readouterr().err
    assert "broken.parquet" in error and error.startswith("clemprm inspect: ")


def test_a_folder_is_refused_with_the_record_files_under_it(soft_labels_file, tmp_path, capsys):
    """`clemprm inspect results` said "Could not read schema from .../benchmarks/base_rollouts.tsv"."""
    results = tmp_path / "results"
    (results / "benchmarks").mkdir(parents=True)
    (results / "benchmarks" / "base_rollouts.tsv").write_text("s\th:m:s\n1.0\t0:00:01\n")
    (results / "labels").mkdir()
    shutil.copy(soft_labels_file[0], results / "labels" / "soft_labels.parquet")
    assert main(["inspect", str(results)]) == 2
    error = capsys.readouterr().err
    assert error == (f"clemprm inspect: {results} is a folder: give one record file (a .parquet file); under it:\n"
                     f"  {results}/labels/soft_labels.parquet\n")
    assert main(["inspect", str(results / "benchmarks")]) == 2
    assert "it holds none" in capsys.readouterr().err


def venv_bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@pytest.mark.parametrize("command", [[venv_bin("clemprm")], [sys.executable, "-m", "clemprm"]],
                         ids=["console-script", "python-m"])
def test_installed_command(soft_labels_file, command):
    if command[0].endswith("clemprm"):
        assert shutil.which(command[0]), "console script missing: pip install --no-deps -e ."
    done = subprocess.run(command + ["inspect", str(soft_labels_file[0]), "--bins", "5"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "rows: 8" in done.stdout and "[0.80, 1.00]" in done.stdout
    missing = subprocess.run(command + ["inspect", "nowhere.parquet"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nowhere.parquet" in missing.stderr


def test_a_stage_that_went_on_despite_a_failure_says_so(soft_labels_file, tmp_path):
    _, rows = soft_labels_file
    marks = check_not_empty("gather_soft_labels", "soft labels", 0, "3 branch points", "continue",
                            condition="no_soft_labels")
    path = tmp_path / "marked.parquet"
    records.write_records(path, rows, records.SOFT_LABELS, {**PROVENANCE, **marks_metadata(marks)})
    report = inspect_file(path).splitlines()
    assert ("WARNING, the stage went on (on_failure: continue): gather_soft_labels: no soft labels (3 branch points)"
            in report)
    assert not any(line.startswith("WARNING") for line in inspect_file(soft_labels_file[0]).splitlines())


def test_a_reader_that_stops_early_ends_the_command_quietly(soft_labels_file):
    """``clemprm inspect FILE | head``: the reader goes away before the report is written; no BrokenPipeError
    traceback, the status of a Unix tool ended by SIGPIPE."""
    import os
    import signal

    read, write = os.pipe()
    os.close(read)   # the reader is gone before the command writes a line
    try:
        done = subprocess.run([sys.executable, "-m", "clemprm", "inspect", str(soft_labels_file[0])], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE
