"""The benchmarks' one door (clemprm.bench): every benchmark is listed, one runs on the tiny model and writes its
figures as JSON (min / median / max over the repeats, ratios taken per repeat), the learning benchmark parses its
options and refuses what it cannot use, and the shared parts (Figures, RunFiles) keep their promises."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from clemprm.bench import Figures, RunFiles, learning
from clemprm.bench.__main__ import main

REPO = Path(__file__).resolve().parent.parent
# the benchmarks that were scripts/bench_*.py and scripts/clembench_suite.py before the door, and the learning
# benchmark (scripts/learning_benchmark.py is its alias)
BENCHMARKS = {"clembench_suite", "distributed", "engine", "generation", "hanabi", "hanabi_rl", "k_first", "labels",
              "learning", "merge", "prm", "prm_training", "probe", "rl", "score", "sft", "siblings", "vllm"}


def test_the_list_names_every_benchmark_with_what_it_measures(capsys):
    main(["--list"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert {line.split()[0] for line in lines} == BENCHMARKS
    assert all(len(line.split()) > 3 for line in lines)   # each with a sentence


def test_the_engine_benchmark_on_the_tiny_model_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "figures.json"
    main(["engine", "--episodes", "4", "--repeat", "2", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["benchmark"] == "engine" and set(written["machine"]) == {"cpus", "load_average"}
    figures = written["figures"]
    assert set(figures) == {"engine episodes/s", "batchwise episodes/s", "sequential episodes/s",
                            "engine vs sequential", "engine vs batchwise"}
    for figure in figures.values():
        assert len(figure["samples"]) == 2                                   # a sample per repeat
        assert figure["min"] <= figure["median"] <= figure["max"]
        assert figure["median"] == pytest.approx(sum(figure["samples"]) / 2)
    ratio = figures["engine vs sequential"]
    assert ratio["ratio_of"] == ["engine episodes/s", "sequential episodes/s"]
    assert ratio["samples"] == pytest.approx([a / b for a, b in zip(figures["engine episodes/s"]["samples"],
                                                                    figures["sequential episodes/s"]["samples"])])
    assert "identical episodes engine vs sequential: 4/4" in written["notes"]       # greedy: the same games
    assert "== engine: 2 repeat(s); min / median / max over the repeats" in printed


def test_a_ratio_pairs_the_samples_of_one_repeat_and_needs_both():
    figures = Figures("demo")
    for a, b in ((2.0, 1.0), (9.0, 3.0), (4.0, 4.0)):   # A B, A B, A B
        figures.add("a", a, "s")
        figures.add("b", b, "s")
    figures.ratio("a / b", "a", "b")
    summary = figures.as_json()["figures"]["a / b"]
    assert summary["samples"] == [2.0, 3.0, 1.0] and (summary["min"], summary["median"], summary["max"]) == (1, 2, 3)
    figures.add("c", 1.0)
    with pytest.raises(ValueError, match="a ratio needs both measured in every repeat"):
        figures.ratio("a / c", "a", "c")


def test_a_benchmark_repeated_whole_keeps_a_sample_per_repeat():
    first, second = Figures("demo"), Figures("demo")
    first.add("x", 1.0, "s")
    second.add("x", 3.0, "s")
    first.merge(second)
    assert first.as_json()["figures"]["x"]["samples"] == [1.0, 3.0]


def test_an_unknown_benchmark_and_a_missing_run_file_say_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match=r"no benchmark 'nope': one of .*engine.* \(python -m clemprm.bench --list\)"):
        main(["nope"])
    with pytest.raises(SystemExit, match=r"labels/soft_labels.parquet does not exist: --results names a pipeline's "
                                         r"results folder whose gather_soft_labels rule has run"):
        RunFiles(tmp_path).soft_labels()


def test_the_learning_benchmark_parses_its_options_and_refuses_what_it_cannot_use(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["learning", "--help"])
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: python -m clemprm.bench learning") and "--table-only" in printed
    assert "(default: runs/learning)" in " ".join(printed.split())   # its seeds resume there, not in a temporary one
    with pytest.raises(SystemExit) as exit_:
        main(["learning", "--regimes", "blind", "sideways"])
    assert exit_.value.code == 2 and "invalid choice: 'sideways'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^python -m clemprm.bench learning: --repeat 2: the seeds are this "):
        main(["learning", "--repeat", "2", "--table-only", "--workdir", str(tmp_path / "runs")])
    with pytest.raises(SystemExit, match=r"^python -m clemprm.bench learning: nothing to tabulate: no seed of --seeds "
                                         r"7 11 has a prm_eval.json under "):
        main(["learning", "--table-only", "--seeds", "7", "11", "--workdir", str(tmp_path / "runs")])
    with pytest.raises(SystemExit, match=r"^python -m clemprm.bench learning: --config: config file nope.yaml: cannot "
                                         r"read it"):
        main(["learning", "--seeds", "7", "--config", "nope.yaml", "--workdir", str(tmp_path / "runs")])
    assert not list((tmp_path / "runs").iterdir())   # no seed ran, no table written


def test_the_learning_benchmark_tabulates_a_table_made_elsewhere(tmp_path, capsys):
    """``--table-only --add`` with the three seeds of docs/data/learning_seeds.json: the table written again, the
    door's figures counting its seeds and claims."""
    out = tmp_path / "figures.json"
    main(["learning", "--table-only", "--add", str(REPO / "docs" / "data" / "learning_seeds.json"), "--seeds", "7",
          "--workdir", str(tmp_path / "runs"), "--json", str(out)])
    assert "| blind: best_of_n beats random_of_n on clemscore |" in capsys.readouterr().out
    figures = json.loads(out.read_text())["figures"]
    assert figures["seeds tabulated"]["samples"] == [3] and figures["claims judged"]["samples"][0] > 0
    table = json.loads((tmp_path / "runs" / "seeds.json").read_text())
    assert sorted(table["seeds"]) == ["11", "42", "7"]


def test_the_learning_benchmark_keeps_a_finished_seed_whatever_commit_made_it(tmp_path, capsys):
    """A seed's finished run is not run again when the code changed since (Snakemake would rerun it from its first
    rule); ``--rerun-finished`` runs it: here Snakemake starts and fails on the missing config file."""
    run = tmp_path / "runs" / "seed-7" / "blind"
    (run / "results").mkdir(parents=True)
    (run / "results" / "prm_eval.json").write_text("{}")
    (run / "commit.txt").write_text("abc1234\n")
    args = argparse.Namespace(workdir=str(tmp_path / "runs"), cores=1, split="test", rerun_finished=False,
                              config=str(tmp_path / "absent.yaml"), lookahead=str(tmp_path / "absent.yaml"))
    assert learning.run_seed(7, "blind", args) == run / "results" / "prm_eval.json"
    assert "seed 7, blind: finished at commit abc1234, kept (--rerun-finished" in capsys.readouterr().out
    args.rerun_finished = True
    with pytest.raises(subprocess.CalledProcessError):
        learning.run_seed(7, "blind", args)
    assert (run / "commit.txt").read_text() == "abc1234\n"
