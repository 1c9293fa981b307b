"""The Snakemake workflow end to end on the tiny model, in a temporary directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import json

import jsonschema
import pytest
import yaml

from clemprm import evaluation, records

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--cores", "2"]


def tiny_workflow_config(cache_dir: str) -> dict:
    return {
        "cache_dir": cache_dir,
        "model": {"spec": "tiny:0", "threads": 1},
        "games": {"max_instances": {"train": 2, "validation": 1, "test": 1}},
        "base_rollouts": {"episodes_per_instance": 2, "max_new_tokens": 8},
        "win_filter": {"require_success": True, "min_bench_score": 0.0},
        # a random tiny model rarely wins: a small playpen-data file guarantees SFT examples
        "sft": {"epochs": 2, "batch_size": 4, "grad_accum": 1, "max_examples": 8, "lr": 1e-3, "extra_data": "extra.jsonl"},
        "branch_points": {"max_new_tokens": 8},
        "labels": {"k": 2, "max_new_tokens": 8, "shards": 2, "checkpoint_every": 2},
        "prm": {"epochs": 1, "max_examples": 16, "batch_size": 8, "grad_accum": 1},
        "eval": {"max_new_tokens": 8, "n": 2, "num_beam_iterations": 4, "bootstrap_samples": 100},
    }


def write_extra_interactions(path: Path) -> None:
    """A playpen-data interactions export: 4 instances of one won dialogue (and one lost row, filtered out)."""
    rows = [{"messages": [{"role": "user", "content": f"Guess a number from 1 to 10. (game {i})"},
                          {"role": "assistant", "content": "GUESS: 5"}],
             "meta": {"game": "extra", "experiment": "e", "task_id": i, "player_name": "Player 1",
                      "game_role": "Guesser", "model": "m", "outcome": "success" if i < 4 else "lose"}}
            for i in range(5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def planned_rules(dry_run_output: str) -> set[str]:
    """The rules a dry run would run (its `rule <name>:` / `localrule <name>:` lines)."""
    return set(re.findall(r"^(?:local)?rule (\w+):", dry_run_output, flags=re.MULTILINE))


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    # targets and options before --configfile, which takes every following word as a config file
    result = subprocess.run(SNAKEMAKE + [*args, "--directory", str(workdir), "--configfile", str(workdir / "tiny.yaml")],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if check and result.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


@pytest.fixture
def workdir(tmp_path, test_cache_dir):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_workflow_config(test_cache_dir)))
    write_extra_interactions(tmp_path / "extra.jsonl")
    return tmp_path


def test_dry_run_lists_the_rules(workdir):
    output = snakemake(workdir, "-n").stdout
    for rule in ("base_rollouts", "win_filter", "sft_adapter", "branch_points", "soft_labels", "gather_soft_labels",
                 "all"):
        assert rule in output


def test_malformed_config_fails_at_parse_time_naming_the_key(workdir):
    result = snakemake(workdir, "-n", "--config", "seed=-3", check=False)
    assert result.returncode != 0
    assert "'seed'" in result.stdout + result.stderr


def test_stages_run_and_only_changed_sections_rerun(workdir):
    snakemake(workdir)
    episodes_path = workdir / "results/rollouts/base_train.parquet"
    sft_path = workdir / "results/sft/sft_data.parquet"
    episodes = records.read_records(episodes_path, records.EPISODES)
    assert len(episodes) == 3 * 2 * 2  # 3 games x 2 train instances x 2 episodes
    assert {row["game"] for row in episodes} == {"guessnumber", "wordref", "oddoneout"}
    assert all(row["policy"].startswith("tiny") for row in episodes)
    assert all(row["n_turns"] >= 1 for row in episodes)
    records.read_records(sft_path, records.INTERACTIONS)  # schema checked
    adapter, metrics_path = workdir / "results/sft/adapter", workdir / "results/sft/metrics.json"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    metrics = json.loads(metrics_path.read_text())
    assert metrics["status"] == "trained" and metrics["steps"] > 0 and metrics["examples"]["rows"]["extra_data"] == 4
    assert metrics["config"]["sft"]["lr"] == 1e-3 and metrics["config"]["model"]["spec"] == "tiny:0"
    bps = records.read_records(workdir / "results/labels/branch_points.parquet", records.BRANCH_POINTS)
    soft_labels = records.read_records(workdir / "results/labels/soft_labels.parquet", records.SOFT_LABELS)
    assert bps and [row["bp_id"] for row in soft_labels] == [bp["bp_id"] for bp in bps]
    assert all(0 <= row["label"] <= 1 and row["k"] in (0, 2) for row in soft_labels)
    assert sorted(p.name for p in (workdir / "results/labels/shards").iterdir()) == ["0-of-2.parquet", "1-of-2.parquet"]
    prm_metrics = json.loads((workdir / "results/prm/metrics.json").read_text())
    assert prm_metrics["config"]["prm"]["epochs"] == 1
    summary = json.loads((workdir / "results/prm_eval.json").read_text())
    jsonschema.validate(summary, json.loads(evaluation.SCHEMA_PATH.read_text()))
    assert set(summary["modes"]) == {"greedy_base", "greedy_sft", "random_of_n", "best_of_n", "beam_search",
                                     "greedy_rl"}
    for figure in ("eval_scores", "soft_labels", "prm_calibration", "training_curves"):
        assert (workdir / f"results/report/{figure}.png").stat().st_size > 1000
    for name in ("base_rollouts", "win_filter", "sft_adapter", "branch_points", "gather_soft_labels",
                 "soft_labels/0-of-2", "prm_adapter", "greedy_base", "greedy_sft", "random_of_n", "best_of_n",
                 "beam_search",
                 "eval_summary", "eval_report_figures"):
        assert "rule " in (workdir / f"results/logs/{name}.log").read_text()
        assert (workdir / f"results/benchmarks/{name}.tsv").exists()
    assert "episodes done" in (workdir / "results/logs/base_rollouts.log").read_text()
    assert "sft step" in (workdir / "results/logs/sft_adapter.log").read_text()

    snakemake(workdir, "--report", "report.html")
    assert (workdir / "report.html").stat().st_size > 10000

    up_to_date = snakemake(workdir, "-n")
    assert "Nothing to be done" in up_to_date.stdout + up_to_date.stderr

    config = yaml.safe_load((workdir / "tiny.yaml").read_text())
    config["win_filter"]["min_bench_score"] = 50.0
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(config))
    episodes_mtime, sft_mtime = episodes_path.stat().st_mtime_ns, sft_path.stat().st_mtime_ns
    metrics_mtime = metrics_path.stat().st_mtime_ns
    snakemake(workdir)
    assert episodes_path.stat().st_mtime_ns == episodes_mtime  # base rollouts not rerun
    assert sft_path.stat().st_mtime_ns != sft_mtime  # win filter rerun
    assert records.read_provenance(sft_path)["config"]["win_filter"]["min_bench_score"] == 50.0
    assert metrics_path.stat().st_mtime_ns != metrics_mtime  # SFT is downstream of the win filter: rerun

    # changing sft.lr reruns the SFT stage only, nothing upstream of it
    config["sft"]["lr"] = 2e-3
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(config))
    mtimes = {path: path.stat().st_mtime_ns for path in (episodes_path, sft_path, metrics_path)}
    dry_run = snakemake(workdir, "-n").stdout
    assert "sft_adapter" in dry_run and "base_rollouts" not in dry_run and "win_filter" not in dry_run
    snakemake(workdir)
    assert episodes_path.stat().st_mtime_ns == mtimes[episodes_path]
    assert sft_path.stat().st_mtime_ns == mtimes[sft_path]
    assert metrics_path.stat().st_mtime_ns != mtimes[metrics_path]
    assert json.loads(metrics_path.read_text())["config"]["sft"]["lr"] == 2e-3

    # eval settings rerun only the modes that play by them: the bootstrap only the summary, a beam key beam_search
    original_eval = dict(config["eval"])
    config["eval"].update(bootstrap_samples=150, beam_width=1)
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(config))
    assert planned_rules(snakemake(workdir, "-n").stdout) == {"beam_search", "eval_summary", "eval_report_figures",
                                                              "all"}
    config["eval"] = original_eval

    # changing labels.k reruns the label shards, their gather and what follows (PRM, eval), nothing upstream
    config["labels"]["k"] = 3
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(config))
    bp_mtime = (workdir / "results/labels/branch_points.parquet").stat().st_mtime_ns
    dry_run = snakemake(workdir, "-n").stdout
    planned = planned_rules(dry_run)
    assert {"soft_labels", "gather_soft_labels", "prm_adapter", "best_of_n"} <= planned
    assert not planned & {"base_rollouts", "win_filter", "sft_adapter", "branch_points", "greedy_base", "greedy_sft"}
    snakemake(workdir, "results/labels/soft_labels.parquet")
    assert (workdir / "results/labels/branch_points.parquet").stat().st_mtime_ns == bp_mtime
    relabelled = records.read_records(workdir / "results/labels/soft_labels.parquet", records.SOFT_LABELS)
    assert {row["k"] for row in relabelled} <= {0, 3}

    # the RL stage and its eval mode; changing rl.* reruns only them and what reads their outputs
    rl_metrics_path = workdir / "results/rl/metrics.json"
    rl_metrics = json.loads(rl_metrics_path.read_text())
    assert rl_metrics["status"] == "trained" and len(rl_metrics["history"]) == rl_metrics["config"]["rl"]["steps"]
    assert (workdir / "results/rl/adapter/adapter_model.safetensors").is_file()
    assert "greedy_rl" in summary["differences"]["greedy_sft"]
    assert "rl step" in (workdir / "results/logs/rl_adapter.log").read_text()
    config["rl"] = {"lr": 1e-4}
    (workdir / "tiny.yaml").write_text(yaml.safe_dump(config))
    assert planned_rules(snakemake(workdir, "-n", "results/eval/greedy_rl.parquet").stdout) == {"rl_adapter",
                                                                                                "greedy_rl"}
    assert not planned_rules(snakemake(workdir, "-n").stdout) & {"base_rollouts", "win_filter", "sft_adapter",
                                                                 "branch_points", "greedy_base", "greedy_sft"}
    snakemake(workdir, "results/eval/greedy_rl.parquet")
    assert json.loads(rl_metrics_path.read_text())["config"]["rl"]["lr"] == 1e-4
