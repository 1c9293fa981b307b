"""Training curves in a tracker (``tracking.report_to``): the key checked at parse time, trackers kept local and
offline, and with TensorBoard every optimizer step's loss of SFT, the PRM and RL (GRPO) read back from the event
files of the tiny model's runs."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest

from clemprm import tracking
from clemprm.checks.parse_time import ConfigInputError, check_config_inputs
from clemprm.config import ConfigError
from clemprm.rl import trainer
from clemprm.stages import prm, sft
from clemprm.tracking import TrackingRun
from clemprm.workflow import tracking_run
from tests.conftest import tiny_config
from tests.test_prm import prm_settings, write_labels
from tests.test_prm import synthetic_rows as soft_label_rows
from tests.test_rl import rl_settings
from tests.test_sft import sft_settings, synthetic_rows


def installed_as(monkeypatch, installed: dict[str, bool]) -> None:
    """``importlib.util.find_spec`` as if each package of ``installed`` were (True) or were not (False) there."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in installed:
            return importlib.machinery.ModuleSpec(name, None) if installed[name] else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def tensorboard_steps(folder: Path) -> dict[str, list[int]]:
    """The steps of every scalar tag of the one TensorBoard run under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {event.parent for event in folder.rglob("events.out.tfevents.*")}
    assert len(runs) == 1, runs
    accumulator = EventAccumulator(str(runs.pop()), size_guidance={"scalars": 0})   # 0: every event
    accumulator.Reload()
    return {tag: [event.step for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


# ------------------------------------------------------------------------------------------ the key


def test_an_unknown_tracker_fails_at_parse_time_naming_the_key():
    assert tiny_config()["tracking"] == {"report_to": "none"}   # the default: no tracker, no network
    with pytest.raises(ConfigError, match=r"config key 'tracking.report_to': 'neptune' is not one of \['none', "
                                          r"'tensorboard', 'wandb', 'mlflow', 'trackio'\]"):
        tiny_config(tracking={"report_to": "neptune"})
    with pytest.raises(ConfigError, match="config key 'tracking.project': unknown key"):
        tiny_config(tracking={"project": "x"})


def test_a_tracker_that_is_not_installed_stops_the_run_at_parse_time_and_the_job_at_its_start(monkeypatch):
    installed_as(monkeypatch, {"wandb": False, "tensorboard": False})
    with pytest.raises(ConfigInputError, match=r"tracking.report_to: wandb is not installed in this environment: "
                                               r"pip install wandb, or set tracking.report_to: none"):
        check_config_inputs(tiny_config(tracking={"report_to": "wandb"}))
    with pytest.raises(ValueError, match=r"tracking.report_to: tensorboard is not installed .*'\.\[tracking\]'"):
        TrackingRun("tensorboard", "sft_adapter")
    check_config_inputs(tiny_config())   # none needs nothing


def test_a_jobs_run_is_named_after_its_rule_and_wildcards_under_results_tracking():
    from snakemake.iocontainers import Wildcards

    config = tiny_config(tracking={"report_to": "tensorboard"})
    job = types.SimpleNamespace(config=config, rule="rl_adapter", wildcards=Wildcards(fromdict={"algorithm": "grpo"}))
    run = tracking_run(job)
    assert (run.report_to, run.name, run.root) == ("tensorboard", "rl_adapter/grpo", "results/tracking")
    assert tracking_run(types.SimpleNamespace(config=config, rule="sft_adapter", wildcards=Wildcards())).name == \
        "sft_adapter"


def test_trackers_stay_local_and_offline_unless_the_environment_says_otherwise(monkeypatch, tmp_path):
    installed_as(monkeypatch, {"wandb": True, "mlflow": True})
    assert tracking.trainer_settings(tracking.OFF) == {"report_to": "none"}
    assert tracking.environment(tracking.OFF, {}) == {}
    wandb = TrackingRun("wandb", "rl_adapter/grpo", str(tmp_path))
    assert tracking.environment(wandb, {}) == {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                                               "WANDB_PROJECT": "clemprm"}
    assert "WANDB_MODE" not in tracking.environment(wandb, {"WANDB_MODE": "online"})   # the user's choice stands
    assert tracking.trainer_settings(wandb) == {"report_to": "wandb", "run_name": "rl_adapter/grpo",
                                                "project": "clemprm"}
    mlflow = TrackingRun("mlflow", "sft_adapter", str(tmp_path))
    assert tracking.environment(mlflow, {})["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path}/mlflow.db"
    assert tracking.environment(mlflow, {"MLFLOW_TRACKING_URI": "http://server"}) == {"MLFLOW_EXPERIMENT_NAME":
                                                                                      "clemprm"}


def test_the_rl_writer_logs_each_steps_numbers_to_wandb_offline_and_closes_the_run(monkeypatch, tmp_path):
    """W&B is not installed here: a stand-in module records what the writer asks of it."""
    calls = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kwargs: calls.append(("init", kwargs, dict(os.environ))) or wandb
    wandb.log = lambda values, step: calls.append(("log", values, step))
    wandb.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    installed_as(monkeypatch, {"wandb": True})
    monkeypatch.delenv("WANDB_MODE", raising=False)
    steps = [{"step": index, "loss": 0.5 * index, "reward": {"mean": 1.0, "std": None}, "instances": [["g", "e", "0"]],
              "served_adapter": "rl-policy-abc"} for index in range(2)]
    history = trainer.tracked_history(iter(steps), TrackingRun("wandb", "rl_adapter/grpo", str(tmp_path)))
    assert history == steps
    (_, init, environ), *logs, finish = calls
    assert init == {"project": "clemprm", "name": "rl_adapter/grpo"} and environ["WANDB_MODE"] == "offline"
    assert logs == [("log", {"loss": 0.0, "reward/mean": 1.0}, 0), ("log", {"loss": 0.5, "reward/mean": 1.0}, 1)]
    assert finish == ("finish",) and "WANDB_MODE" not in os.environ   # set while the run was open


# ------------------------------------------------------------------------- every step in TensorBoard


def test_every_sft_step_loss_is_in_tensorboard(tmp_path, test_cache_dir):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in synthetic_rows(per_instance=1)))
    run = TrackingRun("tensorboard", "sft_adapter", str(tmp_path / "tracking"))
    metrics = sft.train_sft(sft_settings(lr=5e-3, epochs=2, batch_size=2, warmup_ratio=0.0, max_examples=None,
                                         validation_fraction=0.25),
                            str(data), str(tmp_path / "adapter"), str(tmp_path / "metrics.json"), test_cache_dir,
                            tracking=run)
    steps = tensorboard_steps(tmp_path / "tracking" / "sft_adapter")
    assert metrics["steps"] >= 4 and sum(epoch.get("steps", 0) for epoch in metrics["history"]) == metrics["steps"]
    assert steps["train/loss"] == list(range(1, metrics["steps"] + 1))
    assert steps["eval/loss"][0] == 0 and steps["eval/loss"][-1] == metrics["steps"]   # before and after training
    assert not list((tmp_path / "adapter").rglob("events.out.tfevents.*"))   # the published folder holds none


def test_every_prm_step_loss_is_in_tensorboard(tmp_path, test_cache_dir):
    run = TrackingRun("tensorboard", "prm_adapter", str(tmp_path / "tracking"))
    settings = prm_settings(lr=3e-3, epochs=2, batch_size=8, grad_accum=1, validation_fraction=0.25)
    metrics = prm.train_prm(settings, write_labels(tmp_path / "labels.parquet", soft_label_rows()),
                            str(tmp_path / "adapter"), str(tmp_path / "predictions.parquet"), test_cache_dir,
                            tracking=run)   # the training record
    steps = tensorboard_steps(tmp_path / "tracking" / "prm_adapter")
    assert metrics["steps"] >= 4 and steps["train/loss"] == list(range(1, metrics["steps"] + 1))


def test_every_rl_step_metric_is_in_tensorboard(tmp_path, test_cache_dir):
    lora = {**tiny_config()["sft"]["lora"], "dropout": 0.0}   # a fresh LoRA: no SFT adapter needed
    settings = rl_settings(algorithm="grpo", steps=3, group_size=2, instances_per_step=1, max_new_tokens=8, lora=lora)
    run = TrackingRun("tensorboard", "rl_adapter/grpo", str(tmp_path / "tracking"))
    metrics = trainer.train_rl(settings, None, str(tmp_path / "adapter"), str(tmp_path / "metrics.json"),
                               test_cache_dir, tracking=run)
    steps = tensorboard_steps(tmp_path / "tracking" / "rl_adapter" / "grpo")
    assert [entry["step"] for entry in metrics["history"]] == [0, 1, 2] == steps["loss"] == steps["reward/mean"]
    for entry in metrics["history"]:   # every number the step's metrics hold, at its step
        written = tracking.scalars({key: value for key, value in entry.items() if key != "step"})
        assert written and all(entry["step"] in steps[tag] for tag in written), sorted(set(written) - set(steps))
