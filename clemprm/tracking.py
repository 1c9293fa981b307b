"""Training curves in an experiment tracker (config ``tracking.report_to``): one run per training job.

SFT and the PRM hand the tracker to the Trainer's own integration (``TrainingArguments.report_to``; the Trainer logs
every optimizer step: :func:`clemprm.training.trainer_arguments`); the RL trainer (GRPO, PRIME, SCoRe) writes every
step's metrics itself through :func:`open_run`. Both find where a run goes in the same environment variables
(:func:`tracker_environment`), which keep every tracker local and offline unless the user's environment says
otherwise: TensorBoard writes ``results/tracking/<run name>/<start time>/``; W&B runs offline (``WANDB_MODE``) into
``results/tracking/wandb/``; MLflow into the SQLite store ``results/tracking/mlflow.db`` (``MLFLOW_TRACKING_URI``);
trackio into ``results/tracking/trackio/`` (``TRACKIO_DIR``). Never inside an adapter folder, which gets published.

A tracker's package is imported only when it is chosen: TensorBoard comes with the ``tracking`` extra, W&B, MLflow and
trackio are the user's to install. One that is missing fails at parse time (:func:`tracker_problem`, from
:mod:`clemprm.checks.parse_time`) and again when a job starts (:class:`TrackingRun`). Rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from clemprm import distributed

TRACKERS = ("none", "tensorboard", "wandb", "mlflow", "trackio")
PROJECT = "clemprm"
"""The W&B project, MLflow experiment and trackio project every run of the pipeline joins."""
INSTALL = {"tensorboard": "pip install -e '.[tracking]' (clemprm's tracking extra)", "wandb": "pip install wandb",
           "mlflow": "pip install mlflow", "trackio": "pip install trackio"}


def tracker_problem(report_to: str) -> str | None:
    """Why ``report_to`` cannot track in this environment (an unknown tracker, or its package is not installed), or
    None. The tracker's name is also its package's."""
    if report_to not in TRACKERS:
        return f"tracking.report_to: unknown tracker {report_to!r} (known: {', '.join(TRACKERS)})"
    if report_to != "none" and importlib.util.find_spec(report_to) is None:
        return (f"tracking.report_to: {report_to} is not installed in this environment: "
                f"{INSTALL[report_to]}, or set tracking.report_to: none")
    return None


@dataclass(frozen=True)
class TrackingRun:
    """Where one training job's curves go: the tracker (``none``: nowhere), the run's name (the job's rule and its
    wildcards: ``rl_adapter/grpo``), the folder of the trackers' local files and when the job started (a rerun's
    TensorBoard run is a folder of its own beside the earlier ones). A tracker that cannot track here fails when the
    run is made, before the job loads a model."""

    report_to: str = "none"
    name: str = ""
    root: str = "results/tracking"
    started: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S"))

    def __post_init__(self):
        problem = tracker_problem(self.report_to)
        if problem:
            raise ValueError(problem)

    @property
    def on(self) -> bool:
        return self.report_to != "none"


OFF = TrackingRun()


def environment(run: TrackingRun, environ) -> dict[str, str]:
    """The variables that point ``run``'s tracker at its local files, offline; what ``environ`` sets already (a
    user's ``MLFLOW_TRACKING_URI``, ``WANDB_MODE=online``) is left as it is."""
    root = Path(run.root).resolve()
    wanted = {
        "tensorboard": {"TENSORBOARD_LOGGING_DIR": str(root / run.name / run.started)},
        "wandb": {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_PROJECT": PROJECT},
        "mlflow": {"MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}", "MLFLOW_EXPERIMENT_NAME": PROJECT},
        "trackio": {"TRACKIO_DIR": str(root / "trackio")},
    }.get(run.report_to, {})
    return {name: value for name, value in wanted.items() if name not in environ}


@contextlib.contextmanager
def tracker_environment(run: TrackingRun):
    """:func:`environment` set while a job trains (the Trainer's integrations read it when the Trainer is made and
    when training begins), removed after."""
    added = environment(run, os.environ)
    if run.on:
        Path(run.root).mkdir(parents=True, exist_ok=True)
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def trainer_settings(run: TrackingRun) -> dict:
    """The ``TrainingArguments`` that send a Trainer's logs to ``run`` (train inside :func:`tracker_environment`)."""
    if not run.on:
        return {"report_to": "none"}
    return {"report_to": run.report_to, "run_name": run.name, "project": PROJECT}


def scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a nested metrics dict by slash-joined key (``reward/mean``): what a tracker plots; lists, text
    and None are left out."""
    found = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            found.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            found[f"{prefix}{key}"] = float(value)
    return found


def _tensorboard(run: TrackingRun):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=os.environ["TENSORBOARD_LOGGING_DIR"])

    def write(values: dict, step: int) -> None:
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
        writer.flush()   # an RL step takes minutes: its point shows as soon as it is done

    return write, writer.close


def _wandb(run: TrackingRun):
    import wandb

    wandb_run = wandb.init(project=os.environ["WANDB_PROJECT"], name=run.name)
    return (lambda values, step: wandb_run.log(values, step=step)), wandb_run.finish


def _mlflow(run: TrackingRun):
    import mlflow

    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
    mlflow.start_run(run_name=run.name)
    return (lambda values, step: mlflow.log_metrics(values, step=step)), mlflow.end_run


def _trackio(run: TrackingRun):
    import trackio

    trackio.init(project=PROJECT, name=run.name)
    return (lambda values, step: trackio.log(values, step=step)), trackio.finish


WRITERS = {"tensorboard": _tensorboard, "wandb": _wandb, "mlflow": _mlflow, "trackio": _trackio}
"""Per tracker: open a run, returning ``(write(scalars, step), close())``."""


@contextlib.contextmanager
def open_run(run: TrackingRun):
    """``run`` open in its tracker: yields ``log(metrics, step)``, which writes the numbers of a metrics dict
    (:func:`scalars`) at ``step``; closed on leaving. With ``none``, and on every rank but 0, ``log`` does nothing."""
    if not run.on or not distributed.is_main():
        yield lambda metrics, step: None
        return
    with tracker_environment(run):
        write, close = WRITERS[run.report_to](run)
        try:
            yield lambda metrics, step: write(scalars(metrics), step)
        finally:
            close()
