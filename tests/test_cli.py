"""The command line and the console around a run: ``--help`` of every command, ``clemprm summary`` refusing a file
that is not a prm_eval.json, a failed run's console showing each failed job's own error, the table of a run that
did not make it named as such, and scripts/learning_benchmark.py's checks of its arguments (the cheap ones: no
seed is run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clemprm.cli import build_parser, main
from clemprm.config import sections
from clemprm.evaluation import console, evaluate, seeds
from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parent.parent
BENCHMARK = [sys.executable, str(REPO / "scripts" / "learning_benchmark.py")]
SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.parametrize("command", [[], *([name] for name in SUBCOMMANDS)], ids=["clemprm", *SUBCOMMANDS])
def test_help_of_the_cli_and_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {' '.join(['clemprm', *command])}")


def test_help_of_the_learning_benchmark():
    result = subprocess.run([*BENCHMARK, "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--table-only" in result.stdout


# ------------------------------------------------------------------------------------------------ clemprm summary


def summary(path: Path) -> dict:
    """A real evaluation summary (of no mode) written to ``path``."""
    settings = sections(tiny_config(), "seed", "model", "games", "eval")
    path.parent.mkdir(parents=True, exist_ok=True)
    return evaluate.summarize_eval(settings, [], str(path))


# the top level of a PRM stage's results/prm/metrics.json: a JSON object, but no evaluation summary
PRM_METRICS = {"status": "trained", "steps": 4, "examples": 16, "config": {"prm": {"epochs": 1}}, "evaluation": {},
               "gate": {"status": "passed", "checks": [], "reported": [], "not_judged": []}}


@pytest.mark.parametrize(("content", "says"), [
    (json.dumps(PRM_METRICS), "it has no split, bootstrap, modes, differences, versions (its keys: config, "),
    ("{}", "it has no split, bootstrap, modes, differences, config, versions (it is {})"),
    ("[]", "it holds a list, not an evaluation summary"),
    ("null", "it holds null, not an evaluation summary"),
    ("", "it is not JSON"),
    (json.dumps({"split": "test", "bootstrap": {}, "modes": {}, "differences": {}, "config": {}, "versions": {}}),
     "does not match the schema of prm_eval.json at bootstrap: 'samples' is a required property"),
], ids=["prm-metrics", "empty-object", "list", "null", "empty-file", "bootstrap-missing-keys"])
def test_summary_refuses_a_file_that_is_not_a_prm_eval_json(tmp_path, capsys, content, says):
    path = tmp_path / "results" / "prm" / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert main(["summary", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"clemprm summary: {path}")
    assert says in captured.err and "snakemake results/prm_eval.json makes it" in captured.err


def test_summary_of_a_missing_file_names_it(tmp_path, capsys):
    assert main(["summary", str(tmp_path / "prm_eval.json")]) == 2
    assert capsys.readouterr().err == f"clemprm summary: {tmp_path / 'prm_eval.json'}: No such file or directory\n"


def test_summary_names_a_table_this_run_did_not_make(tmp_path, capsys):
    path = tmp_path / "prm_eval.json"
    summary(path)
    made = path.stat().st_mtime
    assert main(["summary", str(path), "--run-start", str(made - 1)]) == 0   # made in this run: no word
    assert capsys.readouterr().out.startswith("clemprm results: validation split")
    assert main(["summary", str(path), "--run-start", str(made + 1)]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith(f"WARNING: this run did not make {path}: the table below is that of the run that made ")
    assert first.endswith("(validation split, seed 42)") and second.startswith("clemprm results: validation split")


# ------------------------------------------------------------------------------------------------ a run's console


def snakemake(workdir: Path, config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--cores", "1",
                           "--directory", str(workdir), *args, "--configfile", str(config)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_a_run_names_the_table_it_did_not_make_and_a_failed_job_its_own_error(tmp_path, test_cache_dir):
    """The tiny workflow aimed at its first job: the run ends with the table of an older prm_eval.json, named as not
    made by this run; then the same job with a context limit that no prompt fits: the failed run ends with that table
    too, then the job's StageFailure from its log, with the key to change, not only Snakemake's CalledProcessError."""
    from tests.test_workflow import prepare_workdir

    workdir = prepare_workdir(tmp_path, test_cache_dir)
    summary(workdir / "results" / "prm_eval.json")
    result = snakemake(workdir, workdir / "tiny.yaml", "results/rollouts/base_train.parquet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING: this run did not make results/prm_eval.json: the table below is that of the run that made " \
           in result.stdout
    config = yaml.safe_load((workdir / "tiny.yaml").read_text())
    config["on_failure"], config["model"]["max_context_tokens"] = "stop", 16
    (workdir / "short.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, workdir / "short.yaml", "results/rollouts/base_train.parquet", "--forcerun",
                       "base_rollouts")   # the target first: --forcerun takes every word after it as a rule
    assert result.returncode != 0
    assert "WARNING: this run did not make results/prm_eval.json: the table below is that of the run that made " \
           in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("rule base_rollouts failed")]
    assert len(lines) == 1, result.stderr[-3000:]
    line = lines[0]
    assert line.startswith("rule base_rollouts failed (results/logs/base_rollouts.log): StageFailure: base_rollouts: "
                           "every episode of 7 games: ")
    assert "context too long: " in line and "> 16 tokens (model.max_context_tokens; raise it" in line


def test_failed_jobs_of_a_main_log_with_a_job_and_a_group_error(tmp_path, monkeypatch):
    """Snakemake's main log (its format in snakemake/logging.py) of a --keep-going run: a job's error block (logged
    twice), a group's with two jobs, and a started job's block (its log line is no error): one line per failed job."""
    monkeypatch.chdir(tmp_path)   # job logs are relative to the run's directory, as in onerror
    (tmp_path / "results" / "logs" / "eval").mkdir(parents=True)
    for name, error in [("base_rollouts", "clemprm.checks.run_time.StageFailure: base_rollouts: every episode failed"),
                        ("labels", "RuntimeError: CUDA out of memory"), ("eval/greedy_base", "KeyError: 'x'")]:
        (tmp_path / "results" / "logs" / f"{name}.log").write_text(f"Traceback (most recent call last):\n  File "
                                                                   f"\"x.py\", line 1, in <module>\n{error}\n")
    error_block = ("Error in rule base_rollouts:\n    message: None\n    jobid: 0\n    input: instances.csv\n"
                   "    output: results/rollouts/base_train.parquet\n"
                   "    log: results/logs/base_rollouts.log (check log file(s) for error details)\n")
    main_log = tmp_path / "main.log"
    main_log.write_text(
        "localrule eval_mode:\n    log: results/logs/eval/greedy_base.log\n    jobid: 3\n"
        + error_block + "Shutting down, this might take some time.\n" + error_block
        + "Error in group labels:\n    log: results/logs/group.log (check log file(s) for error details)\n"
          "    jobs:\n        rule soft_labels:\n            jobid: 5\n"
          "            log: results/logs/labels.log (check log file(s) for error details)\n"
          "        rule eval_mode:\n            jobid: 6\n"
          "            log: results/logs/eval/greedy_base.log (check log file(s) for error details)\n"
          "Exiting because a job execution failed. Look above for error messages\n")
    assert console.failed_jobs([str(main_log)]) == [
        "rule base_rollouts failed (results/logs/base_rollouts.log): StageFailure: base_rollouts: every episode failed",
        "rule soft_labels failed (results/logs/labels.log): RuntimeError: CUDA out of memory",
        "rule eval_mode failed (results/logs/eval/greedy_base.log): KeyError: 'x'"]


def test_last_error_of_a_log_without_a_traceback_or_past_torchrun(tmp_path):
    """A job log of torchrun's processes ends with torchrun's own ChildFailedError: the process's error is the one
    shown; a log with no traceback shows its last line, an empty or missing one says so."""
    log = tmp_path / "prm_adapter.log"
    log.write_text("2026-12-06 04:15:39,001 rank 1/2 INFO clemprm.stages.prm: training\n"
                   "Traceback (most recent call last):\n"
                   '  File "/work/main/clemprm/stages/prm.py", line 62, in prm_adapter\n'
                   "    raise ValueError(problem)\n"
                   "ValueError: config key 'prm.lora.target_modules': no module vproj in the model\n"
                   "Traceback (most recent call last):\n"
                   '  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 9, in main\n'
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                   "============================================================\n")
    assert console.last_error(log) == "ValueError: config key 'prm.lora.target_modules': no module vproj in the model"
    log.write_text("2026-12-06 04:15:39,001 INFO clemprm.stages.prm: training\nKilled\n\n")
    assert console.last_error(log) == "no traceback in its log, whose last line is: Killed"
    log.write_text("")
    assert console.last_error(log) == "its log is empty: see Snakemake's output above"
    assert console.last_error(tmp_path / "missing.log") == ("its log cannot be read (No such file or directory): see "
                                                            "Snakemake's output above")


# ------------------------------------------------------------------------------------------------ the benchmark


def benchmark(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCHMARK, "--workdir", str(tmp_path / "runs"), *args], capture_output=True, text=True,
                          cwd=tmp_path)


@pytest.mark.parametrize(("content", "says"), [
    (None, "--add {path}: cannot read it (No such file or directory)"),
    ("", "--add {path}: not JSON (Expecting value"),
    ("{}", "--add {path}: not a table of this benchmark with a seed in it"),
    ('{"seeds": {}}', "--add {path}: not a table of this benchmark with a seed in it"),
    ("[1]", "--add {path}: not a table of this benchmark with a seed in it"),
], ids=["missing", "empty", "empty-object", "no-seed", "list"])
def test_benchmark_refuses_an_added_file_that_is_not_its_table(tmp_path, content, says):
    path = tmp_path / "seeds.json"
    if content is not None:
        path.write_text(content)
    result = benchmark(tmp_path, "--table-only", "--add", str(path))
    assert result.returncode == 1 and result.stderr.startswith(f"learning_benchmark.py: {says.format(path=path)}")
    assert not (tmp_path / "runs" / "seeds.json").exists()


def test_benchmark_with_nothing_measured_is_an_error(tmp_path):
    result = benchmark(tmp_path, "--table-only", "--seeds", "7", "11")
    assert result.returncode == 1
    assert result.stderr.startswith("learning_benchmark.py: nothing to tabulate: no seed of --seeds 7 11 has a "
                                    f"prm_eval.json under {tmp_path / 'runs'}")
    assert not (tmp_path / "runs" / "seeds.json").exists()


def test_benchmark_checks_its_configs_and_the_lookahead_runs_start_before_any_seed_runs(tmp_path):
    result = benchmark(tmp_path, "--seeds", "7", "--regimes", "lookahead", "blind", "--config", "nope.yaml")
    assert result.returncode == 1
    assert result.stderr == "learning_benchmark.py: --config: config file nope.yaml: cannot read it (No such file " \
                            "or directory)\n"
    result = benchmark(tmp_path, "--seeds", "7", "11", "--regimes", "lookahead")
    assert result.returncode == 1
    assert result.stderr.startswith("learning_benchmark.py: --regimes lookahead: a lookahead run starts from the "
                                    "seed's blind run, and seed(s) 7, 11 have none under ")
    assert "run --regimes blind lookahead" in result.stderr and not (tmp_path / "runs").exists()


def test_a_seed_whose_pipeline_fails_is_named_and_the_other_seeds_still_run(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("sft: {epochs: many}\n")   # read as a config file; the Snakefile's parse refuses it
    result = benchmark(tmp_path, "--seeds", "7", "11", "--regimes", "blind", "blind-probe", "--config", str(config))
    assert result.returncode == 1 and "Traceback" not in result.stderr.split("learning_benchmark.py: ")[-1]
    assert "[learning benchmark] seed 11, blind: " in result.stdout   # seed 7's failure did not stop seed 11
    last = result.stderr.strip().splitlines()[-1]
    for seed in (7, 11):
        assert (f"seed {seed}, blind: snakemake failed (exit status 1; its error is above, Snakemake's log of the run "
                f"in {seeds.seed_dir(tmp_path / 'runs', seed, 'blind')}/.snakemake/log/), so blind-probe did not run"
                in last)
    assert "[learning benchmark] seed 7, blind-probe" not in result.stdout
    assert "; nothing to tabulate: no seed of --seeds 7 11 has a prm_eval.json" in last
    assert "config key 'sft.epochs': 'many' is not of type 'number'" in result.stderr   # the seed's own error


def test_benchmark_regimes_run_blind_first_and_a_missing_run_is_a_warning(tmp_path):
    assert seeds.regimes_in_order(["lookahead", "blind"]) == ["blind", "lookahead"]
    workdir = tmp_path / "runs"
    summary(seeds.seed_dir(workdir, 7, "blind") / "results" / "prm_eval.json")
    rows, warnings = seeds.measured_rows(workdir, [7, 11], ["blind"], {})
    assert list(rows) == [7] and rows[7]["blind/commit"] == "unknown"
    assert warnings == [f"seed 11, blind: no {seeds.seed_dir(workdir, 11, 'blind')}/results/prm_eval.json: its "
                        "figures are n/a in the table (run it without --table-only, or --add the seeds.json of a run "
                        "elsewhere)"]
    # a seed added from elsewhere with that regime's figures is no missing run
    rows, warnings = seeds.measured_rows(workdir, [7, 11], ["blind"], {11: {"blind/gate": "passed"}})
    assert set(rows) == {7, 11} and warnings == []
    (seeds.seed_dir(workdir, 11, "blind") / "results").mkdir(parents=True)
    (seeds.seed_dir(workdir, 11, "blind") / "results" / "prm_eval.json").write_text("{}")
    with pytest.raises(seeds.BenchmarkError, match=r"^seed 11, blind: .*prm_eval.json is not a prm_eval.json: it has "
                                                   r"no split"):
        seeds.measured_rows(workdir, [7, 11], ["blind"], {})
