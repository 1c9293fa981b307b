"""Data parallelism: 2 processes x 1 thread (torchrun, gloo) against 1 process x 2 threads, SmolLM2, side by side.

SFT, one label shard and one eval mode (greedy_base), each as its stage function runs it in a rule, the two
configurations alternating (A B A B) ``--repeat`` times. Reports seconds per run (process start and model load
included), the stage's own seconds, and whether the outputs agree (records identical; adapter weights: max abs
difference).

    python -m clemprm.bench distributed                          # the embedded default, a few instances per game
    python -m clemprm.bench distributed --instances 4 --repeat 2

On 2 cores expect about even: the figure that matters here is equivalence, the speed-up belongs to GPUs (one per
process). The SFT data (tests/test_sft.py's synthetic rows: this benchmark runs from a source checkout) and the
branch points for the label shard are made first (one process, not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from clemprm.bench import Figures

REPO = Path(__file__).resolve().parents[2]
TASKS = ("sft", "soft_labels", "greedy_base")
REPEATS_ITSELF = True


def settings_for(threads: int, instances: int) -> dict:
    from clemprm.config import eval_mode_params, load_config

    config = load_config(overrides={
        "model": {"spec": "embedded:smollm2-135m-instruct", "threads": threads},
        "games": {"max_instances": {"train": instances, "validation": instances, "test": instances}},
        "branch_points": {"episodes_per_instance": 1, "max_per_episode": 2, "siblings": 1},
        "labels": {"k": 4, "checkpoint_every": 64},
        # dropout 0 and grad_accum 2: the adapters of 1 and 2 processes compare (tests/test_distributed.py)
        "sft": {"epochs": 1, "batch_size": 4, "grad_accum": 2, "max_examples": 32, "validation_fraction": 0.0,
                "lora": {"dropout": 0.0}}})
    return {"config": config, "eval": eval_mode_params(config, "greedy_base")}


def run_task(task: str, work: Path, out: Path, cache_dir: str, instances: int) -> None:
    """One task in this process (one of several when torchrun started it)."""
    from clemprm import distributed

    size = distributed.init_from_environment()
    both = settings_for(max(1, 2 // size), instances)
    config = both["config"]
    start = time.perf_counter()
    if task == "inputs":   # the SFT data and the branch points the label shard labels
        from clemprm import records
        from clemprm.stages import branch_points
        from tests.test_sft import synthetic_rows
        records.write_records(work / "sft_data.parquet", synthetic_rows(), records.INTERACTIONS, {})
        branch_points.branch_points({k: config[k] for k in ("seed", "model", "games", "branch_points")}, None,
                                    str(work / "episodes.parquet"), str(work / "branch_points.parquet"), cache_dir)
    elif task == "sft":
        from clemprm.stages import sft
        sft.train_sft({k: config[k] for k in ("seed", "model", "sft")}, str(work / "sft_data.parquet"),
                      str(out / "adapter"), str(out / "metrics.json"), cache_dir)
    elif task == "soft_labels":
        from clemprm.stages import labels
        labels.soft_labels_shard({k: config[k] for k in ("seed", "model", "games", "labels")},
                                 str(work / "branch_points.parquet"), None, 0, 1, str(out / "labels.parquet"),
                                 cache_dir)
    else:
        from clemprm.evaluation.evaluate import evaluate_mode
        evaluate_mode(task, both["eval"], str(out / "eval.parquet"), cache_dir)
    if distributed.is_main():
        (out / "stage_seconds").write_text(f"{time.perf_counter() - start:.2f}")


def launch(task: str, processes: int, work: Path, cache_dir: str, instances: int) -> tuple[float, Path]:
    out = work / f"{task}-{processes}"
    out.mkdir(parents=True, exist_ok=True)
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
                if processes > 1 else [])
    command = [sys.executable, *launcher, "-m", "clemprm.bench.distributed", "--task", task, "--work", str(work),
               "--out", str(out),
               "--cache-dir", cache_dir, "--instances", str(instances)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // processes)), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"{task} with {processes} process(es) failed: see {out / 'log.txt'}")
    return time.perf_counter() - start, out


def agreement(task: str, one: Path, two: Path) -> str:
    from clemprm import records

    if task == "sft":
        from safetensors.torch import load_file
        a, b = (load_file(str(path / "adapter/adapter_model.safetensors")) for path in (one, two))
        return f"adapter max abs difference {max((a[k] - b[k]).abs().max().item() for k in a):.2e}"
    name, schema = (("labels.parquet", records.SOFT_LABELS) if task == "soft_labels"
                    else ("eval.parquet", records.EVAL_EPISODES))
    # as JSON text: NaN (the bench score of an aborted episode) equals NaN
    a, b = ([json.dumps(row, sort_keys=True, default=str) for row in records.read_records(path / name, schema)]
            for path in (one, two))
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)} records identical" + ("" if len(a) == len(b) else
                                                                                f" ({len(b)} vs {len(a)} rows)")


def add_arguments(parser) -> None:
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache/clemprm"), help="model cache")
    parser.add_argument("--instances", type=int, default=2, help="instances per game and split")


def run(args) -> Figures:
    work = args.workdir.resolve()
    launch("inputs", 1, work, args.cache_dir, args.instances)
    figures = Figures("distributed")
    for task in TASKS:
        for _ in range(args.repeat):
            for processes in (1, 2):   # A B A B
                seconds, out = launch(task, processes, work, args.cache_dir, args.instances)
                name = "1 process x 2 threads" if processes == 1 else "2 processes x 1 thread"
                figures.add(f"{task} {name}", seconds, "s")
                figures.add(f"{task} {name}: stage", float((out / "stage_seconds").read_text()), "s")
        figures.ratio(f"{task} 2x1 / 1x2", f"{task} 2 processes x 1 thread", f"{task} 1 process x 2 threads")
        figures.note(f"{task}: {agreement(task, work / f'{task}-1', work / f'{task}-2')}")
    return figures


if __name__ == "__main__":   # one task in one of the processes launch() starts
    worker = argparse.ArgumentParser()
    for option in ("--task", "--work", "--out", "--cache-dir"):
        worker.add_argument(option, required=True)
    worker.add_argument("--instances", type=int, required=True)
    task_args = worker.parse_args()
    run_task(task_args.task, Path(task_args.work), Path(task_args.out), task_args.cache_dir, task_args.instances)
