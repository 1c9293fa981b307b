"""Data parallelism (clemprm/distributed.py): a job of 2 processes (torchrun; gloo on this CPU, NCCL on GPUs) writes
the records of one process, and trains the same adapter weights at the same effective batch.

The generation stages run through Snakemake on a copy of the session's completed run (``--set-resources
<rule>:processes=2``, what a cluster profile sets), and their records are compared with the run's single-process
ones; SFT and the PRM run under torchrun directly (tests/distributed/train_job.py) at world size 1 and 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clemprm import records
from tests.conftest import copy_of_run
from tests.test_rl import forced_prompt, half_and_half_sft  # noqa: F401 (fixtures of the RL job)
from tests.test_workflow import snakemake

REPO = Path(__file__).resolve().parent.parent
GENERATION_RULES = ("base_rollouts", "branch_points", "soft_labels", "eval_mode")
# the records the generation rules write: one label shard and two eval modes (greedy, a PRM-guided search)
GENERATED = {"results/rollouts/base_train.parquet": records.EPISODES,
             "results/labels/sft_train_episodes.parquet": records.EPISODES,
             "results/labels/branch_points.parquet": records.BRANCH_POINTS,
             "results/labels/shards/0-of-2.parquet": records.SOFT_LABELS,
             "results/eval/greedy_base.parquet": records.EVAL_EPISODES,
             "results/eval/best_of_n.parquet": records.EVAL_EPISODES}
EVAL_TARGETS = ["results/eval/greedy_base.parquet", "results/eval/best_of_n.parquet"]


def two_processes(*rules: str) -> list[str]:
    return ["--set-resources", *(f"{rule}:processes=2" for rule in rules)]


def as_json(rows: list[dict]) -> list[str]:
    """Rows as JSON text, so that NaN (the bench score of an aborted episode) equals NaN."""
    return [json.dumps(row, sort_keys=True, default=str) for row in rows]


def without_search_scores(rows: list[dict]) -> tuple[list[dict], list[float]]:
    """Eval rows without their search choices' scores, and those scores: a PRM score depends on the micro-batch its
    pair was scored in up to float rounding (padding width), and each process batches its own share."""
    scores = [score for row in rows for choice in row.get("choices") or [] for score in choice["scores"]]
    stripped = [{**row, "choices": [{**choice, "scores": None} for choice in row["choices"]]} if row.get("choices")
                else row for row in rows]
    return stripped, scores


def test_generation_stages_in_two_processes_write_the_records_of_one(completed_run, tmp_path):
    work = copy_of_run(completed_run, tmp_path / "run")
    # the eval modes first (their inputs stay as they are), then the stages before them (forcing those would make
    # every later stage rerun for the eval targets)
    snakemake(work, *EVAL_TARGETS, "--forcerun", "eval_mode", *two_processes("eval_mode"))
    snakemake(work, *[path for path in GENERATED if path not in EVAL_TARGETS],
              "--forcerun", "base_rollouts", "branch_points", "soft_labels", *two_processes(*GENERATION_RULES))
    for path, schema in GENERATED.items():
        single, single_scores = without_search_scores(records.read_records(completed_run.workdir / path, schema))
        double, double_scores = without_search_scores(records.read_records(work / path, schema))
        assert len(double) == len(single) > 0, path
        assert as_json(double) == as_json(single), f"{path}: 2 processes wrote other records than 1"
        assert double_scores == pytest.approx(single_scores, abs=1e-5), path
    # the rule log (Snakemake empties it before the job) shows both ranks
    log = (work / "results/logs/base_rollouts.log").read_text()
    assert "starting 2 processes" in log and " rank 0/2 " in log and " rank 1/2 " in log
    assert "rank 1/2 INFO clemprm.stages.rollouts: base rollouts:" in log


def test_a_failing_rank_fails_the_job_with_its_error(tmp_path):
    """Rank 1 raises while rank 0 waits for it in a gather: the job fails (no hang) with rank 1's traceback in the
    rule log."""
    (tmp_path / "Snakefile").write_text(textwrap.dedent(f"""
        rule fail:
            output: "out.txt"
            log: "fail.log"
            resources: processes=2
            script: "{REPO / 'tests/distributed/failing_rank.py'}"
        """))
    (tmp_path / "config.yaml").write_text("model: {spec: \"tiny:0\"}\n")
    done = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--directory", str(tmp_path),
                           "--snakefile", str(tmp_path / "Snakefile"), "--configfile", str(tmp_path / "config.yaml")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          cwd=REPO)
    assert done.returncode != 0
    log = (tmp_path / "fail.log").read_text()
    assert "RuntimeError: rank 1 cannot play its share" in log
    assert not (tmp_path / "out.txt").exists()


def test_two_processes_build_a_model_folder_once_and_both_load_it(tmp_path):
    """An empty model cache (a fresh cluster job): rank 0 builds the tiny model's folder, rank 1 waits; a folder built
    by rank 1 would lack the weights and config, which transformers writes on rank 0 alone."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests/distributed/load_policy_job.py"), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "rank 0 loaded tiny-0" in done.stdout and "rank 1 loaded tiny-0" in done.stdout
    assert (tmp_path / "cache/models/tiny-qwen3_5-seed0-v1/config.json").is_file()


def adapter_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def trained(completed_run, tmp_path_factory, test_cache_dir) -> dict[int, Path]:
    """tests/distributed/train_job.py at world size 1 (accumulating 2 batches) and 2 (1 batch each)."""
    script, env = str(REPO / "tests/distributed/train_job.py"), {**os.environ, "HF_HUB_OFFLINE": "1",
                                                                  "OMP_NUM_THREADS": "1"}
    out = {}
    for size, launcher in ((1, []), (2, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])):
        out[size] = tmp_path_factory.mktemp(f"world-{size}")
        done = subprocess.run([sys.executable, *launcher, script, str(completed_run.workdir), str(out[size]),
                               test_cache_dir], capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@pytest.mark.parametrize("stage", ["sft", "prm"])
def test_training_in_two_processes_gives_the_weights_of_one(trained, stage):
    """The same effective batch (batch_size x grad_accum) over 1 or 2 processes: the same adapter (measured here: max
    abs difference 0.0; the bound leaves room for the all-reduce adding the halves' gradients in another order than
    accumulation does) and the same losses, the best epoch chosen by the same eval loss."""
    metrics = [json.loads((trained[size] / f"{stage}_metrics.json").read_text()) for size in (1, 2)]
    effective_batch = {"sft": 4, "prm": 8}[stage]   # tests/distributed/train_job.py: batch_size x grad_accum
    assert metrics[0]["examples"]["train"] % effective_batch == 0, (
        f"{metrics[0]['examples']['train']} {stage} train pairs: DDP repeats examples to fill an uneven last step, "
        f"so choose train_job.py's max_examples / validation_fraction for a multiple of {effective_batch}")
    one, two = adapter_weights(trained[1] / stage), adapter_weights(trained[2] / stage)
    assert one.keys() == two.keys() and one
    differences = {name: (one[name] - two[name]).abs().max().item() for name in one}
    assert max(differences.values()) <= 1e-6, sorted(differences.items(), key=lambda item: -item[1])[:3]
    assert [m["status"] for m in metrics] == ["trained", "trained"]
    assert metrics[0]["steps"] == metrics[1]["steps"] > 0 and metrics[0]["best_epoch"] == metrics[1]["best_epoch"]
    for key in ("train_loss", "eval_loss", "initial_eval_loss"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5), key


@pytest.fixture(scope="module")
def rl_trained(half_and_half_sft, tmp_path_factory, test_cache_dir) -> dict[int, Path]:
    """tests/distributed/rl_job.py (GRPO, PRIME and SCoRe steps) at world size 1 and 2."""
    script, env = str(REPO / "tests/distributed/rl_job.py"), {**os.environ, "HF_HUB_OFFLINE": "1",
                                                               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = {}
    for size, launcher in ((1, []), (2, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])):
        out[size] = tmp_path_factory.mktemp(f"rl-world-{size}")
        done = subprocess.run([sys.executable, *launcher, script, half_and_half_sft, str(out[size]), test_cache_dir],
                              capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@pytest.mark.parametrize("algorithm", ["grpo", "prime", "score"])
def test_rl_steps_in_two_processes_give_the_weights_of_one(rl_trained, algorithm):
    """Each process plays one of the step's two groups (SCoRe: and their attempt 2s) and backpropagates half of the
    trained turns (PRIME: half of the implicit PRM's sequences too); the gradients summed over the processes are one
    process's: the same rollouts, the same step metrics and the same policy (and PRM) weights."""
    one, two = [json.loads((rl_trained[size] / f"{algorithm}_history.json").read_text()) for size in (1, 2)]
    assert [step["trained_turns"] for step in one] == [step["trained_turns"] for step in two]
    if algorithm == "score":   # the played attempts exactly; their KL (a float sum) below
        for step in one + two:
            step["kl"] = {"trained": step["kl"]["trained"], **{attempt: step[attempt].pop("kl")
                                                               for attempt in ("attempt1", "attempt2")}}
    same = ("attempt1", "attempt2", "instances", "transitions") if algorithm == "score" else (
        "reward", "episodes", "tokens", "instances", "success_rate")
    for key in same:
        assert [step[key] for step in one] == [step[key] for step in two], key
    assert all(step["trained_turns"] > 0 for step in one)
    for step_one, step_two in zip(one, two):
        for key in ("loss", "grad_norm", "kl"):
            assert step_one[key] == pytest.approx(step_two[key], rel=1e-5, abs=1e-7), key
    folders = [rl_trained[size] / algorithm for size in (1, 2)]
    if algorithm == "prime":
        folders += [folder / "prm" for folder in folders]
        assert one[-1]["implicit_prm"]["bce"] == pytest.approx(two[-1]["implicit_prm"]["bce"], rel=1e-5)
    for single, double in zip(folders[::2] if algorithm == "prime" else folders[:1],
                              folders[1::2] if algorithm == "prime" else folders[1:]):
        a, b = adapter_weights(single), adapter_weights(double)
        assert a.keys() == b.keys() and a
        # measured: 1.5e-5 at most, where 2 steps at lr 5e-3 move each weight by up to 1e-2: the summed gradients
        # differ from one process's in the last bits (another order of addition), which Adam's division by the
        # root of its second moment enlarges for entries near 0
        assert max((a[name] - b[name]).abs().max().item() for name in a) <= 1e-4, single
