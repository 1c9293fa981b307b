"""Checks run when the Snakefile is parsed, before any job: a run that cannot work stops at once, saying why.

:func:`check_config_inputs` checks what the config names outside this repository without loading any model or
game code. The models and the games have modules of their own; the run's own settings are checked here:

* the models (:mod:`clemprm.checks.model_inputs`): ``model.spec`` (and ``prm.base_model``) resolve to a model
  folder or a hub id the jobs can reach, ``model.adapter`` is a policy's PEFT adapter folder, ``cache_dir`` (else
  ``$CLEMPRM_CACHE``) can be created and written and is not under ``results/``, and every name of a LoRA's
  ``target_modules`` list names a module of the model it trains;
* the games (:mod:`clemprm.checks.game_inputs`, their code read, never run, by :mod:`clemprm.checks.game_code`):
  ``games.experiments``, ``games.parse_mode_overrides`` and ``games.instances_files`` name played games and
  ``games.experiments`` experiments their instances files hold; ``games.clembench_path`` is a clembench checkout in
  which every game of ``games.clembench_games`` is found with an instances file that can be read and holds no
  ``game_id`` twice in one experiment, its Python imports resolve and its NLTK data is installed; every row of
  ``games.instance_list`` matches an instance of a played game (a warning under ``on_failure: continue``); with RL
  rewarded per turn on episodes, every played game logs per-turn scores; ``score.games`` holds single-player
  games (configured ones, when eval mode ``self_correct`` is played);
* the input files the rules read (``sft.extra_data``) are there;
* with ``generation.backend: vllm``, a server can be reached or started (a URL, or a Python with vLLM installed),
  ``generation.vllm.args`` sets none of the flags the job sets itself (``--host``, ``--port``, ``--api-key``), and
  no eval mode ranks by the policy's log-probabilities on a shared server;
* the held-out set is not capped below ``branch_points.validation_instances`` (a warning);
* the tracker of ``tracking.report_to`` is installed (:func:`clemprm.tracking.tracker_problem`).

:func:`snakemake_processes_problems` checks the ``processes`` resources Snakemake was given.
"""

from __future__ import annotations

import os

from clemprm.checks.game_inputs import (clembench_problems, experiment_problems, instance_list_problems,
                                        single_player_problems, turn_score_problems, unplayed_game_problems)
from clemprm.checks.model_inputs import adapter_problems, cache_dir_problems, lora_target_problems, model_problems
from clemprm.modes import SELF_CORRECT
from clemprm.tracking import tracker_problem


class ConfigInputError(ValueError):
    """Something the config names (a model, a checkout, a game, its packages or data) is not usable here."""


def check_config_inputs(config: dict) -> list[str]:
    """Raise :class:`ConfigInputError` listing every problem found (see the module doc); return the warnings
    (:func:`config_input_problems`)."""
    problems, warnings = config_input_problems(config)
    if problems:
        raise ConfigInputError("the config names things this run cannot use:\n  - " + "\n  - ".join(problems))
    return warnings


def config_input_problems(config: dict) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of what the config names (see the module doc). Rows of ``games.instance_list`` that
    match no instance are a problem, or a warning under ``on_failure: continue``; a held-out set capped below what
    ``branch_points.validation_instances`` asks is a warning (:func:`held_out_warnings`)."""
    from clemprm.config import hub_offline_reason

    offline = hub_offline_reason(config)
    hf_home = config.get("hf_home")
    # a two-player game in score.games always; an unconfigured one when self_correct is played
    problems = single_player_problems(config, in_use=SELF_CORRECT in config["eval"]["modes"])
    problems += model_problems(config["model"]["spec"], "model.spec", offline, hf_home)
    problems += adapter_problems(config["model"].get("adapter"), "model.adapter")
    if config.get("prm", {}).get("base_model"):
        problems += model_problems(config["prm"]["base_model"], "prm.base_model", offline, hf_home)
    problems += cache_dir_problems(config.get("cache_dir"))
    problems += clembench_problems(config["games"])
    problems += unplayed_game_problems(config["games"])
    problems += experiment_problems(config["games"])
    unreadable, unmatched = instance_list_problems(config["games"])
    tolerated = config["on_failure"] == "continue"
    warnings = (unmatched if tolerated else []) + held_out_warnings(config)
    problems += unreadable + ([] if tolerated else unmatched)
    problems += input_file_problems(config)
    problems += generation_problems(config.get("generation") or {})
    problems += vllm_args_problems(config.get("generation") or {})
    problems += vllm_mode_problems(config)
    problems += turn_score_problems(config)
    problems += lora_target_problems(config)
    tracker = tracker_problem(config["tracking"]["report_to"])
    problems += [tracker] if tracker else []
    return problems, warnings


def generation_problems(generation: dict) -> list[str]:
    """The vllm backend needs a server: a URL, or a Python that can start one: an executable in which vLLM is
    installed (:func:`python_finds_module`)."""
    if generation.get("backend") != "vllm":
        return []
    vllm = generation.get("vllm") or {}
    if vllm.get("url"):
        return []
    python = vllm.get("python")
    if not python:
        return ["generation.backend vllm: set generation.vllm.url (a running vLLM server) or generation.vllm.python "
                "(the Python of a virtualenv with vLLM: bash scripts/setup_vllm.sh makes one; docs/vllm.md)"]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return [f"generation.vllm.python: {python} is not an executable file (the Python of a virtualenv with vLLM)"]
    problem = python_finds_module(python, "vllm")
    if problem:
        return [f"generation.vllm.python: {python} {problem}: give the Python of a virtualenv with vLLM (bash "
                f"scripts/setup_vllm.sh makes one; docs/vllm.md)"]
    return []


def vllm_args_problems(generation: dict) -> list[str]:
    """With the vllm backend, the items of ``generation.vllm.args`` that set a flag the job sets itself
    (:data:`clemprm.models.vllm_backend.JOB_FLAGS`: ``--host 0.0.0.0`` came after the job's own ``--host`` and the
    server listened on every interface)."""
    from clemprm.models.vllm_backend import JOB_FLAGS, job_flag_of

    if generation.get("backend") != "vllm":
        return []
    args = (generation.get("vllm") or {}).get("args") or []
    return [f"generation.vllm.args: {arg} sets {flag}, which the job sets itself ({JOB_FLAGS[flag]}): drop it"
            for arg in args if (flag := job_flag_of(arg))]


def python_finds_module(python: str, module: str) -> str | None:
    """Why the interpreter ``python`` would not import ``module`` (as the end of a sentence), or None: it is asked
    where the module is (``importlib.util.find_spec``, a fraction of a second), not to import it (vLLM takes
    seconds)."""
    import subprocess

    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot be run ({type(error).__name__}: {error})"
    if done.returncode == 1 and not done.stderr.strip():
        return f"does not find the module {module} (not installed in it)"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"failed when asked for {module} ({last})"
    return None


def vllm_mode_problems(config: dict) -> list[str]:
    """Eval modes a shared vLLM server cannot play: those that rank candidates by the policy's own log-probabilities
    (``scorer: logprob``) ask the server for prompt log-probs, which it computes right only for a step that holds that
    one request (:meth:`clemprm.models.vllm_backend.VLLMDecoder.sequence_logprobs`). A server the job starts
    (``generation.vllm.python``) serves that job alone; one at ``generation.vllm.url`` serves every job at once."""
    from clemprm.modes import MODES

    generation = config.get("generation") or {}
    if generation.get("backend") != "vllm" or not (generation.get("vllm") or {}).get("url"):
        return []
    refused = [mode for mode in config["eval"]["modes"] if MODES[mode].scorer == "logprob"]
    if not refused:
        return []
    return [f"eval.modes: {', '.join(refused)} rank{'s' if len(refused) == 1 else ''} candidates by the policy's "
            f"log-probabilities, which a vLLM server computes right only for one request at a time (vLLM issue "
            f"16668), and the server at generation.vllm.url serves every job at once: let each job start its own "
            f"server (generation.vllm.python instead of generation.vllm.url), or drop "
            f"{'it' if len(refused) == 1 else 'them'} from eval.modes"]


def input_file_problems(config: dict) -> list[str]:
    """Input files of rules that the config names and that are not there (a rule would stop the run at once with
    Snakemake's "Missing input files") or not what the rule reads: ``sft.extra_data``, read as an interactions table
    (:func:`clemprm.records.read_interactions`; ``/etc/passwd`` was accepted, and the SFT job failed on it)."""
    from clemprm.records import read_interactions

    extra = (config.get("sft") or {}).get("extra_data")
    if not extra:
        return []
    if not os.path.isfile(os.path.expanduser(extra)):
        return [f"sft.extra_data: {extra} is not a file (relative to {os.getcwd()}; playpen-data interactions: "
                f"parquet, jsonl or json)"]
    try:
        read_interactions(os.path.expanduser(extra))
    except Exception as error:   # pyarrow's, json's or the layout's: whatever it is, it names the file
        return [f"sft.extra_data: {extra} is not a playpen-data interactions table ({error})"]
    return []


def held_out_warnings(config: dict) -> list[str]:
    """A held-out set smaller than ``branch_points.validation_instances`` asks (``games.max_instances.validation`` caps
    the validation split the held-out instances are drawn from:
    :func:`clemprm.stages.branch_points.held_out_instances`), or none at all: the PRM's ranking metrics and gate then
    judge nothing (a gate that stops is refused: :func:`clemprm.config.prm_problem`)."""
    asked, cap = config["branch_points"]["validation_instances"], config["games"]["max_instances"]["validation"]
    if not asked and not config["prm"]["validation_fraction"]:
        return ["branch_points.validation_instances and prm.validation_fraction are 0: the PRM has no held-out set, so "
                "its ranking metrics and its gate judge nothing (set branch_points.validation_instances, e.g. 4)"]
    if asked <= cap:
        return []
    return [f"branch_points.validation_instances {asked} is above games.max_instances.validation {cap}: the PRM's "
            f"held-out set gets {cap} instances per game, not {asked} (raise games.max_instances.validation, or "
            f"lower branch_points.validation_instances)"]


PROCESSES = "processes"
"""The Snakemake resource that runs a job in that many processes (:func:`clemprm.workflow.setup_job`)."""


def processes_problems(resources: dict) -> list[str]:
    """Why the ``processes`` resources Snakemake was given cannot run a job: ``resources`` maps where a value was set
    (``--set-resources prm_adapter``, ``--default-resources``) to its resources (Snakemake's ``Resource`` objects,
    whose ``raw`` is the text given, or plain values). Each must be a whole number of at least 1: ``two`` failed
    inside the job with a bare int() traceback, and ``0`` ran one process without a word."""
    problems = []
    for where, values in resources.items():
        value = dict(values or {}).get(PROCESSES)
        if value is None:
            continue
        raw = getattr(value, "raw", value)
        text = str(raw).strip()
        if isinstance(raw, bool) or not text.lstrip("+").isdigit() or int(text) < 1:
            problems.append(f"{where}: {PROCESSES}={raw} is not a whole number of at least 1 (the processes a "
                            f"job runs in, one per GPU: e.g. {PROCESSES}=2; docs/slurm.md, several GPUs per job)")
    return problems


def snakemake_processes_problems(resource_settings) -> list[str]:
    """:func:`processes_problems` of a Snakemake workflow's resource settings (``workflow.resource_settings``): its
    ``--set-resources`` per rule and its ``--default-resources``."""
    given = {f"--set-resources {rule}": values for rule, values in resource_settings.overwrite_resources.items()}
    given["--default-resources"] = resource_settings.default_resources
    return processes_problems(given)
