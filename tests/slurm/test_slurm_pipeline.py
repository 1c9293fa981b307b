"""The tiny pipeline through `snakemake --profile slurm` on a real single-node SLURM cluster.

The profile is profiles/slurm with only the cluster-specific values swapped (tests/slurm/profiles.py), installed
by scripts/install_profile.sh and named exactly as users type it. The SLURM run makes the soft labels, the PRM and one
search's eval again on a copy of the session's one full run of the DAG (the local one, tests/conftest.py's
completed_run): every kind of job, a sharded GPU rule, a CPU rule, training and a GPU rule in two processes (what comes
before them is the local run's; every rule's SLURM resources are checked by tests/slurm/test_profile.py). Checks:
every job of those targets ran as a SLURM job, the GPU rules asked SLURM for a GPU (sbatch line and scontrol), the
records equal those of the local run of the same config, a failing
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
# what the SLURM run makes again on a copy of the local run: the label shards and their gathering, the PRM, its
# metrics and best_of_n's eval (the SFT policy searching with the PRM, in 2 processes). One output of each of those
# jobs is removed (Snakemake removes a job's other outputs before it runs); the jobs before them are up to date.
SLURM_TARGETS = ("results/prm/metrics.json", "results/eval/best_of_n.parquet")
SLURM_RULES = {"soft_labels": 2, "gather_soft_labels": 1, "gather_answers": 1, "prm_adapter": 1, "prm_metrics": 1,
               "eval_mode": 1}
SLURM_REMOVED = ("results/labels/shards/0-of-2.parquet", "results/labels/shards/1-of-2.parquet",
                 "results/labels/soft_labels.parquet", *SLURM_TARGETS)
JOB = re.compile(r"^(?:local)?rule (\w+):", flags=re.MULTILINE)   # a job's block in a dry run
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: (\S+)\)")
SBATCH = re.compile(r"sbatch call: (sbatch .*)")
FINISHED = re.compile(r"Finished jobid: \d+ \(Rule: (\w+)\)")
# snakemake, its SLURM status checks at most a few seconds apart (tests/slurm/snakemake_polling.py says why)
SNAKEMAKE = [sys.executable, str(Path(__file__).with_name("snakemake_polling.py"))]


def _artifacts() -> Path | None:
    path = os.environ.get("CLEMPRM_SLURM_ARTIFACTS")
    if not path:
        return None
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def _snakemake(workdir: Path, *args: str, env: dict, limit_s: int = RUN_LIMIT_S):
    command = ["timeout", "-k", "20", str(limit_s), *SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"),
               "--directory", str(workdir), "--configfile", str(workdir / "tiny.yaml"), *args]
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
    # eval_mode in 2 processes (torchrun inside its one job, gloo on this CPU): what a 2-GPU entry would ask for
    profile = load_profile()
    profile["set-resources"]["eval_mode"] = {**profile["set-resources"]["eval_mode"], "processes": 2}
    derive_test_profile(root / "slurm-test", partition=slurm_cluster.partition, profile=profile)
    env = {**slurm_cluster.env, "XDG_CONFIG_HOME": str(root / "xdg"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    install = subprocess.run(["bash", str(REPO / "scripts/install_profile.sh"), "--profile",
                              str(root / "slurm-test")], env=env, capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    return env


@pytest.fixture(scope="module")
def runs(slurm_cluster, slurm_profile, tmp_path_factory, completed_run):
    """The same tiny config run locally (-c2: the session's completed run, shared with tests/test_workflow.py) and,
    from its win-filtered SFT policy and branch points on, on SLURM (`--profile slurm`)."""
    root = tmp_path_factory.mktemp("runs")
    local, local_output, local_s = completed_run.workdir, completed_run.output, completed_run.seconds

    slurm = copy_of_run(completed_run, root / "slurm")
    config = yaml.safe_load((slurm / "tiny.yaml").read_text())
    config["cache_dir"] = str(root / "cache-slurm")   # not a rerun trigger: the jobs build the tiny model there
    (slurm / "tiny.yaml").write_text(yaml.safe_dump(config))
    for path in SLURM_REMOVED:
        (slurm / path).unlink()
    code, dry_run, _ = _snakemake(slurm, "-n", "--cores", "1", *SLURM_TARGETS, env=slurm_profile)
    assert code == 0, dry_run[-6000:]
    assert collections.Counter(JOB.findall(dry_run)) == SLURM_RULES, dry_run[-6000:]
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
            "planned": collections.Counter(JOB.findall(dry_run)), "remade": workflow_test.planned_outputs(dry_run),
            "submissions": submissions, "cache": root / "cache-slurm"}


def test_every_job_ran_as_a_slurm_job(runs, slurm_cluster):
    planned = runs["planned"]
    assert set(FINISHED.findall(runs["output"])) == set(planned)
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
    assert {"soft_labels", "prm_adapter", "eval_mode"} <= wanted & submitted
    assert "gather_soft_labels" in submitted - wanted
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


def _first_difference(a, b, where: str = "") -> str | None:
    """Where two records differ, or None. Floats agree to 1e-5 relative (NaN equals NaN): the eval job scores in two
    processes, and a batch of another size rounds a PRM score differently in the last float32 bit."""
    if isinstance(a, float) and isinstance(b, float):
        return None if (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) \
            else f"{where}: {a!r} != {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(a)} != {sorted(b)}"
        return next(filter(None, (_first_difference(a[k], b[k], f"{where}.{k}") for k in a)), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} != {len(b)} items"
        return next(filter(None, (_first_difference(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))),
                    None)
    return None if a == b else f"{where}: {a!r} != {b!r}"


def _remade_files(workdir: Path, outputs: set[str]) -> set[str]:
    """The files of the jobs' outputs (a folder's files), relative to results/."""
    files = {path for output in outputs for path in [workdir / output, *(workdir / output).rglob("*")]
             if path.is_file()}
    return {str(path.relative_to(workdir / "results")) for path in files}


def test_records_equal_those_of_a_local_run(runs):
    local, slurm = runs["local"] / "results", runs["slurm"] / "results"
    files = _remade_files(runs["slurm"], runs["remade"])
    assert files <= {str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()}
    parquets = sorted(f for f in files if f.endswith(".parquet"))
    assert {"labels/shards/0-of-2.parquet", "labels/soft_labels.parquet", "eval/best_of_n.parquet"} <= set(parquets)
    for name in parquets:   # the job rewrote it (here since the SLURM run began)
        assert (slurm / name).stat().st_mtime > (local / name).stat().st_mtime, name
    for name in parquets:
        a, b = pq.read_table(local / name), pq.read_table(slurm / name)
        assert a.schema.remove_metadata() == b.schema.remove_metadata(), name
        assert _first_difference(a.to_pylist(), b.to_pylist(), name) is None
    for name in sorted(f for f in files if f.endswith(".safetensors")):  # adapters: same training, same weights
        from safetensors.numpy import load_file
        a, b = load_file(local / name), load_file(slurm / name)
        assert a.keys() == b.keys(), name
        for key in a:
            assert a[key].shape == b[key].shape and math.isclose(
                float(abs(a[key] - b[key]).max(initial=0.0)), 0.0, abs_tol=1e-6), (name, key)


def test_a_rule_given_two_processes_runs_them_in_its_one_job(runs):
    """eval_mode with `processes: 2` in the profile: one SLURM job whose rule log shows both ranks; its records
    equal the local one-process run's (test_records_equal_those_of_a_local_run)."""
    assert [s["rule"] for s in runs["submissions"]].count("eval_mode") == 1
    log = (runs["slurm"] / "results/logs/eval/best_of_n.log").read_text()
    assert "starting 2 processes" in log
    assert "rank 0/2 INFO clemprm.evaluation.evaluate: eval best_of_n:" in log
    assert "rank 1/2 INFO clemprm.evaluation.evaluate: eval best_of_n:" in log


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
    command = ["timeout", "-k", "20", str(RUN_LIMIT_S), *SNAKEMAKE, "--snakefile", str(REPO / "Snakefile"),
               "--directory", str(work), "--configfile", str(work / "tiny.yaml"), "--profile", "slurm",
               "--slurm-requeue", target]
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

    resumed_rows = pq.read_table(work / target).to_pylist()
    code, output, _ = _snakemake(work, "--cores", "2", "--forcerun", target, "--", target,
                                 env=local_env)  # the same shard, uninterrupted
    assert code == 0, output[-6000:]
    assert _first_difference(pq.read_table(work / target).to_pylist(), resumed_rows, target) is None
