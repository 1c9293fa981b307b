"""Bad config and inputs stop the run when the Snakefile is parsed, naming the key or the file: integer keys given as
floats, no game, unknown experiments, a model cache under results/, model folders that are none, hub ids the jobs
cannot download, clemgame.json files without a game_name; config files that are not valid YAML
(``clemprm check-config``, since Snakemake reads its ``--configfile``s before the Snakefile runs)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clemprm.checks.parse_time import ConfigInputError, check_config_inputs
from clemprm.cli import main
from clemprm.config import (ConfigError, _schema, hub_offline_reason, job_environment, load_config, validate_config)

REPO = Path(__file__).resolve().parent.parent
DEFAULT = load_config()


# --------------------------------------------------------------------------------- integer keys (schema)


def integer_keys(schema: dict, root: dict, path: tuple = ()):
    """The dotted path of every key the schema types as an integer (through $ref and oneOf)."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    types = schema.get("type")
    if "integer" in (types if isinstance(types, list) else [types]):
        yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from integer_keys(sub, root, path + (name,))
    for sub in schema.get("oneOf", []) + schema.get("anyOf", []):
        yield from integer_keys(sub, root, path)


INTEGER_KEYS = {".".join(path): sub for path, sub in integer_keys(_schema(), _schema())}


def test_the_walk_finds_the_integer_keys():
    assert {"labels.k", "labels.shards", "base_rollouts.episodes_per_instance", "model.token_budget",
            "sft.max_examples", "rl.lora.r", "rl.states.max_per_episode", "seed"} <= set(INTEGER_KEYS)


@pytest.mark.parametrize("key", sorted(INTEGER_KEYS))
def test_every_integer_key_rejects_a_whole_number_float_naming_the_key(key):
    config = copy.deepcopy(DEFAULT)
    *parents, name = key.split(".")
    section = config
    for part in parents:
        if section.get(part) is None:   # rl.lora: null (train the SFT adapter) or a LoRA
            section[part] = copy.deepcopy(DEFAULT["sft"]["lora"])
        section = section[part]
    default = section.get(name)
    value = float(default) if isinstance(default, int) else float(INTEGER_KEYS[key].get("minimum", 1))
    section[name] = value
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}': {value} is not of type 'integer'")):
        validate_config(config)


def snakemake_dry_run(workdir: Path, config: dict) -> subprocess.CompletedProcess:
    (workdir / "user.yaml").write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "-n",
                           "--cores", "1", "--directory", str(workdir), "--configfile", str(workdir / "user.yaml")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_a_float_shard_count_stops_the_snakefile_naming_the_key(tmp_path):
    """labels.shards is read by rules/labels.smk at parse time: 2.0 stopped it with a bare TypeError of range()."""
    done = snakemake_dry_run(tmp_path, {"labels": {"shards": 2.0}})
    assert done.returncode != 0
    assert "config key 'labels.shards': 2.0 is not of type 'integer'" in done.stdout + done.stderr
    assert "TypeError" not in done.stdout + done.stderr


# ------------------------------------------------------------------------------------------------- games


def test_a_run_needs_at_least_one_game():
    with pytest.raises(ConfigError, match=r"config key 'games.builtin': no game to play: games.builtin is empty and "
                                          r"games.clembench_games names none"):
        load_config(overrides={"games": {"builtin": []}})
    load_config(overrides={"games": {"builtin": [], "clembench_games": ["wordle"], "clembench_path": "cb"}})


def fake_checkout(root: Path, specs: dict[str, list]) -> Path:
    """A clembench checkout: per folder, its clemgame.json's specs; each game's in/instances.json holds experiments
    e1 and e2."""
    for folder, folder_specs in specs.items():
        (root / folder / "in").mkdir(parents=True)
        (root / folder / "clemgame.json").write_text(json.dumps(folder_specs))
        (root / folder / "in" / "instances.json").write_text(json.dumps(
            {"experiments": [{"name": name, "game_instances": [{"game_id": 0}]} for name in ("e1", "e2")]}))
    return root


def problems_of(**overrides) -> str:
    with pytest.raises(ConfigInputError) as error:
        check_config_inputs(load_config(overrides=overrides))
    return str(error.value)


def test_unknown_experiments_and_unconfigured_games_in_games_experiments(tmp_path):
    checkout = fake_checkout(tmp_path / "cb", {"pair": [{"game_name": "pair"}]})
    check_config_inputs(load_config(overrides={"games": {"experiments": {"guessnumber": ["range10"]}}}))
    message = problems_of(games={"experiments": {"guessnumber": ["range10", "range1000"], "hanabi": ["small"]}})
    assert ("games.experiments.guessnumber: no experiment 'range1000' in game 'guessnumber' (known: range10, range100, "
            "range20, range50)") in message
    assert "games.experiments.hanabi: 'hanabi' is not a configured game (games.builtin: guessnumber, wordref" in message
    games = {"clembench_path": str(checkout), "clembench_games": ["pair"]}
    check_config_inputs(load_config(overrides={"games": {**games, "experiments": {"pair": ["e2"]}}}))
    assert ("games.experiments.pair: no experiment 'e3' in game 'pair' (known: e1, e2)"
            in problems_of(games={**games, "experiments": {"pair": ["e3"]}}))


def test_a_model_cache_under_results_is_refused_at_parse_time(monkeypatch):
    assert "cache_dir: the model cache" in problems_of(cache_dir="results/models")
    assert "lies under results/" in problems_of(cache_dir="results/models")
    monkeypatch.setenv("CLEMPRM_CACHE", "results")
    assert "$CLEMPRM_CACHE (cache_dir is null): the model cache" in problems_of()


def test_a_clemgame_json_without_a_game_name_is_named(tmp_path):
    checkout = fake_checkout(tmp_path / "cb", {"pair": [{"game_name": "pair"}], "nameless": [{"players": 1}]})
    message = problems_of(games={"clembench_path": str(checkout), "clembench_games": ["pair"]})
    assert f"{checkout / 'nameless' / 'clemgame.json'}: a game spec without a game_name" in message


# ------------------------------------------------------------------------------------------------ models


def model_folder(path: Path, *files: str) -> Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text("{}")
    return path


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Hub access off, as HF_HUB_OFFLINE=1 sets it, with an empty hub cache of its own."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return str(tmp_path / "hf")


@pytest.fixture
def online(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def test_a_path_like_model_spec_must_be_a_model_folder(offline, tmp_path):
    model_folder(tmp_path / "models" / "empty")
    model_folder(tmp_path / "models" / "good", "config.json", "tokenizer.json")
    assert "model.spec: model folder models/x does not exist" in problems_of(model={"spec": "models/x"})
    assert "model.spec: model folder ./x does not exist" in problems_of(model={"spec": "./x"})
    message = problems_of(model={"spec": "models/empty"}, hf_home=offline)
    assert "model.spec: model folder models/empty holds no config.json" in message
    assert "model.spec: model folder models/empty holds no tokenizer" in message
    check_config_inputs(load_config(overrides={"model": {"spec": "models/good"}, "hf_home": offline}))
    check_config_inputs(load_config(overrides={"model": {"spec": str(tmp_path / "models" / "good")}}))
    assert ("prm.base_model: model folder models/empty holds no config.json"
            in problems_of(prm={"base_model": "models/empty"}))


def test_a_hub_id_needs_hub_access_or_the_hub_cache(offline, tmp_path):
    message = problems_of(model={"spec": "org/model"}, hf_home=offline)
    assert message.splitlines()[1] == (
        f"  - model.spec: org/model is not a local folder (relative to {tmp_path}), and as a hub id it cannot be "
        f"downloaded: hub access is off (HF_HUB_OFFLINE=1 in the environment) and the hub cache {offline}/hub does "
        f"not hold it")
    snapshot = Path(offline) / "hub" / "models--org--model" / "snapshots" / "abc"
    model_folder(snapshot, "config.json")
    (Path(offline) / "hub" / "models--org--model" / "refs").mkdir()
    (Path(offline) / "hub" / "models--org--model" / "refs" / "main").write_text("abc")
    check_config_inputs(load_config(overrides={"model": {"spec": "org/model"}, "hf_home": offline}))
    assert "model.spec: bad id! is neither a local folder" in problems_of(model={"spec": "bad id!"})


def test_hub_access_follows_the_jobs_environment(online):
    check_config_inputs(load_config(overrides={"model": {"spec": "org/model"}}))   # downloaded by the job
    # an embedded model.spec makes the jobs offline: a PRM base model from the hub would not download
    message = problems_of(prm={"base_model": "org/model"})
    assert ("prm.base_model: org/model is not a local folder" in message
            and "hub access is off (model.spec embedded:smollm2-135m-instruct is an embedded or tiny model, so the "
                "jobs set HF_HUB_OFFLINE=1; export HF_HUB_OFFLINE=0 to let them download)" in message)
    config = load_config(overrides={"model": {"spec": "tiny:0"}})
    assert job_environment(config, {}) == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    assert job_environment(config, {"HF_HUB_OFFLINE": "0"}) == {"TRANSFORMERS_OFFLINE": "1"}
    assert hub_offline_reason(config, {"HF_HUB_OFFLINE": "0"}) is None
    assert hub_offline_reason(load_config(overrides={"model": {"spec": "org/model"}}), {}) is None
    assert hub_offline_reason(load_config(overrides={"model": {"spec": "org/model"}}),
                              {"TRANSFORMERS_OFFLINE": "yes"}) == "TRANSFORMERS_OFFLINE=yes in the environment"


def test_the_adapter_must_be_a_peft_adapter_folder(tmp_path):
    assert "model.adapter: adapter folder nowhere does not exist" in problems_of(model={"adapter": "nowhere"})
    model_folder(tmp_path / "adapter", "config.json")
    message = problems_of(model={"adapter": "adapter"})
    assert "model.adapter: adapter folder adapter holds no adapter_config.json (a PEFT adapter folder)" in message
    assert "model.adapter: adapter folder adapter holds no weights" in message
    model_folder(tmp_path / "good", "adapter_config.json", "adapter_model.safetensors")
    check_config_inputs(load_config(overrides={"model": {"adapter": "good"}}))


# ----------------------------------------------------------------------------------------- config files


def test_check_config_names_the_config_file_that_is_not_valid_yaml(tmp_path, capsys):
    """Snakemake reads --configfile files before the Snakefile runs and says only `Config file is not valid JSON or
    YAML`: `clemprm check-config` names the file."""
    (tmp_path / "good.yaml").write_text("labels:\n  k: 2\n")
    (tmp_path / "bad.yaml").write_text("labels:\n  k: [2\n  shards: 3\n")
    assert main(["check-config", "good.yaml", "bad.yaml"]) == 2
    assert capsys.readouterr().err.startswith("clemprm check-config: config file bad.yaml: not valid YAML at line 3, "
                                              "column 9: expected ',' or ']'")
    assert main(["check-config", "good.yaml"]) == 0
    (tmp_path / "float.yaml").write_text("labels:\n  k: 4.0\n")
    assert main(["check-config", "--schema-only", "good.yaml", "float.yaml"]) == 2
    assert "config key 'labels.k': 4.0 is not of type 'integer'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="config file bad.yaml: not valid YAML"):
        load_config(["good.yaml", "bad.yaml"])


def test_the_vllm_backend_needs_a_server_or_a_python_to_start_one(tmp_path):
    assert "set generation.vllm.url (a running vLLM server) or generation.vllm.python" in problems_of(
        generation={"backend": "vllm"})
    assert f"generation.vllm.python: {tmp_path}/none is not an executable file" in problems_of(
        generation={"backend": "vllm", "vllm": {"python": str(tmp_path / "none")}})
    check_config_inputs(load_config(overrides={"generation": {"backend": "vllm", "vllm": {"url": "http://h:8000"}}}))
    check_config_inputs(load_config(overrides={"generation": {"backend": "engine"}}))
