"""The tiny pipeline through `snakemake --profile slurm` on a real single-node SLURM cluster.

The profile is profiles/slurm with only the cluster-specific values swapped (tests/slurm/profiles.py), installed
by scripts/install_profile.sh and named exactly as users type it. The SLURM run makes the PRM and one search's eval
(SLURM_TARGETS: every kind of job, a GPU rule in two processes, a sharded rule, training, a CPU rule; the session's
one full run of the DAG is the local one, tests/conftest.py's completed_run, and every rule's SLURM resources are
checked by tests/slurm/test_profile.py). Checks: every job of those targets ran as a SLURM job, the GPU rules asked
SLURM for a GPU (sbatch line and scontrol), the records equal those of the local run of the same config, a failing
job is reported as failed (bounded by `timeout -k`, never a hang), and with `slurm-requeue` a label shard requeued
mid-way is waited for and resumes from its checkpoint to the records of an uninterrupted run.

Set CLEMPRM_SLURM_ARTIFACTS=DIR to keep the sbatch lines, wall times and snakemake output there.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests import test_workflow as workflow_test
from tests.conftest import copy_of_run
from tests.slurm.profiles import REPO, derive_test_profile, gpu_rules, load_profile

# one snakemake run (the whole tiny pipeline through SLURM: minutes on 2 cores, more on a loaded machine); `timeout -k`
# ends it, so a hang fails the test instead of blocking CI
RUN_LIMIT_S = 900

# the session's local run and the SLURM run are this module's set-up: more than pytest's default 900 s on a loaded
# machine (each snakemake run is bounded by RUN_LIMIT_S)
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(2 * RUN_LIMIT_S + 600)]
# what the SLURM run makes: the PRM (base rollouts in 2 processes, win filter, SFT, branch points, the label shards
# and their gathering) and best_of_n's eval (the SFT policy searching with the PRM)
SLURM_TARGETS = ("results/prm/metrics.json", "results/eval/best_of_n.parquet")
JOB = re.compile(r"^(?:local)?rule (\w+):", flags=re.MULTILINE)   # a job's block in a dry run
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)")
SBATCH = re.compile(r"sbatch call: (sbatch .*)")
FINISHED = re.compile(r"Finished jobid: \d+ \(Rule: (\w+)\)")
NOT_RECORDS = ("logs", "benchmarks")  # per-run files: timings, host names


def _artifacts() -> Path | None:
    path = os.environ.get("CLEMPRM_SLURM_ARTIFACTS")
    if not path:
        return None
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def _snakemake(workdir: Path, *args: str, env: dict, limit_s: int = RUN_LIMIT_S):
    command = ["timeout", "-k", "20", str(limit_s), sys.executable, "-m", "snakemake",
               "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(workdir / "tiny.yaml"), *args]
    start = time.monotonic()
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    output = result.stdout + "\n" + result.stderr
    if result.returncode in (124, 137):
        pytest.fail(f"snakemake {' '.join(args)} hung: killed after {limit_s} s\n{output[-6000:]}")
    return result.returncode, output, elapsed


def _workdir(path: Path, cache_dir: Path, **overrides) -> Path:
    path.mkdir(parents=True)
    # the workflow test's tiny config, as it is, and the same input files (extra data, clembench games, instance list)
    workflow_test.prepare_workdir(path, str(cache_dir))
    config = yaml.safe_load((path / "tiny.yaml").read_text())
    for key, value in overrides.items():
        config.setdefault(key, {}).update(value)
    (path / "tiny.yaml").write_text(yaml.safe_dump(config))
    return path


def _submissions(output: str) -> list[dict]:
    """Each SLURM submission: snakemake job id, SLURM job id, rule (from the log path), sbatch line."""
    sbatch_lines = SBATCH.findall(output)
    found, seen = [], {}
    for job, slurm_id, log in SUBMITTED.findall(output):
        rule = re.search(r"/rule_(\w+)/", log).group(1)
        folder = log.rsplit("/", 1)[0]  # .snakemake/slurm_logs/rule_<rule>[/<wildcards>]: one per job of a rule
        lines = [line for line in sbatch_lines if f"--output {folder}/%j.log " in line]
        index = seen[folder] = seen.get(folder, -1) + 1  # the k-th submission of a job is its k-th sbatch call
        found.append({"job": job, "slurm_id": slurm_id, "rule": rule, "log": log,
                      "sbatch": lines[index] if index < len(lines) else ""})
    return found


@pytest.fixture(scope="module")
def slurm_profile(slurm_cluster, tmp_path_factory):
    """The derived test profile, installed as `slurm` in a private XDG config folder; the env to use it."""
    root = tmp_path_factory.mktemp("profile")
    # base_rollouts in 2 processes (torchrun inside its one job, gloo on this CPU): what a 2-GPU entry would ask for
    profile = load_profile()
    profile["set-resources"]["base_rollouts"] = {**profile["set-resources"]["base_rollouts"], "processes": 2}
    derive_test_profile(root / "slurm-test", partition=slurm_cluster.partition, profile=profile)
    env = {**slurm_cluster.env, "XDG_CONFIG_HOME": str(root / "xdg"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    install = subprocess.run(["bash", str(REPO / "scripts/install_profile.sh"), "--profile",
                              str(root / "slurm-test")], env=env, capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    return env


@pytest.fixture(scope="module")
def runs(slurm_cluster, slurm_profile, tmp_path_factory, completed_run):
    """The same tiny config run locally (-c2: the session's completed run, shared with tests/test_workflow.py) and
    on SLURM (`--profile slurm`)."""
    root = tmp_path_factory.mktemp("runs")
    local, local_output, local_s = completed_run.workdir, completed_run.output, completed_run.seconds

    slurm = _workdir(root / "slurm", root / "cache-slurm")
    code, dry_run, _ = _snakemake(slurm, "-n", "--cores", "1", *SLURM_TARGETS, env=slurm_profile)
    assert code == 0, dry_run[-6000:]
    code, output, slurm_s = _snakemake(slurm, "--profile", "slurm", *SLURM_TARGETS, env=slurm_profile)
    assert code == 0, output[-8000:] + "\n" + slurm_cluster.logs()
    submissions = _submissions(output)
    artifacts = _artifacts()
    if artifacts:
        (artifacts / "slurm_run_output.txt").write_text(output)
        (artifacts / "sbatch_lines.txt").write_text("\n\n".join(
            f"# rule {s['rule']} (SLURM job {s['slurm_id']})\n" + s["sbatch"] for s in submissions))
        (artifacts / "timing.json").write_text(json.dumps({"local_run_s": round(local_s, 1),
                                                           "slurm_run_s": round(slurm_s, 1)}))
    print(f"\n[slurm] local run {local_s:.1f} s, SLURM run {slurm_s:.1f} s")
    for s in submissions:
        print(f"[slurm] {s['rule']}: {s['sbatch'] or '(no sbatch line)'}")
    return {"local": local, "local_output": local_output, "slurm": slurm, "output": output,
            "planned": collections.Counter(JOB.findall(dry_run)), "submissions": submissions,
            "cache": root / "cache-slurm"}


def test_every_job_ran_as_a_slurm_job(runs, slurm_cluster):
    planned = runs["planned"]
    assert set(FINISHED.findall(runs["output"])) == set(planned)
    assert {"base_rollouts", "sft_adapter", "soft_labels", "prm_adapter", "eval_mode"} <= set(planned)
    # every planned job once as a SLURM job (a job per label shard); the local run ran each of them too
    submitted = collections.Counter(s["rule"] for s in runs["submissions"])
    assert submitted == planned
    assert planned["soft_labels"] == workflow_test.tiny_workflow_config("")["labels"]["shards"]
    assert set(planned) <= set(FINISHED.findall(runs["local_output"]))
    for s in runs["submissions"]:
        info = slurm_cluster.job_info(s["slurm_id"])
        assert info["JobState"] == "COMPLETED", info["_text"]
        assert info["Comment"].startswith(f"rule_{s['rule']}")  # + "_wildcards_<values>" for a label shard
        assert info["Partition"] == slurm_cluster.partition
        assert Path(s["log"]).is_file()  # the job's SLURM log (kept by the test profile)
        assert s["sbatch"].startswith("sbatch "), s


def test_gpu_rules_request_a_gpu_and_cpu_rules_do_not(runs, slurm_cluster):
    wanted = gpu_rules(load_profile())
    submitted = {s["rule"] for s in runs["submissions"]}
    assert {"base_rollouts"} <= wanted & submitted
    for s in runs["submissions"]:
        line = s["sbatch"]
        info = slurm_cluster.job_info(s["slurm_id"])
        if s["rule"] in wanted:
            assert "--gpus=1" in line, line
            assert re.search(r"gres[/:]gpu[:=]1", info.get("TresPerJob", "")), info["_text"]
            assert info.get("JOB_GRES", "").startswith("gpu:1"), info["_text"]  # SLURM allocated the device
        else:
            assert "--gpus" not in line and "--gres" not in line, line
            assert "gpu" not in info.get("TresPerJob", "(null)"), info["_text"]
        assert f"-p {slurm_cluster.partition}" in line


def _normalized_rows(path: Path) -> str:
    # JSON text: NaN (bench_score of aborted episodes) compares equal to NaN
    return json.dumps(pq.read_table(path).to_pylist(), sort_keys=True, default=str)


def _record_files(results: Path) -> set[str]:
    return {str(p.relative_to(results)) for p in results.rglob("*")
            if p.is_file() and p.relative_to(results).parts[0] not in NOT_RECORDS}


def test_records_equal_those_of_a_local_run(runs):
    local, slurm = runs["local"] / "results", runs["slurm"] / "results"
    files = _record_files(slurm)
    assert files <= _record_files(local)
    parquets = sorted(f for f in files if f.endswith(".parquet"))
    assert {"rollouts/base_train.parquet", "labels/soft_labels.parquet", "eval/best_of_n.parquet"} <= set(parquets)
    for name in parquets:
        a, b = pq.read_table(local / name), pq.read_table(slurm / name)
        assert a.schema.remove_metadata() == b.schema.remove_metadata(), name
        assert a.num_rows == b.num_rows and _normalized_rows(local / name) == _normalized_rows(slurm / name), name
    for name in sorted(f for f in files if f.endswith(".safetensors")):  # adapters: same training, same weights
        from safetensors.numpy import load_file
        a, b = load_file(local / name), load_file(slurm / name)
        assert a.keys() == b.keys(), name
        for key in a:
            assert a[key].shape == b[key].shape and math.isclose(
                float(abs(a[key] - b[key]).max(initial=0.0)), 0.0, abs_tol=1e-6), (name, key)


def test_a_rule_given_two_processes_runs_them_in_its_one_job(runs):
    """base_rollouts with `processes: 2` in the profile: one SLURM job whose rule log shows both ranks; its records
    equal the local one-process run's (test_records_equal_those_of_a_local_run)."""
    assert [s["rule"] for s in runs["submissions"]].count("base_rollouts") == 1
    log = (runs["slurm"] / "results/logs/base_rollouts.log").read_text()
    assert "starting 2 processes" in log
    assert "rank 0/2 INFO clemprm.stages.rollouts: base rollouts:" in log
    assert "rank 1/2 INFO clemprm.stages.rollouts: base rollouts:" in log


def test_jobs_use_the_configured_model_cache_not_results(runs):
    assert any(p.is_file() for p in runs["cache"].rglob("*")), "the SLURM jobs did not use cache_dir"
    model_files = {"model.safetensors", "tokenizer.json", "pytorch_model.bin", "config.json"}
    # results/merged/ holds the merge stage's standalone checkpoints by design; nothing else is a model
    results = runs["slurm"] / "results"
    assert not [p for p in results.rglob("*") if p.name in model_files and results / "merged" not in p.parents]


def test_a_failing_job_is_reported_failed_not_hung(slurm_cluster, slurm_profile, tmp_path):
    # a model folder with a config and a tokenizer file that hold nothing loadable: it passes the parse-time checks
    # (they look for the files) and fails in the job, when the model is loaded
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "tokenizer.json").write_text("{}")
    work = _workdir(tmp_path / "failing", tmp_path / "cache", model={"spec": str(broken)})
    start = time.monotonic()
    # only the base rollouts (greedy_base, which also loads the model, would fail too and could stop the run
    # before the retry of base_rollouts is reported)
    code, output, elapsed = _snakemake(work, "--profile", "slurm", "results/rollouts/base_train.parquet",
                                       env=slurm_profile, limit_s=300)
    assert code not in (0, 124, 137), output[-6000:]
    assert "Error in rule base_rollouts" in output, output[-6000:]
    submissions = _submissions(output)
    failed = [s for s in submissions if s["rule"] == "base_rollouts"]
    retries = load_profile().get("retries", 0)
    assert len(failed) == 1 + retries, output[-6000:]  # the profile's retries: resubmitted, failed again
    assert {s["rule"] for s in submissions} == {"base_rollouts"}   # nothing downstream was submitted
    for attempt, s in enumerate(failed, start=1):
        assert f"SLURM-job '{s['slurm_id']}' failed" in output
        assert f"--mem {1000 * attempt} " in s["sbatch"]  # the profile's `mem_mb: ... * attempt`
        assert slurm_cluster.job_info(s["slurm_id"])["JobState"] == "FAILED"
    assert "Traceback" in (work / "results/logs/base_rollouts.log").read_text()   # the job logged its error
    artifacts = _artifacts()
    if artifacts:
        (artifacts / "failing_run_output.txt").write_text(output)
    print(f"\n[slurm] failing run reported after {time.monotonic() - start:.1f} s")


def test_a_requeued_label_shard_resumes_from_its_checkpoint(slurm_cluster, slurm_profile, completed_run, tmp_path):
    """`slurm-requeue`: a label shard that SLURM requeues mid-way (as on preemption) keeps its job id, Snakemake waits
    for it, and the rerun resumes from the shard's checkpoint to the records of an uninterrupted run.

    On a copy of the session's completed run with only `labels` changed: they are the shard's own params, so the
    shard is the one job to run (a dry run says so first); nothing upstream is played or trained again."""
    work = copy_of_run(completed_run, tmp_path / "requeue")
    config = yaml.safe_load((work / "tiny.yaml").read_text())
    # one branch point per checkpointed chunk and more work per chunk: the shard is caught between two chunks
    config["labels"].update({"checkpoint_every": 1, "k": 8, "max_new_tokens": 16})
    (work / "tiny.yaml").write_text(yaml.safe_dump(config))
    target = "results/labels/shards/0-of-2.parquet"
    checkpoint = work / (target + ".ckpt")
    local_env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    code, dry_run, _ = _snakemake(work, "-n", "--cores", "1", "--", target, env=local_env)
    assert code == 0, dry_run[-6000:]
    assert workflow_test.planned_outputs(dry_run) == {target}, dry_run[-6000:]
    assert "Params have changed since last execution" in dry_run, dry_run[-6000:]
    (work / target).unlink()   # the earlier labels' shard: what exists from here on is this run's
    known = {job for job, _ in slurm_cluster.jobs()}
    command = ["timeout", "-k", "20", str(RUN_LIMIT_S), sys.executable, "-m", "snakemake", "--snakefile",
               str(REPO / "Snakefile"), "--directory", str(work), "--configfile", str(work / "tiny.yaml"),
               "--profile", "slurm", "--slurm-requeue", target]
    log = open(tmp_path / "requeue.out", "w+")
    proc = subprocess.Popen(command, cwd=work, env=slurm_profile, stdout=log, stderr=subprocess.STDOUT)
    try:
        def wait(condition, what, timeout_s=RUN_LIMIT_S, every_s=0.5):
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                found = condition()
                if found:
                    return found
                assert proc.poll() is None, f"snakemake ended while waiting for {what}"
                time.sleep(every_s)
            pytest.fail(f"timed out waiting for {what}")

        def shard_job(states):
            return next((job for job, state in slurm_cluster.jobs() if job not in known and state in states
                         and slurm_cluster.job_info(job)["Comment"].startswith("rule_soft_labels_")), None)

        job = wait(lambda: shard_job({"RUNNING"}), "the label shard to run")
        wait(lambda: (checkpoint / "part-00000.parquet").exists(), "the shard's first checkpoint", every_s=0.05)
        slurm_cluster.run("scontrol", "requeue", job)
        assert not (work / target).exists(), "the shard finished before it could be requeued"
        wait(lambda: shard_job({"PENDING"}), "the shard to be pending again")
        # SLURM holds a requeued job back for its credential lifetime (120 s); let it start at once
        slurm_cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        code = proc.wait(RUN_LIMIT_S + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.seek(0)
        output = log.read()
        log.close()
    assert code == 0, output[-6000:]
    (submission,) = _submissions(output)   # the shard alone, submitted once
    assert submission["rule"] == "soft_labels" and submission["slurm_id"] == job, output[-6000:]
    assert "--requeue" in submission["sbatch"]
    info = slurm_cluster.job_info(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info["_text"]
    # the restarted job's log (Snakemake starts a job's log afresh): it resumed from the checkpoint
    resumed = re.findall(r"(\d+) done in the checkpoint", (work / "results/logs/soft_labels/0-of-2.log").read_text())
    assert resumed and int(resumed[-1]) >= 1, resumed
    assert not checkpoint.exists()

    resumed_rows = _normalized_rows(work / target)
    code, output, _ = _snakemake(work, "--cores", "2", "--forcerun", target, "--", target,
                                 env=local_env)  # the same shard, uninterrupted
    assert code == 0, output[-6000:]
    assert _normalized_rows(work / target) == resumed_rows
