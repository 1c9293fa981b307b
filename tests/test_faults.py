"""Faults inside real Snakemake jobs of the tiny pipeline (issue 64 part 2).

Each test runs real jobs in a copy of one small uninterrupted run (:func:`template`, up to the PRM's predictions) and
breaks them for real: SIGKILL of the process group that holds Snakemake and its job (what a crashed node or a killed
terminal does) at a point read from the job's log or its checkpoint folder, then ``--rerun-incomplete``; a file size
limit (``RLIMIT_FSIZE``, SIGXFSZ ignored, so a write past it fails with EFBIG as on a full disk) on Snakemake and its
job; a second Snakemake in the folder while the first holds its lock; clembench games that raise in the middle of an
episode or have an experiment without instances, played in ``base_rollouts`` and an eval mode.

Covered elsewhere: a game raising at set-up in ``base_rollouts`` and every eval mode (broken_setup on the session's
completed run: tests/test_clembench.py's test_the_tiny_pipeline_end_to_end_on_clembench_games), a game whose code
raises at import (test_a_game_whose_code_raises_at_import_is_named_with_its_file_and_line), a shard killed in a plain
process or under torchrun (tests/test_labels.py), and a shard requeued by SLURM (tests/slurm/test_slurm_pipeline.py).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from clemprm import records
from clemprm.config import deep_merge
from tests import test_workflow as workflow
from tests.test_clembench import instances, spec, write_game
from tests.test_labels import same_rows

SHARD = "results/labels/shards/0-of-1.parquet"


def template_config(cache_dir: str) -> dict:
    """The tiny workflow config cut to two built-in games, one label shard, and trainings long enough (a step is
    about 0.1 s) that a kill lands in the middle: SFT and the PRM evaluate and checkpoint every epoch (no early stop),
    the shard checkpoints every state (K=16 continuations each)."""
    return deep_merge(workflow.tiny_workflow_config(cache_dir), {
        "games": {"builtin": ["guessnumber", "oddoneout"], "clembench_games": [], "clembench_path": None,
                  "instance_list": None, "max_instances": {"train": 2, "validation": 1, "test": 1}},
        "sft": {"epochs": 40, "validation_fraction": 0.25, "early_stopping_patience": 100},
        "labels": {"k": 16, "shards": 1, "checkpoint_every": 1},
        "prm": {"epochs": 20, "early_stopping_patience": 100},
        "eval": {"modes": ["greedy_base"]}, "merge": {"adapters": []}, "rl": {"algorithms": []},
    })


@pytest.fixture(scope="module")
def template(tmp_path_factory, test_cache_dir) -> Path:
    """One uninterrupted run of :func:`template_config` up to the PRM's predictions: the records a killed and rerun
    job must equal, and the folder each test copies."""
    work = tmp_path_factory.mktemp("template")
    (work / "tiny.yaml").write_text(yaml.safe_dump(template_config(test_cache_dir)))
    workflow.write_extra_interactions(work / "extra.jsonl")
    workflow.snakemake(work, "results/prm/predictions.parquet")
    return work


def copy_of(template: Path, destination: Path) -> Path:
    shutil.copytree(template, destination, symlinks=True)   # mtimes and Snakemake's metadata kept: up to date
    return destination


def start(work: Path, *args: str, preexec_fn=None) -> subprocess.Popen:
    """Snakemake in ``work`` as the leader of a process group of its own (its jobs run in it), console to
    ``work/console.txt``."""
    console = open(work / "console.txt", "w")
    return subprocess.Popen(workflow.SNAKEMAKE + [*args, "--directory", str(work), "--configfile",
                                                   str(work / "tiny.yaml")],
                            stdout=console, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=preexec_fn, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def kill_when(process: subprocess.Popen, reached, what: str, timeout: float = 300) -> None:
    """SIGKILL Snakemake's process group (Snakemake and its running job) as soon as ``reached()`` holds; fails when
    the run ends first."""
    deadline = time.monotonic() + timeout
    while not reached():
        if process.poll() is not None:
            pytest.fail(f"the run ended (rc {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"no {what} in {timeout} s")
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    for _ in range(500):   # the job, orphaned, dies a moment later
        if not group_alive(process.pid):
            return
        time.sleep(0.02)
    pytest.fail(f"processes {group_alive(process.pid)} of the killed group survived")


def console(work: Path) -> str:
    return (work / "console.txt").read_text()


def log_steps(log: Path, stage: str) -> list[tuple[int, int]]:
    """The ``<stage> step i/n`` progress lines of a rule log so far."""
    text = log.read_text() if log.exists() else ""
    return [(int(i), int(n)) for i, n in re.findall(rf"{stage} step (\d+)/(\d+)", text)]


def replanned_after_unlock(work: Path, target: str, rule: str) -> None:
    """After the kill: the killed Snakemake's lock is left, and a run is refused until ``--unlock`` (Snakemake's
    message says so); then a dry run plans the killed job again: none of its outputs is taken as complete."""
    done = workflow.snakemake(work, target, check=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "Directory cannot be locked" in out and "--unlock" in out, out[-3000:]
    workflow.snakemake(work, "--unlock", target)
    assert rule in workflow.planned_rules(workflow.snakemake(work, "-n", target).stdout)


def scratch_left(folder: Path) -> list[str]:
    """Hidden scratch folders and temporary files a write leaves beside its outputs (``.<name>.tmp-*``)."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob(".*.tmp-*"))


def same_adapter(a: Path, b: Path) -> bool:
    one, other = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    return one.keys() == other.keys() and all(one[key].equal(other[key]) for key in one)


# ------------------------------------------------------------------------------ SIGKILL, then --rerun-incomplete


@pytest.mark.parametrize("rule, stage, outputs, records_file", [
    ("sft_adapter", "sft", ("results/sft/adapter", "results/sft/metrics.json"), None),
    ("prm_adapter", "prm", ("results/prm/adapter", "results/prm/predictions.parquet"),
     "results/prm/predictions.parquet"),
])
def test_a_training_killed_mid_way_is_rerun_whole_to_the_uninterrupted_result(template, tmp_path, rule, stage,
                                                                              outputs, records_file):
    """Killed after a few of its optimizer steps, the training leaves no output a run takes as complete; the rerun
    with --rerun-incomplete trains again to the adapter (and predictions) of the uninterrupted run."""
    work = copy_of(template, tmp_path / "run")
    log = work / f"results/logs/{rule}.log"
    log.unlink()
    target = outputs[-1]
    run = start(work, "--forcerun", rule, target)
    kill_when(run, lambda: any(i >= 3 for i, _ in log_steps(log, stage)), f"{stage} step 3 in {log}")
    steps = log_steps(log, stage)
    assert steps and steps[-1][0] < steps[-1][1], steps   # killed mid-way, not after the last step
    assert not any((work / output).exists() for output in outputs), "a killed training left an output in place"

    replanned_after_unlock(work, target, rule)
    workflow.snakemake(work, "--rerun-incomplete", target)
    for output in outputs:
        assert (work / output).exists(), output
    assert same_adapter(work / outputs[0], template / outputs[0])
    if records_file:
        assert same_rows(records.read_records(work / records_file), records.read_records(template / records_file))
    else:
        ran, made = (json.loads((folder / outputs[1]).read_text()) for folder in (work, template))
        assert (ran["steps"], ran["history"]) == (made["steps"], made["history"])
    # the killed job's scratch folder (its checkpoints) is not left beside the outputs
    assert scratch_left(work / "results") == []


def test_a_label_shard_killed_mid_way_resumes_from_its_last_chunk(template, tmp_path):
    """Killed after its first checkpointed chunks, the shard's output is absent and the job is planned again; the rerun
    with --rerun-incomplete labels only what the checkpoint lacks, to the records of the uninterrupted run."""
    work = copy_of(template, tmp_path / "run")
    log = work / "results/logs/soft_labels/0-of-1.log"
    log.unlink()
    checkpoint = work / f"{SHARD}.ckpt"
    run = start(work, "--forcerun", "soft_labels", SHARD)
    kill_when(run, lambda: len(list(checkpoint.glob("part-*.parquet"))) >= 2, f"two checkpoint parts in {checkpoint}")
    parts = sorted(checkpoint.glob("part-*.parquet"))
    done = sum(len(records.read_records(part)) for part in parts)
    total = len(records.read_records(work / "results/labels/branch_points.parquet"))
    assert not (work / SHARD).exists() and 0 < done < total, (done, total)

    replanned_after_unlock(work, SHARD, "soft_labels")
    workflow.snakemake(work, "--rerun-incomplete", SHARD)
    assert f"{total} branch points, {done} done in the checkpoint, {total - done} to label" in log.read_text()
    assert not checkpoint.exists()
    assert same_rows(records.read_records(work / SHARD), records.read_records(template / SHARD))


# ------------------------------------------------------------------------------ a full disk


def file_size_limit(limit: int):
    """A preexec_fn: files of at most ``limit`` bytes, a write past it failing with EFBIG (SIGXFSZ ignored, which
    the exec'd Snakemake and its jobs inherit) as on a full disk."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


# above every log, metadata file and job script Snakemake writes (the script holds the config: about 11 kB), below
# the record or adapter file the job writes last
LIMIT = 16 * 1024


@pytest.mark.parametrize("rule, target, written", [
    ("soft_labels", SHARD, SHARD),                                              # a parquet record file (~50 kB)
    ("sft_adapter", "results/sft/metrics.json", "results/sft/adapter"),         # an adapter (~300 kB safetensors)
])
def test_a_write_that_fails_for_lack_of_space_names_the_file_and_leaves_no_whole_looking_file(template, tmp_path,
                                                                                             rule, target, written):
    work = copy_of(template, tmp_path / "run")
    assert sum(f.stat().st_size for f in (template / written).rglob("*") if f.is_file()) \
        + (template / written).stat().st_size * (template / written).is_file() > LIMIT
    run = start(work, "--forcerun", rule, target, preexec_fn=file_size_limit(LIMIT))
    assert run.wait(timeout=600) != 0
    out = console(work)
    log = (work / f"results/logs/{rule}{'/0-of-1' if rule == 'soft_labels' else ''}.log").read_text()
    assert "File too large" in out + log, out[-3000:]
    # the error names the file the job could not write
    failed = next(line for line in (out + log).splitlines() if "File too large" in line)
    assert written in failed, failed
    # nothing a later rule would read as whole: the output is gone (Snakemake removes a failed job's outputs), no
    # temporary file is left, and a dry run plans the job again
    assert not (work / written).exists()
    assert scratch_left(work / "results") == []
    dry_run = workflow.snakemake(work, "-n", target)
    assert rule in workflow.planned_rules(dry_run.stdout)


# ------------------------------------------------------------------------------ two runs at once


def test_a_second_run_in_the_folder_is_refused_while_the_first_holds_the_lock(template, tmp_path):
    work = copy_of(template, tmp_path / "run")
    log = work / "results/logs/soft_labels/0-of-1.log"
    log.unlink()
    first = start(work, "--forcerun", "soft_labels", SHARD)
    deadline = time.monotonic() + 120
    while not log.exists():   # the first run is in its job: its lock is held
        assert first.poll() is None and time.monotonic() < deadline, console(work)[-3000:]
        time.sleep(0.05)
    second = subprocess.run(workflow.SNAKEMAKE + ["--forcerun", "soft_labels", SHARD, "--directory", str(work),
                                                  "--configfile", str(work / "tiny.yaml")],
                            capture_output=True, text=True, timeout=300)
    assert first.poll() is None, "the first run ended before the second one was refused"
    out = second.stdout + second.stderr
    assert second.returncode != 0 and "Directory cannot be locked" in out, out[-3000:]
    assert first.wait(timeout=600) == 0, console(work)[-3000:]   # the first run is not disturbed
    assert same_rows(records.read_records(work / SHARD), records.read_records(template / SHARD))


# ------------------------------------------------------------------------------ games that break in a real job


# Fixture (tests/test_clembench.py's game master) raising at its second answer of an odd game id: the episode has a
# turn, then the game's own code fails
RAISES_MID_EPISODE = '''
    _fixture_setup = _on_setup
    _fixture_valid_response = _on_valid_player_response

    def _on_setup(self, **instance):
        self.fails_mid_way = instance["game_id"] % 2 == 1
        self._fixture_setup(**instance)

    def _on_valid_player_response(self, player, response):
        if self.fails_mid_way and self.state.round == 1:
            raise RuntimeError("fixture mid-episode bug")
        self._fixture_valid_response(player, response)
'''


def games_workdir(work: Path, cache_dir: str, games: dict[str, dict]) -> Path:
    """A working directory playing the clembench games ``games`` (name -> its instances file) and no built-in game,
    under the default on_failure: stop; the instance list puts game ids 0-1 in train, 2-3 in validation."""
    checkout = work / "clembench"
    for name, instances_file in games.items():
        write_game(checkout / name, spec(name), partial=RAISES_MID_EPISODE if name == "midway" else "",
                   instance_files={"instances": instances_file})
    rows = [(name, experiment["name"], instance["game_id"], "train" if instance["game_id"] < 2 else "validation")
            for name, instances_file in games.items() for experiment in instances_file["experiments"]
            for instance in experiment["game_instances"]]
    (work / "instances.csv").write_text("game,experiment,task_id,split\n"
                                        + "".join(",".join(map(str, row)) + "\n" for row in rows))
    config = deep_merge(workflow.tiny_workflow_config(cache_dir), {
        "on_failure": "stop",
        "games": {"builtin": [], "clembench_path": "clembench", "clembench_games": list(games),
                  "instance_list": "instances.csv", "max_instances": {"train": 2, "validation": 2, "test": 1}},
        "base_rollouts": {"episodes_per_instance": 1},
        "eval": {"modes": ["greedy_base"]}, "merge": {"adapters": []}, "rl": {"algorithms": []},
    })
    (work / "tiny.yaml").write_text(yaml.safe_dump(config))
    workflow.write_extra_interactions(work / config["sft"]["extra_data"])
    return work


def test_a_game_raising_mid_episode_records_the_error_and_the_other_episodes_go_on(tmp_path, test_cache_dir):
    """midway raises at the second answer of its odd game ids; hollow has an experiment with no instance beside one
    with instances. In base_rollouts and in eval mode greedy_base (on_failure: stop): each failed episode is there
    with its turn and its error, counted as aborted (no score); every other episode played; the summary counts the
    errors."""
    with_empty = instances({"e": 4})
    with_empty["experiments"].append({"name": "empty", "game_instances": []})
    work = games_workdir(tmp_path, test_cache_dir, {"midway": instances({"e": 4}), "hollow": with_empty})
    workflow.snakemake(work, "results/rollouts/base_train.parquet", "results/prm_eval.json")
    for path, split in (("results/rollouts/base_train.parquet", "train"), ("results/eval/greedy_base.parquet",
                                                                          "validation")):
        rows = records.read_records(work / path)
        ids = (0, 1) if split == "train" else (2, 3)
        assert sorted((row["game"], row["experiment"], row["game_id"]) for row in rows) == [
            (game, "e", i) for game in ("hollow", "midway") for i in ids], path
        for row in rows:
            failed = row["game"] == "midway" and row["game_id"] % 2 == 1
            if failed:
                assert "RuntimeError: fixture mid-episode bug" in row["error"], row["error"]
                assert row["aborted"] and not row["success"] and row["bench_score"] != row["bench_score"]   # NaN
                assert row["n_turns"] >= 1 and len(row["turns"]) >= 1, row   # the turn before the fault is kept
            else:
                assert row["error"] is None, (path, row["episode_id"], row["error"])
    summary = json.loads((work / "results/prm_eval.json").read_text())
    results = summary["modes"]["greedy_base"]["results"]
    assert (results["midway"]["errors"], results["midway"]["episodes"], results["hollow"]["errors"]) == (1, 2, 0)
    assert "fixture mid-episode bug" in results["midway"]["first_error"]


def test_a_game_whose_experiments_hold_no_instance_is_refused_before_any_job(tmp_path, test_cache_dir):
    """A game whose only experiment has no instance: refused when the Snakefile is parsed, naming the game and its
    instances file, before any job starts."""
    work = games_workdir(tmp_path, test_cache_dir, {"midway": instances({"e": 4}),
                                                    "hollow": {"experiments": [{"name": "empty",
                                                                                "game_instances": []}]}})
    done = workflow.snakemake(work, "results/rollouts/base_train.parquet", check=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert "game 'hollow': instances file " in out and "clembench/hollow/in/instances.json holds no instance" in out, \
        out[-3000:]
    assert "rule base_rollouts" not in out and not (work / "results").exists(), out[-3000:]
