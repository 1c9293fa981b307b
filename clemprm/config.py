"""The pipeline configuration: loading, schema validation with errors that name the key, and provenance.

The schema (``clemprm/config.schema.yaml``) is the single description of every key; the Snakefile, the
rule scripts and the tests all validate through :func:`validate_config`.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from clemprm.modes import MODES, RL_ALGORITHMS, prm_input_problem
from clemprm.tracking import TRACKERS

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = REPO_ROOT / "config.yaml"

# Packages whose versions are written next to every output.
TRACKED_PACKAGES = ("clemprm", "clemcore", "torch", "transformers", "peft", "trl", "bitsandbytes",
                    "datasets", "pyarrow", "snakemake")


class ConfigError(ValueError):
    """A configuration value that the schema rejects; the message names the offending key."""


def _schema() -> dict:
    """The config schema, with the eval modes and RL algorithms of :mod:`clemprm.modes` and the trackers of
    :mod:`clemprm.tracking` as the allowed values."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    schema["properties"]["eval"]["properties"]["modes"]["items"] = {"enum": list(MODES)}
    schema["properties"]["rl"]["properties"]["algorithms"]["items"] = {"enum": list(RL_ALGORITHMS)}
    schema["properties"]["tracking"]["properties"]["report_to"] = {"enum": list(TRACKERS)}
    return schema


# Keys of earlier versions, by dotted name: what replaced them (a user's old config fails naming both).
RENAMED_KEYS = {"rl.algorithm": "rl.algorithms, a list of the RL algorithms trained side by side, e.g. "
                                "[grpo, prime] (each trains results/rl/<algorithm>/, eval mode greedy_rl_<algorithm>)"}


def renamed_key_problem(config: dict) -> str | None:
    """The first key of :data:`RENAMED_KEYS` that ``config`` still sets, with its replacement; None if none."""
    for dotted, replacement in RENAMED_KEYS.items():
        *parents, key = dotted.split(".")
        section = config
        for part in parents:
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict) and key in section:
            return f"config key '{dotted}' was replaced by {replacement}"
    return None


def trained_adapters(config: dict) -> list[str]:
    """The adapters a run trains, by the name ``merge.adapters`` and ``results/merged/<name>`` use: sft, prm (a LoRA
    PRM: a probe PRM, ``prm.kind: probe``, is a head over the policy's states, not an adapter) and rl_<algorithm>
    for each of ``rl.algorithms``."""
    prm = ["prm"] if config["prm"].get("kind", "lora") == "lora" else []   # a probe PRM is no LoRA to merge
    return ["sft", *prm, *(f"rl_{algorithm}" for algorithm in config["rl"]["algorithms"])]


def cross_key_problem(config: dict) -> str | None:
    """No game to play, an eval mode that needs an RL policy whose algorithm ``rl.algorithms`` does not train, an eval
    mode whose PRM reads another input than ``prm.input``, a search over one candidate (:func:`search_n_problem`), a
    size no run can mean (:func:`size_problem`), a merge of an adapter the run does not train, RL
    settings that do not go together (:func:`rl_problem`) or PRM settings that train or judge nothing
    (:func:`prm_problem`); None if none."""
    games = config["games"]
    if not games["builtin"] and not games.get("clembench_games"):
        return ("config key 'games.builtin': no game to play: games.builtin is empty and games.clembench_games "
                "names none (name at least one game)")
    if problem := (size_problem(config) or prm_input_problem(config["eval"]["modes"], config["prm"]["input"])
                   or search_n_problem(config)):
        return problem
    algorithms = config["rl"]["algorithms"]
    mergeable = trained_adapters(config)
    if "prm" in config["merge"]["adapters"] and "prm" not in mergeable:
        return ("config key 'merge.adapters': prm is a probe here (prm.kind: probe), a head over the policy's "
                "hidden states and no LoRA adapter: nothing to merge; drop prm from merge.adapters")
    if unknown := [name for name in config["merge"]["adapters"] if name not in mergeable]:
        return (f"config key 'merge.adapters': {', '.join(unknown)} is no adapter this run trains (it trains "
                f"{', '.join(mergeable)}; rl_<algorithm> needs the algorithm in rl.algorithms)")
    for mode in config["eval"]["modes"]:
        needed = MODES[mode].algorithm
        if needed is not None and needed not in algorithms:
            return (f"config key 'eval.modes': {mode} plays the {needed} policy, but 'rl.algorithms' "
                    f"({', '.join(algorithms) or 'none'}) does not train it: add {needed} to rl.algorithms or drop "
                    "the mode")
    return rl_problem(config) or prm_problem(config)


SIZE_BOUNDS = {
    ("labels", "k"): (1024, "continuations per candidate, each a whole game played on; the card uses 4-16"),
    ("labels", "shards"): (1024, "jobs of the soft_labels stage, each loading the model; Snakemake plans every one "
                                 "at parse time"),
    ("branch_points", "siblings"): (256, "candidates sampled per state, each labelled by labels.k games"),
    ("branch_points", "max_per_episode"): (1024, "states per trajectory; no game here lasts that many turns"),
    ("base_rollouts", "episodes_per_instance"): (10000, "plays of one instance"),
    ("branch_points", "episodes_per_instance"): (10000, "plays of one instance"),
    ("eval", "episodes_per_instance"): (10000, "plays of one instance per mode"),
    ("eval", "n"): (256, "candidates sampled per turn"),
}
"""Upper bounds of sizes no run can mean (``labels.k: 99999999999999999999999`` was accepted), each with its
reason: a run asking for more fails at parse time (:func:`size_problem`). ``games.max_instances`` is bounded apart
(:data:`MAX_INSTANCES`)."""
MAX_INSTANCES = 1_000_000   # per game and split: a cap above every game's size is the same as null


def size_problem(config: dict) -> str | None:
    """A size above its bound (:data:`SIZE_BOUNDS`, :data:`MAX_INSTANCES`), naming the key, the bound and why."""
    for (section, key), (bound, why) in SIZE_BOUNDS.items():
        value = (config.get(section) or {}).get(key)
        if isinstance(value, int) and value > bound:
            return (f"config key '{section}.{key}': {value} is above {bound}, more than any run can mean ({why}); "
                    f"give a size at most {bound}")
    for split, value in (config["games"].get("max_instances") or {}).items():
        if isinstance(value, int) and value > MAX_INSTANCES:
            return (f"config key 'games.max_instances.{split}': {value} is above {MAX_INSTANCES}, more instances "
                    f"than any game holds; null takes every instance of the split")
    return None


def search_n_problem(config: dict) -> str | None:
    """Search modes (best-of-N, beam search) with ``eval.n`` 1: every scorer then picks the one candidate there is,
    so each search plays what its control plays and their difference measures nothing."""
    searches = [mode for mode in config["eval"]["modes"] if MODES[mode].search in ("best_of_n", "beam_search")]
    if searches and config["eval"]["n"] < 2:
        return (f"config key 'eval.n': {config['eval']['n']} candidate per turn, so {', '.join(searches)} choose "
                f"among one: each plays what its control plays and their differences measure nothing; set eval.n "
                f"to 2 or more, or drop the search modes from eval.modes")
    return None


def prm_problem(config: dict) -> str | None:
    """PRM settings that judge nothing: a gate that stops the run (``prm.gate.on_failure: stop``, or ``inherit``
    under ``on_failure: stop``) with no held-out set to judge the PRM on (it would stop on no evidence, or never)."""
    prm = config["prm"]
    action = config["on_failure"] if prm["gate"]["on_failure"] == "inherit" else prm["gate"]["on_failure"]
    if action == "stop" and not config["branch_points"]["validation_instances"] and not prm["validation_fraction"]:
        return ("config key 'prm.gate.on_failure': the gate stops the run when the PRM fails it, but there is no "
                "held-out set to judge the PRM on (branch_points.validation_instances and prm.validation_fraction "
                "are 0): set branch_points.validation_instances (validation instances per game), or "
                "prm.gate.on_failure: continue")
    return None


TURN_REWARD_SOURCES = ("turn_scores",)
"""``rl.reward.source`` values that reward each turn on its own (:data:`clemprm.rl.rewards.TURN_SOURCES`)."""
STATES_GAME = "hanabi"
"""The game whose rule-based self-play is the prompt set of ``rl.data: states`` (:mod:`clemprm.stages.rl_states`)."""


def rl_problem(config: dict) -> str | None:
    """Settings of the RL stage that it refuses only after SFT (and the states' self-play) have run: PRIME with a
    per-turn reward (its implicit PRM learns from an episode's success), ``rl.data: states`` with an episode reward
    (it trains single turns) or without hanabi (the states are its self-play); None when no algorithm is trained."""
    rl = config["rl"]
    if not rl["algorithms"]:
        return None
    source = rl["reward"]["source"]
    if "prime" in rl["algorithms"] and source in TURN_REWARD_SOURCES:
        return (f"config key 'rl.reward.source': {source} rewards single turns, which grpo trains on; prime's implicit "
                f"PRM learns from an episode's success: use success_played or bench_score, or drop prime from "
                f"rl.algorithms")
    if rl["data"] == "states" and source not in TURN_REWARD_SOURCES:
        return (f"config key 'rl.data': states trains single turns, which needs a per-turn rl.reward.source "
                f"({', '.join(TURN_REWARD_SOURCES)}), not {source}: set rl.reward.source: turn_scores, or rl.data: "
                f"episodes")
    if rl["data"] == "states" and STATES_GAME not in config["games"]["builtin"]:
        return (f"config key 'rl.data': states trains on {STATES_GAME}'s rule-based self-play, but games.builtin "
                f"({', '.join(config['games']['builtin']) or 'none'}) does not play {STATES_GAME}: add it (as "
                f"configs/hanabi.yaml does), or set rl.data: episodes")
    return None


def _strict_integer(checker, instance) -> bool:
    """JSON Schema's "integer" without whole-number floats: ``4.0`` is a float here, as Python's ``range`` sees it."""
    return isinstance(instance, int) and not isinstance(instance, bool)


def _finite_number(checker, instance) -> bool:
    """JSON Schema's "number" without NaN and infinity: ``minimum`` and ``maximum`` never fail on NaN, and ``.inf``
    passes ``exclusiveMinimum: 0`` (a NaN temperature ran every label continuation to its token limit)."""
    return (isinstance(instance, (int, float)) and not isinstance(instance, bool)
            and (not isinstance(instance, float) or math.isfinite(instance)))


ConfigValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _strict_integer, "number": _finite_number}))
"""The config's validator: Draft 2020-12, except that an integer key rejects ``4.0`` (JSON Schema counts it as an
integer; the stages then fail with a bare ``TypeError`` in ``range``) and a number key NaN and infinity."""


NUMBER_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A number written as YAML 1.2 reads it but YAML 1.1 does not: PyYAML, and so Snakemake, reads ``1e-4`` (no dot)
as the text ``'1e-4'``."""


def number_text_paths(errors) -> list[list]:
    """The paths of the values that the schema wants as a number (:data:`NUMBER_TEXT`) and that are such text, among
    ``errors`` and the errors of their alternatives (``oneOf``)."""
    paths = []
    for error in errors:
        wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        if (error.validator == "type" and "number" in wanted and isinstance(error.instance, str)
                and NUMBER_TEXT.fullmatch(error.instance.strip())):
            paths.append(list(error.absolute_path))
        paths += number_text_paths(error.context or ())
    return paths


def convert_number_text(config: dict, validator) -> None:
    """Turn each number key's value that YAML 1.1 read as text (``lr: 1e-4``, :data:`NUMBER_TEXT`) into the float it
    spells, in place: the Snakefile's ``config`` is then what the rules and the jobs read."""
    for path in number_text_paths(validator.iter_errors(config)):
        *parents, key = path
        section = config
        for part in parents:
            section = section[part]
        section[key] = float(section[key])


def validate_config(config: dict, command_line: dict | None = None) -> dict:
    """Raise :class:`ConfigError` naming the first bad key (dotted path); return the config, whose number keys written
    as YAML 1.1 reads them as text (``1e-4``) are now numbers (:func:`convert_number_text`). ``command_line``: the
    values of ``snakemake --config`` (a nested one there arrives as text: :func:`command_line_hint`)."""
    renamed = renamed_key_problem(config)
    if renamed:
        raise ConfigError(renamed)
    validator = ConfigValidator(_schema())
    convert_number_text(config, validator)
    errors = sorted(validator.iter_errors(config),
                    key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        first = errors[0]
        deeper = [error for error in first.context or () if len(error.absolute_path) > len(first.absolute_path)]
        if first.validator in ("oneOf", "anyOf") and deeper:   # e.g. rl.lora (null or a LoRA): name the key inside
            first = jsonschema.exceptions.best_match(deeper)
        key = ".".join(str(part) for part in first.absolute_path) or "<top level>"
        if first.validator == "additionalProperties":
            extra = sorted(set(first.instance) - set(first.schema.get("properties", {})))
            key = ".".join(filter(None, [key if first.absolute_path else "", extra[0]]))
            raise ConfigError(f"config key '{key}': unknown key (allowed: "
                              f"{', '.join(sorted(first.schema.get('properties', {})))})")
        raise ConfigError(f"config key '{key}': {error_message(first)}"
                          f"{command_line_hint(command_line, list(first.absolute_path), first.instance)}")
    cross = cross_key_problem(config)
    if cross:
        raise ConfigError(cross)
    return config


def command_line_hint(command_line: dict | None, path: list, value) -> str:
    """Where a rejected value is a nested one that ``snakemake --config`` gave (``labels={k: 8}``), the advice to use
    a config file: Snakemake reads only a top-level ``--config`` value as a number or a boolean; nested values stay
    text (``'8'``), which no number key takes. Else ''."""
    if not command_line or len(path) < 2 or not isinstance(value, str):
        return ""
    given = command_line
    for part in path:
        if not isinstance(given, dict) or part not in given:
            return ""
        given = given[part]
    if given != value:
        return ""
    return (f" (Snakemake passes a nested --config value as text: set {'.'.join(map(str, path))} in a config file "
            f"and pass it with --configfile)")


def error_message(error: jsonschema.ValidationError) -> str:
    """The schema's objection to a value; for a value matching none of its alternatives (``oneOf``, ``anyOf``), each
    alternative's (``8 is less than the minimum of 16, or 'auto' was expected``), not jsonschema's "not valid under
    any of the given schemas"."""
    if error.validator in ("oneOf", "anyOf") and error.context:
        return ", or ".join(error_message(alternative) for alternative in error.context)
    if error.validator == "type" and isinstance(error.instance, float) and not math.isfinite(error.instance):
        return f"{error.instance} is not a finite number (NaN and infinity are refused: give a number)"
    return error.message


OFFLINE_SPECS = ("embedded:", "tiny:")
"""Model specs that need no hub: where ``model.spec`` is one, the jobs run offline (:func:`job_environment`)."""
HUB_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def job_environment(config: dict, environ=None) -> dict[str, str]:
    """The environment variables every job sets before torch and transformers are imported
    (:func:`clemprm.workflow.setup_job`): ``HF_HOME`` from ``hf_home``; where ``model.spec`` is an embedded or tiny
    model, the hub's offline switches, unless ``environ`` (default: this process's) already sets them; with the vllm
    backend, where its server runs (``CLEMPRM_VLLM_SERVER``: :data:`VLLM_SERVER_KEYS`)."""
    environ = os.environ if environ is None else environ
    variables = {"HF_HOME": config["hf_home"]} if config.get("hf_home") else {}
    generation = config.get("generation") or {}
    if generation.get("backend") == "vllm":   # where the server runs (clemprm.models.vllm_backend.vllm_settings)
        variables["CLEMPRM_VLLM_SERVER"] = json.dumps({key: generation["vllm"][key] for key in VLLM_SERVER_KEYS
                                                       if key in generation["vllm"]})
    if config["model"]["spec"].strip().startswith(OFFLINE_SPECS):
        variables.update({name: "1" for name in HUB_OFFLINE_VARIABLES if name not in environ})
    return variables


def hub_offline_reason(config: dict, environ=None) -> str | None:
    """Why the jobs of ``config`` cannot download from the Hugging Face hub (a hub id then loads only from the hub
    cache), or None when they can. Read as huggingface_hub reads it: ``HF_HUB_OFFLINE``, else
    ``TRANSFORMERS_OFFLINE``, is 1/ON/YES/TRUE."""
    environ = os.environ if environ is None else environ
    added = job_environment(config, environ)
    jobs = {**environ, **added}
    name = next((name for name in HUB_OFFLINE_VARIABLES if jobs.get(name)), None)
    if name is None or jobs[name].strip().upper() not in {"1", "ON", "YES", "TRUE"}:
        return None
    if name in added:
        return (f"model.spec {config['model']['spec']} is an embedded or tiny model, so the jobs set {name}=1; "
                f"export {name}=0 to let them download")
    return f"{name}={environ[name]} in the environment"


def deep_merge(base: dict, override: dict) -> dict:
    """Return ``base`` updated recursively with ``override`` (dicts merge, everything else replaces)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """The same key twice in one mapping of a YAML file (PyYAML, and so Snakemake, keeps the last silently)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping holding the same key twice, naming the key and where it repeats."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:   # an unhashable key: the base class says so
                break
            if first is not key_node:
                raise DuplicateKeyError(None, None, f"key {key!r} is set twice (first at line "
                                                    f"{first.start_mark.line + 1}; YAML would keep the last silently)",
                                        key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path) -> dict:
    """One config file as a dict; :class:`ConfigError` naming the file (and where YAML stopped) when it is missing,
    not valid YAML, holds a key twice in one mapping, is not a mapping at its top level, or sets a top-level key that
    is no config key (Snakemake merged it without a word: a target after ``--configfile``, such as
    ``results/prm/metrics.json``, is read as a config file)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"config file {path}: cannot read it ({error.strerror or error})") from error
    try:
        loaded = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        if isinstance(error, DuplicateKeyError):
            raise ConfigError(f"config file {path}, line {where.line + 1}: {problem}") from error
        raise ConfigError(f"config file {path}: not valid YAML{at}: {problem}") from error
    if loaded is None:   # Snakemake refuses it too ("Config file must be given as JSON or YAML with keys at top level")
        raise ConfigError(f"config file {path}: it sets no key (it is empty, or only comments): Snakemake refuses such "
                          f"a file; set a key in it, or leave it out")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: its top level is a {type(loaded).__name__}, not a mapping of keys")
    known = _schema()["properties"]
    if unknown := [str(key) for key in loaded if key not in known]:
        verb = "is no config key" if len(unknown) == 1 else "are no config keys"
        raise ConfigError(f"config file {path}: {', '.join(unknown)} {verb} (allowed: {', '.join(sorted(known))}). "
                          f"If {path} is a target, not a config file: snakemake's --configfile takes every word "
                          f"after it as a config file; put targets before --configfile, or end its files with --")
    return loaded


def merge_config_files(path: str | Path | list | tuple | None = None, overrides: dict | None = None) -> dict:
    """The default config with user config files (one path or several, in order, as Snakemake merges its
    ``--configfile``s) and overrides merged on top; not validated."""
    config = read_config_file(DEFAULT_CONFIG_PATH)
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    for one in paths:
        if Path(one).resolve() != DEFAULT_CONFIG_PATH:
            config = deep_merge(config, read_config_file(one))
    if overrides:
        config = deep_merge(config, overrides)
    return config


def load_config(path: str | Path | list | tuple | None = None, overrides: dict | None = None) -> dict:
    """:func:`merge_config_files`, validated."""
    return validate_config(merge_config_files(path, overrides))


def sorted_dict(value: Any) -> Any:
    """Recursively sort dict keys, so a reordered config section compares (and hashes) equal."""
    if isinstance(value, dict):
        return {key: sorted_dict(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sorted_dict(item) for item in value]
    return value


def sections(config: dict, *names: str) -> dict:
    """The named config sections as one key-sorted dict: the settings a rule's job reads (its params, the rerun
    trigger, are these less :func:`clemprm.workflow.unread_keys`)."""
    return sorted_dict({name: config[name] for name in names})


# generation.vllm keys that say where and how the server runs, not what it computes: not rerun triggers; the jobs get
# them from the environment (job_environment), as they get HF_HOME
VLLM_SERVER_KEYS = ("url", "python", "startup_timeout_s", "kv_cache_gb", "concurrency")


def policy_model(config: dict) -> dict:
    """The ``model`` section of a stage whose policy generates: with ``generation.backend: vllm``, the backend and the
    server settings that can change what it computes are in it (what :class:`clemprm.models.loader.ModelConfig`
    reads), so switching the backend reruns the stages that generate and no other; with the ``engine`` backend it is
    the ``model`` section as it is."""
    generation = config.get("generation") or {"backend": "engine"}
    if generation["backend"] == "engine":
        return config["model"]
    computing = {key: value for key, value in generation["vllm"].items() if key not in VLLM_SERVER_KEYS}
    return sorted_dict({**config["model"], "backend": generation["backend"], "vllm": computing})


def policy_sections(config: dict, *names: str) -> dict:
    """:func:`sections` of a rule whose policy generates (its ``model`` section: :func:`policy_model`)."""
    params = sections(config, *names)
    params["model"] = policy_model(config)
    return params


def base_rollouts_params(config: dict) -> dict:
    """The ``base_rollouts`` job's settings (its params less :func:`clemprm.workflow.unread_keys`): seed, model,
    games and the section without ``clembench_tree``, which adds an output (missing outputs rerun the job) but
    changes no record: switching it off reruns nothing."""
    params = policy_sections(config, "seed", "model", "games", "base_rollouts")
    params["base_rollouts"] = {key: value for key, value in params["base_rollouts"].items() if key != "clembench_tree"}
    return params


def eval_mode_params(config: dict, mode: str) -> dict:
    """An evaluation mode's settings (its params less :func:`clemprm.workflow.unread_keys`): seed, model, games,
    the eval keys it plays by and the sections it reads (:data:`clemprm.modes.MODES`; ``rl``: its algorithm's, as
    :func:`rl_params` gives it)."""
    spec = MODES[mode]
    params = policy_sections(config, "seed", "model", "games", *(name for name in spec.sections if name != "rl"))
    params["eval"] = {key: config["eval"][key] for key in spec.keys}
    if "rl" in spec.sections:
        params["rl"] = rl_params(config, spec.algorithm)["rl"]
    return sorted_dict(params)


def rl_params(config: dict, algorithm: str) -> dict:
    """The ``rl_adapter`` job of one algorithm of ``rl.algorithms``: its settings (its params less
    :func:`clemprm.workflow.unread_keys`), what
    :func:`clemprm.rl.trainer.train_rl` reads. seed, model, games and the rl section with ``algorithm`` in place of
    the list, and the ``prime`` keys only for PRIME: adding an algorithm to the list, or a PRIME setting, reruns no
    other algorithm's stage."""
    rl = {key: value for key, value in config["rl"].items()
          if key != "algorithms" and (key != "prime" or algorithm == "prime")}
    return sorted_dict({"seed": config["seed"], "model": policy_model(config), "games": config["games"],
                        "rl": {**rl, "algorithm": algorithm}})


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in TRACKED_PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def provenance(settings: dict) -> dict:
    """What made an output: the settings (config sections) it was computed from and package versions."""
    return {"config": sorted_dict(settings), "versions": package_versions()}


def provenance_json(settings: dict) -> str:
    return json.dumps(provenance(settings), sort_keys=True)
