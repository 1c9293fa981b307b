"""The Snakemake workflow end to end on the tiny model, in a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import json

import pytest
import yaml

from clemprm import records

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
    }


def write_extra_interactions(path: Path) -> None:
    """A playpen-data interactions export: 4 instances of one won dialogue (and one lost row, filtered out)."""
    rows = [{"messages": [{"role": "user", "content": f"Guess a number from 1 to 10. (game {i})"},
                          {"role": "assistant", "content": "GUESS: 5"}],
             "meta": {"game": "extra", "experiment": "e", "task_id": i, "player_name": "Player 1",
                      "game_role": "Guesser", "model": "m", "outcome": "success" if i < 4 else "lose"}}
            for i in range(5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(SNAKEMAKE + ["--directory", str(workdir), "--configfile", str(workdir / "tiny.yaml"),
                                         *args], capture_output=True, text=True, timeout=900,
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
    for rule in ("base_rollouts", "win_filter", "sft_adapter", "all"):
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
    for name in ("base_rollouts", "win_filter", "sft_adapter"):
        assert "rule " in (workdir / f"results/logs/{name}.log").read_text()
        assert (workdir / f"results/benchmarks/{name}.tsv").exists()
    assert "episodes done" in (workdir / "results/logs/base_rollouts.log").read_text()
    assert "sft step" in (workdir / "results/logs/sft_adapter.log").read_text()

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
