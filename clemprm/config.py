"""The pipeline configuration: loading, schema validation with errors that name the key, and provenance.

The schema (``clemprm/config.schema.yaml``) is the single description of every key; the Snakefile, the
rule scripts and the tests all validate through :func:`validate_config`.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = REPO_ROOT / "config.yaml"

# Packages whose versions are written next to every output.
TRACKED_PACKAGES = ("clemprm", "clemcore", "torch", "transformers", "peft", "trl", "bitsandbytes",
                    "datasets", "pyarrow", "snakemake")


class ConfigError(ValueError):
    """A configuration value that the schema rejects; the message names the offending key."""


def _schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


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


def cross_key_problem(config: dict) -> str | None:
    """An eval mode that plays an RL policy whose algorithm ``rl.algorithms`` does not train; None if none."""
    algorithms = config["rl"]["algorithms"]
    for mode in config["eval"]["modes"]:
        needed = mode.removeprefix("greedy_rl_") if mode.startswith("greedy_rl_") else (
            "prime" if mode == "best_of_n_implicit" else None)
        if needed is not None and needed not in algorithms:
            return (f"config key 'eval.modes': {mode} plays the {needed} policy, but 'rl.algorithms' "
                    f"({', '.join(algorithms)}) does not train it: add {needed} to rl.algorithms or drop the mode")
    return None


def validate_config(config: dict) -> dict:
    """Raise :class:`ConfigError` naming the first bad key (dotted path); return the config unchanged."""
    renamed = renamed_key_problem(config)
    if renamed:
        raise ConfigError(renamed)
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(config), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        first = errors[0]
        key = ".".join(str(part) for part in first.absolute_path) or "<top level>"
        if first.validator == "additionalProperties":
            extra = sorted(set(first.instance) - set(first.schema.get("properties", {})))
            key = ".".join(filter(None, [key if first.absolute_path else "", extra[0]]))
            raise ConfigError(f"config key '{key}': unknown key (allowed: "
                              f"{', '.join(sorted(first.schema.get('properties', {})))})")
        raise ConfigError(f"config key '{key}': {first.message}")
    cross = cross_key_problem(config)
    if cross:
        raise ConfigError(cross)
    return config


def deep_merge(base: dict, override: dict) -> dict:
    """Return ``base`` updated recursively with ``override`` (dicts merge, everything else replaces)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> dict:
    """Load the default config, merge a user config file and overrides on top, validate."""
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    if path is not None and Path(path).resolve() != DEFAULT_CONFIG_PATH:
        config = deep_merge(config, yaml.safe_load(Path(path).read_text()) or {})
    if overrides:
        config = deep_merge(config, overrides)
    return validate_config(config)


def sorted_dict(value: Any) -> Any:
    """Recursively sort dict keys, so a reordered config section compares (and hashes) equal."""
    if isinstance(value, dict):
        return {key: sorted_dict(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sorted_dict(item) for item in value]
    return value


def sections(config: dict, *names: str) -> dict:
    """The named config sections as one key-sorted dict: a rule's ``params`` (its rerun trigger)."""
    return sorted_dict({name: config[name] for name in names})


# The eval keys each evaluation mode plays by. A mode rule's params hold only these (plus seed, model, games and,
# for the PRM modes, prm): changing eval.bootstrap_samples reruns the summary alone, eval.beam_width beam_search.
_EVAL_PLAY = ("split", "episodes_per_instance", "max_new_tokens")
_EVAL_SAMPLING = ("n", "temperature", "top_p")
EVAL_MODE_KEYS = {"greedy_base": _EVAL_PLAY, "greedy_sft": _EVAL_PLAY,
                  "greedy_rl_grpo": _EVAL_PLAY, "greedy_rl_prime": _EVAL_PLAY,   # the RL policy of each algorithm
                  "random_of_n": _EVAL_PLAY + _EVAL_SAMPLING,
                  "best_of_n": _EVAL_PLAY + _EVAL_SAMPLING, "best_of_n_implicit": _EVAL_PLAY + _EVAL_SAMPLING,
                  "beam_search": _EVAL_PLAY + _EVAL_SAMPLING + ("beam_width", "num_beam_iterations", "aggregation"),
                  "greedy_merged": _EVAL_PLAY}
# the searches ranking candidates by the policy's own mean token log-probability instead of the PRM
EVAL_MODE_KEYS.update({"best_of_n_logprob": EVAL_MODE_KEYS["best_of_n"],
                       "beam_search_logprob": EVAL_MODE_KEYS["beam_search"]})
# two greedy attempts per instance, SFT and SCoRe policy (clemprm.rl.self_correction; its rule adds the score section)
EVAL_MODE_KEYS["self_correct"] = _EVAL_PLAY
EVAL_PRM_MODES = ("best_of_n", "beam_search")


def eval_mode_params(config: dict, mode: str) -> dict:
    """An evaluation mode rule's ``params`` (its rerun trigger), see :data:`EVAL_MODE_KEYS`."""
    params = sections(config, "seed", "model", "games", *(["prm"] if mode in EVAL_PRM_MODES else []))
    params["eval"] = {key: config["eval"][key] for key in EVAL_MODE_KEYS[mode]}
    return sorted_dict(params)


def rl_params(config: dict, algorithm: str) -> dict:
    """The ``rl_adapter`` job of one algorithm of ``rl.algorithms``: its ``params`` (rerun trigger) and the settings
    :func:`clemprm.rl.trainer.train_rl` reads. seed, model, games and the rl section with ``algorithm`` in place of
    the list, and the ``prime`` keys only for PRIME: adding an algorithm to the list, or a PRIME setting, reruns no
    other algorithm's stage."""
    rl = {key: value for key, value in config["rl"].items()
          if key != "algorithms" and (key != "prime" or algorithm == "prime")}
    return sorted_dict({"seed": config["seed"], "model": config["model"], "games": config["games"],
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
