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

from clemprm.modes import MODES, RL_ALGORITHMS

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG_PATH = REPO_ROOT / "config.yaml"

# Packages whose versions are written next to every output.
TRACKED_PACKAGES = ("clemprm", "clemcore", "torch", "transformers", "peft", "trl", "bitsandbytes",
                    "datasets", "pyarrow", "snakemake")


class ConfigError(ValueError):
    """A configuration value that the schema rejects; the message names the offending key."""


def _schema() -> dict:
    """The config schema, with the eval modes and RL algorithms of :mod:`clemprm.modes` as the allowed values."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    schema["properties"]["eval"]["properties"]["modes"]["items"] = {"enum": list(MODES)}
    schema["properties"]["rl"]["properties"]["algorithms"]["items"] = {"enum": list(RL_ALGORITHMS)}
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


def cross_key_problem(config: dict) -> str | None:
    """An eval mode that needs an RL policy whose algorithm ``rl.algorithms`` does not train; None if none."""
    algorithms = config["rl"]["algorithms"]
    for mode in config["eval"]["modes"]:
        needed = MODES[mode].algorithm
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


def eval_mode_params(config: dict, mode: str) -> dict:
    """An evaluation mode's ``params`` (its rerun trigger): seed, model, games, the eval keys it plays by and the
    sections it reads (:data:`clemprm.modes.MODES`; ``rl``: its algorithm's, as :func:`rl_params` gives it)."""
    spec = MODES[mode]
    params = sections(config, "seed", "model", "games", *(name for name in spec.sections if name != "rl"))
    params["eval"] = {key: config["eval"][key] for key in spec.keys}
    if "rl" in spec.sections:
        params["rl"] = rl_params(config, spec.algorithm)["rl"]
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
