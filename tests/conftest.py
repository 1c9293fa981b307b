"""Shared test fixtures: offline mode, a tmp working directory, scripted policies that drive real games.

The README's test command runs the suite in 2 pytest-xdist workers (``-n 2 --dist loadfile``, scripts/quickstart.sh):
a test module runs whole on one worker, so its module fixtures (a vLLM server, a SLURM cluster, a trained adapter) are
made once; the slowest modules are handed out first (:data:`SLOWEST_FIRST`; ``--no-loadscope-reorder`` keeps that
order, which xdist would otherwise sort by the number of tests). The session's expensive fixtures (the model cache,
the completed tiny run) are made once per run, by whichever worker asks first, in the folder all workers share
(:func:`made_once`); a model in the shared cache is built once by clemprm.models.materialise's own file lock. (``--dist loadgroup`` would group by marks, but pytest 9.2 ignores the
node id xdist 3.8 rewrites for it.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402
import yaml  # noqa: E402

from clemprm.config import load_config  # noqa: E402

# the test modules that take longest (minutes each on 2 cores), slowest first: under xdist a worker takes the next
# module when it is free, so starting with the long ones keeps both busy to the end
SLOWEST_FIRST = ("test_slurm_pipeline", "test_vllm", "test_distributed", "test_workflow", "test_faults", "test_models",
                 "test_labels", "test_rl", "test_bench", "test_cli", "test_prm")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):   # every worker sorts alike (a stable sort): xdist needs one order
        rank = {module: i for i, module in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(Path(item.fspath).stem, len(rank)))


@contextlib.contextmanager
def made_once(tmp_path_factory, name: str):
    """``(folder, fresh)`` for an expensive session fixture: the folder under the root all xdist workers of this run
    share (the session's own tmp folder when not distributed), held under a file lock while the caller fills it;
    ``fresh`` is false when another worker made it already (its marker beside it is there)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(f"{folder}.lock"):
        marker = folder.parent / f".{name}.made"
        fresh = not marker.exists()
        if fresh:
            shutil.rmtree(folder, ignore_errors=True)   # a worker's failed attempt
            folder.mkdir(parents=True)
        yield folder, fresh
        marker.touch()


@pytest.fixture(autouse=True)
def _tmp_cwd(tmp_path, monkeypatch):
    """Run every test in its own directory, so nothing lands in the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def test_cache_dir(tmp_path_factory):
    """One model cache for the whole session (tiny models are materialised there; clemprm.models.materialise builds
    a model once when several processes ask at the same time)."""
    with made_once(tmp_path_factory, "model-cache") as (folder, _):
        return str(folder)


@pytest.fixture(scope="session")
def smollm2(test_cache_dir):
    """The embedded SmolLM2 converted once for the whole session (about 40 s), into the session's model cache: every
    test that loads it (``ModelConfig(cache_dir=test_cache_dir)``) reuses the conversion. ``(config, folder)``."""
    from clemprm.models.loader import ModelConfig, resolve_model_dir

    cfg = ModelConfig(threads=2, cache_dir=test_cache_dir)   # the shared cache: another xdist worker that converts
    return cfg, Path(resolve_model_dir(cfg))                    # it at the same time waits on materialise's lock


@dataclasses.dataclass(frozen=True)
class CompletedRun:
    """The tiny pipeline run to the end through Snakemake, once per session (see :func:`completed_run`)."""

    workdir: Path     # results/, tiny.yaml (its config), extra.jsonl, .snakemake/
    output: str       # snakemake's stdout + stderr
    seconds: float


@pytest.fixture(scope="session")
def completed_run(tmp_path_factory, test_cache_dir) -> CompletedRun:
    """One full run of the tiny workflow (tests/test_workflow.py's config) shared by every check that needs one:
    the workflow's own tests, the rerun-trigger dry runs, ``clemprm inspect`` on its records, the clembench games'
    pipeline checks (tests/test_clembench.py: the run plays them too), the SLURM suite's local baseline and its
    requeued label shard. Treat it as read-only: a test that reruns something works on a copy (:func:`copy_of_run`)."""
    from tests import test_workflow as workflow

    with made_once(tmp_path_factory, "completed-run") as (workdir, fresh):
        made = workdir.parent / "completed-run.json"   # snakemake's output and time, for the workers that did not run
        if fresh:
            workflow.prepare_workdir(workdir, test_cache_dir)
            start = time.monotonic()
            result = workflow.snakemake(workdir)
            made.write_text(json.dumps({"output": result.stdout + "\n" + result.stderr,
                                        "seconds": time.monotonic() - start}))
        run = json.loads(made.read_text())
    return CompletedRun(workdir, run["output"], run["seconds"])


def copy_of_run(run: CompletedRun, destination: Path) -> Path:
    """A copy of a completed run (mtimes and Snakemake's metadata kept, so it is just as up to date)."""
    shutil.copytree(run.workdir, destination, symlinks=True)
    return destination


def train_tiny_sft(folder: Path, rows: list[dict], cache_dir: str) -> str:
    """An SFT adapter of the tiny model trained hard on ``rows`` (playpen interaction rows), written to
    ``folder/adapter``: a policy that has learnt those answers, for tests of what later stages do with it."""
    from clemprm.stages import sft

    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tiny_config(sft={"lr": 5e-3, "epochs": 4, "batch_size": 8, "grad_accum": 1, "warmup_ratio": 0.0,
                              "max_examples": None, "validation_fraction": 0.0,
                              "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}})
    settings = {name: config[name] for name in ("seed", "model", "sft")}
    sft.train_sft(settings, str(folder / "data.jsonl"), str(folder / "adapter"), str(folder / "metrics.json"),
                  cache_dir)
    return str(folder / "adapter")


TINY = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml").read_text())
"""configs/tiny.yaml: the tiny model and small counts, the config a person can run by hand too."""
RUN_KEYS = ("model", "on_failure", "games", "base_rollouts")
# The shape the tests were written for, pinned apart from config.yaml's (a small learning benchmark: siblings,
# held-out validation states, k_first, no RL algorithm, no merges): each test asks for what it checks
TESTS_SHAPE = {key: value for key, value in TINY.items() if key not in RUN_KEYS}


def tiny_config(**overrides) -> dict:
    """The default config with configs/tiny.yaml over it, but ``on_failure`` (a test expects the default, stop,
    unless it asks for continue): what the workflow tests run."""
    from clemprm.config import deep_merge
    return load_config(overrides=deep_merge({key: value for key, value in TINY.items() if key != "on_failure"},
                                            overrides))


def _scripted_policy_class():
    from clemcore.backends import BatchGenerativeModel
    from clemcore.backends.model_registry import ModelSpec

    from clemprm.play.contract import Generation

    class ScriptedPolicy(BatchGenerativeModel):
        """A policy whose answer is ``answer(messages)``: real games, known moves. Records each generate call."""

        def __init__(self, answer, name="scripted"):
            super().__init__(ModelSpec(model_name=name))
            self.answer = answer
            self.calls: list[int] = []

        def generate(self, perspectives, seeds=None, temperature=None, top_p=None, max_new_tokens=None):
            self.calls.append(len(perspectives))
            generations = []
            for messages in perspectives:
                text = self.answer(messages)
                if isinstance(text, Exception):
                    generations.append(Generation(text="", raw_text="", prompt_tokens=0, new_tokens=0,
                                                  error=str(text)))
                else:
                    generations.append(Generation(text=text, raw_text=text, prompt_tokens=len(str(messages)),
                                                  new_tokens=len(text.split())))
            return generations

        def generate_batch_response(self, batch_messages):
            return [(m, {}, g.text) for m, g in zip(batch_messages, self.generate(batch_messages))]

        def generate_response(self, messages):
            return self.generate_batch_response([messages])[0]

        def __deepcopy__(self, memo):
            return self

    return ScriptedPolicy


@pytest.fixture(scope="session")
def scripted_policy():
    from clemprm.play.clemcore_setup import import_clemcore
    import_clemcore()
    return _scripted_policy_class()


def binary_search_answer(messages: list[dict]) -> str:
    """Solves guessnumber from the feedback in the conversation (a perfect player)."""
    text = "\n".join(m["content"] for m in messages if m["role"] == "user")
    high = int(re.search(r"from 1 to (\d+)", text).group(1))
    low = 1
    for direction, guess in re.findall(r"is (higher|lower) than (\d+)", text):
        if direction == "higher":
            low = max(low, int(guess) + 1)
        else:
            high = min(high, int(guess) - 1)
    return f"GUESS: {(low + high) // 2}"
