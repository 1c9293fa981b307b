"""Set-up shared by the rule scripts: logging into the rule's log file, the job's environment and its processes, the
training jobs' tracker run; the split of each rule's settings into its params (its rerun trigger) and the config keys
that only say how its job runs (:func:`rule_params`, :func:`job_settings`)."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

from clemprm import distributed
from clemprm.config import job_environment, sorted_dict
from clemprm.tracking import TrackingRun


def setup_job(snakemake) -> None:
    """Send all logging (and stray stderr) to the rule's log file; set HF_HOME and offline mode from config; with
    ``processes: N`` > 1 in the rule's resources, run the rule script in N processes (:func:`run_processes`) and
    end this one with their exit status.

    Called first in every rule script, before torch/transformers are imported: the hub's offline switch is
    read at import time. The parse-time checks read the same settings (:func:`clemprm.config.hub_offline_reason`).
    """
    os.environ.update(job_environment(snakemake.config))   # HF_HOME; offline for embedded/tiny models (clemprm.config)
    os.environ["CLEMPRM_LOG"] = str(snakemake.log[0])   # a vLLM server started by the job logs beside it
    log_file = open(snakemake.log[0], "a", buffering=1)
    processes = int(snakemake.resources.get("processes", 1))
    if processes > 1 and "LOCAL_RANK" not in os.environ:   # the job's first process: start the others
        sys.exit(run_processes(processes, max(1, snakemake.threads // processes), log_file))
    sys.stderr = log_file
    size = distributed.init_from_environment()
    snakemake.threads = max(1, snakemake.threads // size)   # each process its share of the job's threads
    where = f"rank {distributed.rank()}/{size} " if size > 1 else ""
    logging.basicConfig(level=logging.INFO, stream=log_file, force=True,
                        format=f"%(asctime)s {where}%(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)
    logging.getLogger(__name__).info("rule %s: inputs %s -> outputs %s", snakemake.rule,
                                     list(snakemake.input), list(snakemake.output))


def run_processes(processes: int, threads: int, log_file) -> int:
    """Run this rule script (Snakemake's copy of it, with the job in its preamble) in ``processes`` processes on this
    node through ``torchrun --standalone``, ``threads`` CPU threads each, their output in the rule log; returns
    torchrun's exit status (a failing rank stops the others: the job fails with that rank's traceback in the log).
    On a GPU node each process takes one GPU (``LOCAL_RANK``): give the job as many GPUs (docs/slurm.md)."""
    script = getattr(sys.modules["__main__"], "__real_file__", None)
    if script is None:
        raise RuntimeError("processes > 1 needs a Snakemake `script:` rule (its copy of the script with the job)")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               script]
    log_file.write(f"starting {processes} processes ({threads} CPU threads each): {' '.join(command)}\n")
    return subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)}).returncode


def tracking_run(snakemake) -> TrackingRun:
    """A training job's run in the tracker of ``tracking.report_to``, named after its rule and wildcards
    (``sft_adapter``, ``rl_adapter/grpo``), its files under ``results/tracking/``. Read from the config, not the
    rule's params: changing the tracker reruns nothing. Fails here, before a model loads, when the tracker is not
    installed."""
    return TrackingRun(snakemake.config["tracking"]["report_to"], "/".join([snakemake.rule, *snakemake.wildcards]))


# ------------------------------------------------------------------------------------------ rerun triggers

RUN_KEYS = ("model.threads", "labels.shards", "labels.checkpoint_every", "prm.bootstrap_samples",
            "prm.gate.on_failure")
"""Config keys that say how fast a job runs or what it does when something fails, not what it writes: in no rule's
params, so changing one reruns nothing (docs/configuration.md, "What a changed key reruns"). ``prm.bootstrap_samples``
only sets how many resamples estimate the same intervals of the PRM's held-out ranking; ``prm.gate.on_failure``, like
``on_failure``, what a failed gate does (the verdict itself, by ``prm.ci`` and the gate's thresholds, is a trigger of
rule ``prm_metrics``).
``labels.shards`` also names the shard files (``<s>-of-<S>.parquet``): :func:`label_shard_count` keeps the count
that made the labels there while they are what the config asks, so that a new count alone remakes nothing."""

PLAYED_SPLITS = {   # rule -> the splits whose instances its jobs play: games.max_instances of the others is no trigger
    "base_rollouts": lambda config: {"train"},
    "branch_points": lambda config: {"train", *(["validation"] if config["branch_points"]["validation_instances"]
                                                else [])},
    "soft_labels": lambda config: PLAYED_SPLITS["branch_points"](config),   # the branch points' instances
    "rl_adapter": lambda config: {"train", *([config["rl"]["states"]["split"]] if config["rl"]["data"] == "states"
                                             else [])},
    "rl_states": lambda config: {config["rl"]["states"]["split"]},
    "score_adapter": lambda config: {"train"},
    "eval_mode": lambda config: {config["eval"]["split"]},
}

MEASURING_KEYS = ("prm.ci", "prm.gate")
"""How the trained PRM is measured and judged (the intervals' level, the gate's thresholds): rule ``prm_metrics``'s
params, and no trigger of the rules that train, search with or merge the PRM (they read the ``prm`` section)."""

UNREAD_SECTIONS = {   # rule -> sections or keys in its settings (its provenance) that its outputs do not depend on
    "eval_summary": ("model", "games"),   # it reads the modes' episodes (inputs), which the model and games made
    "prm_adapter": MEASURING_KEYS,
    "eval_mode": MEASURING_KEYS,
    "merge": MEASURING_KEYS,
}


def unread_keys(rule: str, config: dict) -> list[str]:
    """The dotted config keys in ``rule``'s settings that are no rerun trigger of it: :data:`RUN_KEYS`,
    ``games.max_instances`` of the splits it does not play (:data:`PLAYED_SPLITS`) and its
    :data:`UNREAD_SECTIONS`."""
    played = PLAYED_SPLITS.get(rule)
    splits = [] if played is None else sorted(set(config["games"]["max_instances"]) - played(config))
    return [*RUN_KEYS, *(f"games.max_instances.{split}" for split in splits), *UNREAD_SECTIONS.get(rule, ())]


def _parent(settings: dict, key: str) -> tuple[dict | None, str]:
    """The dict in ``settings`` that holds the dotted ``key`` (None where a section on the way is not there), and
    the key's last part."""
    *path, name = key.split(".")
    for part in path:
        settings = settings.get(part) if isinstance(settings, dict) else None
    return (settings if isinstance(settings, dict) else None), name


def rule_params(rule: str, settings: dict, config: dict) -> dict:
    """``rule``'s params, its rerun trigger: ``settings`` (what its job reads, e.g.
    :func:`clemprm.config.base_rollouts_params`) without :func:`unread_keys`. The rule script gets them back from
    the config (:func:`job_settings`)."""
    params = copy.deepcopy(settings)
    for key in unread_keys(rule, config):
        parent, name = _parent(params, key)
        if parent is not None:
            parent.pop(name, None)
    return params


def job_settings(snakemake) -> dict:
    """The settings a rule script hands its stage: the rule's ``settings`` param with the keys :func:`rule_params`
    left out taken from the job's config, where their section is in it: what the stage read before the split, and
    what its records' provenance shows."""
    settings = copy.deepcopy(dict(snakemake.params.settings))
    for key in unread_keys(snakemake.rule, snakemake.config):
        parent, name = _parent(settings, key)
        source, _ = _parent(snakemake.config, key)
        if parent is not None and source is not None and name in source:
            parent[name] = copy.deepcopy(source[name])
    return sorted_dict(settings)


SHARDS_FOLDER = "results/labels/shards"


def label_shard_count(config: dict, params: dict, folder: str = SHARDS_FOLDER) -> int:
    """How many soft-label shards the DAG has: ``labels.shards``, unless the labels are already there in shards of
    another count (every file of the set) made with the ``soft_labels`` rule's ``params`` of now. Then that count:
    the labels do not depend on it, but Snakemake schedules by file, so a new count would make the new count's files
    and rerun everything that reads them (the PRM, the searches). The new count applies the next time the labels are
    made: when anything they depend on changes, or after ``rm -r results/labels/shards``. Read at parse time (the
    Snakefile); a shard file that cannot be read counts as not there."""
    from clemprm.records import RecordFileError, read_provenance

    wanted, current = config["labels"]["shards"], []
    counts = {path.stem.rpartition("-of-")[2] for path in Path(folder).glob("*-of-*.parquet")}
    for count in sorted({int(count) for count in counts if count.isdigit()} - {wanted}):
        files = [Path(folder) / f"{shard}-of-{count}.parquet" for shard in range(count)]
        try:
            made_with = [rule_params("soft_labels", read_provenance(path).get("config", {}), config)
                         for path in files if path.is_file()]
        except RecordFileError:
            continue
        if len(made_with) == count and all(settings == params for settings in made_with):
            current.append((min(path.stat().st_mtime for path in files), count))
    if not current or all((Path(folder) / f"{shard}-of-{wanted}.parquet").is_file() for shard in range(wanted)):
        return wanted
    count = max(current)[1]   # the newest complete set
    logging.getLogger(__name__).info("labels.shards %d: the soft labels are already made in %d shards with these "
                                     "settings; they are kept (rm -r %s to make them again in %d)", wanted, count,
                                     folder, wanted)
    return count


def check_config(config: dict, config_files=(), command_line: dict | None = None, inputs: bool = True) -> list[str]:
    """Every check of a config before any job: the one function behind the Snakefile's parse and
    ``clemprm check-config``, so that they agree. Each config file read on its own (one that is not valid YAML,
    sets a key twice or sets none: :func:`clemprm.config.read_config_file`; Snakemake read them before and kept the
    last of two same keys), the schema (``command_line``: the ``--config`` values, :func:`validate_config`), and with
    ``inputs`` what the config names outside the repository and SCoRe's games (:func:`check_config_inputs`).
    Raises :class:`clemprm.config.ConfigError` or :class:`clemprm.checks.parse_time.ConfigInputError`; returns the
    warnings (rows of the instance list that match nothing, under ``on_failure: continue``)."""
    from clemprm.checks.parse_time import check_config_inputs
    from clemprm.config import read_config_file, validate_config

    for path in config_files:
        read_config_file(path)
    validate_config(config, command_line)
    if not inputs:
        return []
    return check_config_inputs(config)
