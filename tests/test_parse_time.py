"""Bad config and inputs stop the run when the Snakefile is parsed, naming the key or the file: integer keys given as
floats, no game, unknown experiments, a model cache under results/, model folders that are none, hub ids the jobs
cannot download, clemgame.json files without a game_name; config files that are not valid YAML
(``clemprm check-config``, since Snakemake reads its ``--configfile``s before the Snakefile runs)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from clemprm.checks.game_code import install_hint
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


def default_with_section_of(key: str) -> tuple[dict, dict, str]:
    """A copy of the default config, the section in it that holds the dotted ``key`` and the key's own name (a null
    section on the way, such as rl.lora, becomes a LoRA section)."""
    config = copy.deepcopy(DEFAULT)
    *parents, name = key.split(".")
    section = config
    for part in parents:
        if section.get(part) is None:   # rl.lora: null (train the SFT adapter) or a LoRA
            section[part] = copy.deepcopy(DEFAULT["sft"]["lora"])
        section = section[part]
    return config, section, name


@pytest.mark.parametrize("key", sorted(INTEGER_KEYS))
def test_every_integer_key_rejects_a_whole_number_float_naming_the_key(key):
    config, section, name = default_with_section_of(key)
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
    """Hub access on, the hub a local port that accepts connections (this machine may have no network)."""
    import socket

    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{hub.getsockname()[1]}")
        yield


def test_a_hub_id_the_cache_does_not_hold_and_no_network_can_fetch_is_named_before_any_job(online, monkeypatch,
                                                                                          tmp_path):
    """It passed parse time, and base_rollouts failed after 57 s of retries naming neither model.spec nor the cure."""
    import socket

    from huggingface_hub import constants

    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")   # nothing listens there
    message = problems_of(model={"spec": "org/model"}, hf_home=str(tmp_path / "hf"))
    assert (f"model.spec: org/model is not a local folder (relative to {tmp_path}) nor in the hub cache "
            f"{tmp_path}/hf/hub, and http://127.0.0.1:{port} cannot be reached" in message)
    assert "hf download org/model" in message and "HF_HUB_OFFLINE=1" in message


def test_a_job_that_cannot_load_a_hub_id_names_model_spec_and_the_cure(monkeypatch, tmp_path):
    from clemprm.models.loader import ModelConfig, load_tokenizer_and_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(OSError, match=r"model spec org/model-not-cached: the hub id org/model-not-cached could not "
                                      r"be loaded: .*HF_HUB_OFFLINE is on.*hf download org/model-not-cached"):
        load_tokenizer_and_model(ModelConfig(spec="org/model-not-cached"))


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


def python_with_vllm(folder: Path) -> str:
    """A Python in which a module ``vllm`` is found: this one, started with a folder holding a ``vllm`` package on
    its path (what the parse-time check asks it: where vllm is, not to import it)."""
    (folder / "site" / "vllm").mkdir(parents=True)
    (folder / "site" / "vllm" / "__init__.py").write_text("")
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={folder / "site"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_the_vllm_python_must_have_vllm(tmp_path):
    """A Python without vLLM passed parse time and failed in base_rollouts with `No module named 'vllm'`, key not
    named."""
    assert (f"generation.vllm.python: {sys.executable} does not find the module vllm (not installed in it): give the "
            f"Python of a virtualenv with vLLM") in problems_of(generation={"backend": "vllm",
                                                                           "vllm": {"python": sys.executable}})


def test_the_vllm_backend_needs_a_server_or_a_python_to_start_one(tmp_path):
    assert "set generation.vllm.url (a running vLLM server) or generation.vllm.python" in problems_of(
        generation={"backend": "vllm"})
    assert f"generation.vllm.python: {tmp_path}/none is not an executable file" in problems_of(
        generation={"backend": "vllm", "vllm": {"python": str(tmp_path / "none")}})
    check_config_inputs(load_config(overrides={"generation": {"backend": "vllm", "vllm": {"python": python_with_vllm(
        tmp_path)}}}))
    check_config_inputs(load_config(overrides={"generation": {"backend": "vllm", "vllm": {"url": "http://h:8000"}},
                                               "eval": {"modes": ["greedy_sft", "best_of_n"]}}))
    check_config_inputs(load_config(overrides={"generation": {"backend": "engine"}}))


@pytest.mark.parametrize("args, flag", [
    (["--host", "0.0.0.0"], "--host"), (["--host=0.0.0.0"], "--host"), (["--ho", "0.0.0.0"], "--host"),
    (["--port", "8000"], "--port"), (["--port=8000"], "--port"),
    (["--api-key", "mine"], "--api-key"), (["--api-key=mine"], "--api-key"), (["--api_key", "mine"], "--api-key")])
def test_vllm_args_may_not_set_what_the_job_sets(tmp_path, args, flag):
    """``generation.vllm.args: [--host, 0.0.0.0]`` came after the job's own --host: the server listened on every
    interface, without a word. Each flag the job sets, in each form vLLM's parser reads (``=value``, underscores,
    abbreviations), is refused naming the key; other flags pass."""
    python = python_with_vllm(tmp_path)
    message = problems_of(generation={"backend": "vllm", "vllm": {"python": python,
                                                                  "args": ["--enforce-eager", *args]}})
    assert f"generation.vllm.args: {args[0]} sets {flag}, which the job sets itself (" in message
    assert message.count("generation.vllm.args") == 1
    check_config_inputs(load_config(overrides={"generation": {"backend": "vllm", "vllm": {
        "python": python, "args": ["--enforce-eager", "--max-num-seqs", "8", "--hf-overrides={}"]}}}))


# ------------------------------------------------------------------------------ NaN and infinity (schema)


def number_keys(schema: dict, root: dict, path: tuple = ()):
    """The dotted path of every key the schema types as a number (through $ref and oneOf/anyOf)."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    types = schema.get("type")
    if "number" in (types if isinstance(types, list) else [types]):
        yield path
    for name, sub in schema.get("properties", {}).items():
        yield from number_keys(sub, root, path + (name,))
    for sub in schema.get("oneOf", []) + schema.get("anyOf", []):
        yield from number_keys(sub, root, path)


NUMBER_KEYS = sorted({".".join(path) for path in number_keys(_schema(), _schema())})


def test_the_walk_finds_the_number_keys():
    assert {"labels.temperature", "win_filter.min_bench_score", "sft.lr", "sft.epochs", "eval.ci"} <= set(NUMBER_KEYS)


@pytest.mark.parametrize("key", NUMBER_KEYS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_number_key_refuses_nan_and_infinity_naming_the_key(key, value):
    """jsonschema's minimum and maximum never fail on NaN, and .inf passes exclusiveMinimum: 0: a NaN label temperature
    ran every continuation to its token limit."""
    config, section, name = default_with_section_of(key)
    section[name] = value
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}': {value} is not a finite number")):
        validate_config(config)


@pytest.mark.parametrize("config, message", [
    ({"labels": {"temperature": float("nan")}}, "config key 'labels.temperature': nan is not a finite number"),
    ({"win_filter": {"min_bench_score": float("nan")}},
     "config key 'win_filter.min_bench_score': nan is not a finite number"),
    ({"sft": {"epochs": float("inf")}}, "config key 'sft.epochs': inf is not a finite number"),
    ({"cache_dir": "a_file"}, "cache_dir: the model cache {workdir}/a_file is a file, not a folder"),
], ids=["temperature", "min_bench_score", "epochs", "cache_dir"])
def test_snakemake_stops_before_any_job_naming_the_key(tmp_path, config, message):
    (tmp_path / "a_file").write_text("not a folder")
    done = snakemake_dry_run(tmp_path, config)
    assert done.returncode != 0
    assert message.format(workdir=tmp_path) in done.stdout + done.stderr
    assert "Job stats" not in done.stdout + done.stderr   # no job was planned


# ------------------------------------------------------------------------------------- the model cache


def test_a_model_cache_that_is_a_file_or_empty_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    assert f"cache_dir: the model cache {tmp_path}/a_file is a file, not a folder" in problems_of(cache_dir="a_file")
    assert (f"cache_dir: the model cache {tmp_path}/a_file/models cannot be created: {tmp_path}/a_file is a file, "
            f"not a folder") in problems_of(cache_dir="a_file/models")
    assert "cache_dir: '' names no folder: give a folder for the model cache, or null" in problems_of(cache_dir="")
    check_config_inputs(load_config(overrides={"cache_dir": "new/cache"}))   # created by the first job


WRITABLE_PROBE = """
import os
import sys
from pathlib import Path
from clemprm.checks.model_inputs import writable_folder_problem
if os.geteuid() == 0:   # root writes into any folder: check as nobody, as a user's account sees it
    os.setgid(65534)
    os.setuid(65534)
for folder in sys.argv[1:]:
    print(writable_folder_problem(Path(folder)))
"""


def test_a_read_only_model_cache_is_refused(tmp_path):
    """As another account than root (root writes into any folder; the check then runs as nobody): a read-only folder,
    or a missing one whose parent is read-only, is refused; a writable one passes."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))   # where nobody may look (tmp_path's parent is root's alone)
    try:
        base.chmod(0o755)
        (base / "ro").mkdir(mode=0o555)
        (base / "rw").mkdir(mode=0o777)
        (base / "ro").chmod(0o555)
        (base / "rw").chmod(0o777)
        folders = [str(base / "ro"), str(base / "ro" / "cache"), str(base / "rw"), str(base / "rw" / "cache")]
        done = subprocess.run([sys.executable, "-c", WRITABLE_PROBE, *folders], capture_output=True, text=True,
                              cwd="/", timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            "is not writable by this account (choose a folder the jobs can write into)",
            f"cannot be created: {base / 'ro'} is not writable by this account (choose a folder the jobs can write "
            f"into)", "None", "None"]
    finally:
        shutil.rmtree(base)


# ---------------------------------------------------------------------------------- game files as Python


def checkout_with_code(root: Path, masters: dict[str, bytes]) -> Path:
    """A clembench checkout of one-player games whose master.py holds the given bytes."""
    fake_checkout(root, {name: [{"game_name": name, "players": 1}] for name in masters})
    for name, code in masters.items():
        (root / name / "master.py").write_bytes(code)
    return root


def test_game_files_are_read_as_python_reads_them_and_every_problem_is_listed(tmp_path, capsys):
    """A master.py with a byte-order mark, or in latin-1 with a coding line, is valid Python; one with a syntax error
    is a problem among the others, not a traceback of check-config."""
    checkout = checkout_with_code(tmp_path / "cb", {
        "bom": b"\xef\xbb\xbfimport json\n",
        "latin": "# -*- coding: latin-1 -*-\nNAME = 'caf\xe9'\nimport json\n".encode("latin-1"),
        "broken": b"import json\ndef play(:\n",
        "undeclared": "NAME = 'caf\xe9'\n".encode("latin-1")})
    good = {"clembench_path": str(checkout), "clembench_games": ["bom", "latin"]}
    check_config_inputs(load_config(overrides={"games": good}))
    (tmp_path / "games.yaml").write_text(yaml.safe_dump({"games": {
        "clembench_path": str(checkout), "clembench_games": ["bom", "latin", "broken", "undeclared"],
        "parse_mode_overrides": {"chess": "strict"}}}))
    assert main(["check-config", str(tmp_path / "games.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"game 'broken': cannot read its code: {checkout}/broken/master.py, line 2: invalid syntax" in err
    assert (f"game 'undeclared': cannot read its code: {checkout}/undeclared/master.py, line 1: invalid or missing "
            f"encoding declaration (Python reads a file in the coding of its coding line, else in UTF-8)") in err
    assert "games.parse_mode_overrides names 'chess', which is not a game this run plays" in err   # listed too
    assert "'bom'" not in err and "'latin'" not in err


def test_a_missing_package_is_named_with_what_installs_it(tmp_path):
    """clingo (adventuregame) is not in clemprm's clembench extra: the hint names the package, not the extra."""
    checkout = checkout_with_code(tmp_path / "cb", {"logic": b"import clingo\n"})
    assert ("game 'logic' imports clingo, not installed here (pip install clingo (not in clemprm's clembench extra))"
            in problems_of(games={"clembench_path": str(checkout), "clembench_games": ["logic"]}))
    assert install_hint(["clingo", "lark", "sklearn"]) == ('pip install -e ".[clembench]" installs lark; pip install '
                                                           "clingo scikit-learn (not in clemprm's clembench extra)")


# ----------------------------------------------------------------------- rows and keys that match nothing


def test_instance_list_rows_that_match_nothing_are_listed(tmp_path, monkeypatch):
    """An unknown task_id, a misspelled game, a split that does not exist or that the game does not hold the instance
    in: an error listing the first few and the count; a warning with the same list under on_failure: continue. Rows
    of a game the run could play but does not (hanabi here) are another run's."""
    monkeypatch.chdir(tmp_path)
    rows = ["guessnumber,range10,0,train", "guessnumber,range10,99,train", "guesnumber,range10,0,train",
            "guessnumber,range10,1,dev", "guessnumber,range10,2,Validation", "guessnumber,range10,3,test",
            "guessnumber,range10,0,validation", "hanabi,small,0,train"]
    (tmp_path / "list.csv").write_text("game,experiment,task_id,split\n" + "\n".join(rows) + "\n")
    message = problems_of(games={"instance_list": "list.csv"})
    assert ("games.instance_list: 6 of 8 rows of list.csv match no instance of a played game "
            "(game/experiment/task_id/split): guesnumber/range10/0/train; guessnumber/range10/0/validation; "
            "guessnumber/range10/1/dev; guessnumber/range10/2/Validation; guessnumber/range10/3/test and 1 more "
            "(splits: train, validation, test; games: guessnumber, wordref, oddoneout)") in message
    warnings = check_config_inputs(load_config(overrides={"games": {"instance_list": "list.csv"},
                                                          "on_failure": "continue"}))
    assert warnings == [message.split("\n  - ")[1]]
    (tmp_path / "good.csv").write_text("game,experiment,task_id,split\n" + rows[0] + "\n")
    assert check_config_inputs(load_config(overrides={"games": {"instance_list": "good.csv"}})) == []


def test_keys_naming_games_that_are_not_played_are_refused(tmp_path):
    message = problems_of(games={"parse_mode_overrides": {"hanabi": "strict"}, "instances_files": {"taboo": "v2"},
                                 "clembench_path": str(tmp_path / "nowhere")})
    assert "games.parse_mode_overrides names 'hanabi', which is not a game this run plays (games.builtin: " in message
    assert "games.instances_files names 'taboo', which is not a game this run plays" in message
    assert (f"games.clembench_path: {tmp_path}/nowhere is not a directory (a clembench checkout; null when no "
            f"clembench game is played)") in message


def test_an_instances_file_for_a_built_in_game_is_refused_before_any_job():
    """games.instances_files: {guessnumber: ../../etc/passwd} was accepted: the escape check covered clembench games."""
    message = problems_of(games={"instances_files": {"guessnumber": "../../etc/passwd"}})
    assert ("games.instances_files names 'guessnumber', a built-in game: its instances are built in "
            "(clemprm/games/guessnumber/in/, one file per split)") in message


def test_a_key_set_twice_in_a_config_file_is_refused_naming_key_and_file(tmp_path, capsys):
    (tmp_path / "twice.yaml").write_text("labels:\n  k: 4\n  temperature: 1.0\n  k: 8\n")
    assert main(["check-config", str(tmp_path / "twice.yaml")]) == 2
    assert (f"config file {tmp_path}/twice.yaml, line 4: key 'k' is set twice (first at line 2; YAML would keep the "
            f"last silently)") in capsys.readouterr().err
    (tmp_path / "sections.yaml").write_text("labels: {k: 4}\nsft: {lr: 1.0e-4}\nlabels: {k: 8}\n")
    with pytest.raises(ConfigError, match="line 3: key 'labels' is set twice"):
        load_config(str(tmp_path / "sections.yaml"))


def test_a_nested_command_line_value_suggests_a_config_file():
    """snakemake --config 'labels={k: 8}' passes k as the text '8'."""
    config = copy.deepcopy(DEFAULT)
    config["labels"]["k"] = "8"
    with pytest.raises(ConfigError, match=re.escape(
            "config key 'labels.k': '8' is not of type 'integer' (Snakemake passes a nested --config value as text: "
            "set labels.k in a config file and pass it with --configfile)")):
        validate_config(config, {"labels": {"k": "8"}})
    with pytest.raises(ConfigError, match=r"not of type 'integer'$"):   # not from the command line: no such advice
        validate_config(config)


def test_extra_sft_data_that_is_not_an_interactions_table_is_refused_before_any_job(tmp_path):
    """sft.extra_data: /etc/passwd was accepted at parse time; the SFT job failed on it."""
    files = {"passwd.jsonl": "root:x:0:0:root:/root:/bin/bash\n", "rows.jsonl": '{"text": "no messages"}\n',
             "notes.txt": "hello\n", "good.jsonl": '{"messages": [{"role": "user", "content": "hi"}], "meta": {}}\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    expected = {"passwd.jsonl": "(cannot read interactions file", "notes.txt": "unsupported format '.txt'",
                "rows.jsonl": "needs `messages` (a list) and `meta` (a mapping)"}
    for name, reason in expected.items():
        message = problems_of(sft={"extra_data": str(tmp_path / name)})
        assert f"sft.extra_data: {tmp_path / name} is not a playpen-data interactions table" in message
        assert reason in message
    check_config_inputs(load_config(overrides={"sft": {"extra_data": str(tmp_path / "good.jsonl")}}))


# -------------------------------------------------------------------- check-config and Snakemake agree


@pytest.mark.parametrize("text, message", [
    ("# nothing but a comment\n", "config file {path}: it sets no key (it is empty, or only comments)"),
    ("score:\n  games: [wordref]\n", "config key 'score.games': 'wordref' is not a single-player game"),
    ("games:\n  instance_list: missing.csv\n", "games.instance_list: missing.csv is not a file"),
    ("sft:\n  extra_data: missing.jsonl\n", "sft.extra_data: missing.jsonl is not a file"),
], ids=["empty", "two_player_score_game", "instance_list", "extra_data"])
def test_check_config_and_snakemake_refuse_the_same_configs(tmp_path, monkeypatch, capsys, text, message):
    """One check function behind both: what stops the Snakefile at parse time (or Snakemake before it), check-config
    refuses too, with the same message."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "user.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 2
    assert message.format(path=path) in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "-n",
                           "--cores", "1", "--directory", str(tmp_path), "--configfile", str(path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert ("Config file must be given as JSON or YAML with keys at top level" in output if text.startswith("#")
            else message.format(path=path) in output)


# ------------------------------------------------- found in a job: a failure names every game it is about


def test_every_game_whose_episodes_all_failed_is_named(caplog):
    """The default model.max_context_tokens (2048) is too short for some clembench games' first prompts: every
    such game is named, not only the first."""
    from clemprm.checks.run_time import StageFailure, check_episodes

    error = "context too long: 2300 > 2048 tokens (model.max_context_tokens; raise it, or set it to auto: ...)"
    rows = [{"game": game, "episode_id": f"{game}-{i}", "error": error if game != "fine" else None}
            for game in ("taboo", "fine", "wordle") for i in range(2)]
    with pytest.raises(StageFailure, match=re.escape(
            f"base_rollouts: every episode of 2 games: taboo: 2 of 2 episodes failed, first error: taboo-0: {error}; "
            f"wordle: 2 of 2 episodes failed, first error: wordle-0: {error} (set `on_failure: continue`")):
        check_episodes("base_rollouts", rows, "stop")
    marks = check_episodes("base_rollouts", rows, "continue")
    assert [(mark.game, mark.count, mark.condition) for mark in marks] == [("taboo", 2, "all_episodes_failed"),
                                                                           ("wordle", 2, "all_episodes_failed")]


def test_a_clemgame_json_that_is_not_utf8_is_named(tmp_path):
    checkout = fake_checkout(tmp_path / "cb", {"pair": [{"game_name": "pair"}]})
    (checkout / "pair" / "clemgame.json").write_bytes('[{"game_name": "pair", "note": "caf\xe9"}]'.encode("latin-1"))
    message = problems_of(games={"clembench_path": str(checkout), "clembench_games": ["pair"]})
    assert f"{checkout}/pair/clemgame.json: not valid JSON ('utf-8' codec can't decode" in message


# ------------------------------------------------------- issue 57: inputs that failed late, now named before any job


def test_lora_target_modules_that_name_no_module_of_the_model_are_refused(test_cache_dir):
    """PEFT failed inside the job on a list that matched nothing (key not named) and trained q_proj alone on
    [q_proj, vproj] without a word. The module names come from the model's config on the meta device and are kept in
    the model cache: a second check reads them from there."""
    model = {"spec": "tiny:0"}
    message = problems_of(cache_dir=test_cache_dir, model=model, sft={"lora": {"target_modules": ["nonexistent_proj"]}},
                          prm={"lora": {"target_modules": ["q_proj", "vproj"]}})
    assert ("sft.lora.target_modules: nonexistent_proj names no module of tiny:0 (PEFT would fail in the job; its "
            "layers LoRA can adapt: down_proj, embed_tokens, gate_proj,") in message
    assert "prm.lora.target_modules: vproj names no module of tiny:0 (PEFT would train the others alone;" in message
    assert len(list((Path(test_cache_dir) / "module-names").glob("*.json"))) == 2   # causal LM and score head
    check_config_inputs(load_config(overrides={
        "cache_dir": test_cache_dir, "model": model, "sft": {"lora": {"target_modules": ["q_proj", "mlp.up_proj"]}},
        "rl": {"algorithms": ["grpo"], "lora": {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["lm_head"]}}}))
    # lm_head is the policy's, not the PRM's (a score head): named for prm.lora
    assert "prm.lora.target_modules: lm_head names no module of tiny:0" in problems_of(
        cache_dir=test_cache_dir, model=model, prm={"lora": {"target_modules": ["lm_head"]}})


def test_a_prm_adapter_is_refused_as_the_policy_adapter(tmp_path):
    """A sequence-classification (PRM) adapter as model.adapter was accepted: the policy played with it, and only
    PEFT's "missing adapter keys" warning in a log said anything."""
    model_folder(tmp_path / "prm", "adapter_model.safetensors")
    (tmp_path / "prm" / "adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS", "r": 8}))
    assert ("model.adapter: adapter folder prm holds a SEQ_CLS adapter (task_type in its adapter_config.json), not a "
            "policy's (CAUSAL_LM): a PRM's adapter (results/prm/adapter) scores steps, it cannot play"
            in problems_of(model={"adapter": "prm"}))
    model_folder(tmp_path / "sft", "adapter_model.safetensors")
    (tmp_path / "sft" / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM", "r": 8}))
    check_config_inputs(load_config(overrides={"model": {"adapter": "sft"}}))


def checkout_with_instances(root: Path, text: bytes) -> dict:
    """The ``games`` overrides of a checkout whose one game ``pair`` has ``text`` as its in/instances.json."""
    checkout = fake_checkout(root, {"pair": [{"game_name": "pair"}]})
    (checkout / "pair" / "in" / "instances.json").write_bytes(text)
    return {"clembench_path": str(checkout), "clembench_games": ["pair"]}


def test_a_game_id_that_repeats_within_an_experiment_is_refused_naming_game_experiment_and_id(tmp_path):
    """Repeated ids passed every stage with duplicate episode and branch-point ids; gather_soft_labels then failed
    with a false "is in two shards"."""
    instances = {"experiments": [{"name": "e1", "game_instances": [{"game_id": 0}, {"game_id": 1}]},
                                 {"name": "e2", "game_instances": [{"game_id": 1}, {"game_id": 1}]}]}
    games = checkout_with_instances(tmp_path / "cb", json.dumps(instances).encode())
    assert ("game 'pair', experiment 'e2': game_id 1 is used by two instances (an instance is known by game, "
            "experiment and game_id: give each instance of an experiment its own game_id)"
            in problems_of(games=games))


def test_an_instances_file_with_a_byte_order_mark_is_read(tmp_path):
    """check-config said ok, then base_rollouts failed with `JSONDecodeError: Unexpected UTF-8 BOM`, file not named."""
    from clemprm.play.catalog import instance_rows

    instances = {"experiments": [{"name": "e1", "game_instances": [{"game_id": 0}, {"game_id": 1}]}]}
    games = checkout_with_instances(tmp_path / "cb", b"\xef\xbb\xbf" + json.dumps(instances).encode())
    check_config_inputs(load_config(overrides={"games": {**games, "experiments": {"pair": ["e1"]}}}))
    path = tmp_path / "cb" / "pair" / "in" / "instances.json"
    assert [instance["game_id"] for _, instance in instance_rows(path, "pair")] == [0, 1]
    path.write_bytes(b"\xef\xbb\xbf{")
    assert f"instances file {path}: cannot read its instances (JSONDecodeError" in problems_of(games=games)


def test_a_soft_label_row_without_a_user_message_is_named_with_its_file_and_row(tmp_path):
    """prm_adapter failed with jinja2's `TemplateError: No user query found in messages`, naming no file or row."""
    from clemprm import records

    row = {name: None for name in records.SOFT_LABELS.names}
    good = {**row, "bp_id": "g/e/0/0/0", "prefix": [{"role": "user", "content": "Guess."}]}
    path = tmp_path / "soft_labels.parquet"
    records.write_records(path, [good, {**row, "bp_id": "g/e/0/0/1", "prefix": []}], records.SOFT_LABELS, {})
    with pytest.raises(records.RecordFileError, match=re.escape(
            f"record file {path}: row bp_id 'g/e/0/0/1' has a prefix with no user message (prefix: [])")):
        records.read_records(path, records.SOFT_LABELS)
    records.write_records(path, [good], records.SOFT_LABELS, {})
    assert len(records.read_records(path, records.SOFT_LABELS)) == 1


def test_per_turn_rewards_need_games_that_log_turn_scores():
    """grpo rewarded by turn_scores on games that log none failed inside rl_adapter, after SFT and the rollouts."""
    rl = {"algorithms": ["grpo"], "reward": {"source": "turn_scores"}}
    assert ("rl.reward.source: turn_scores rewards each turn by the scores the game logs at it, and guessnumber, "
            "wordref, oddoneout log none" in problems_of(rl=rl, games={"builtin": ["guessnumber", "wordref",
                                                                                   "oddoneout", "hanabi"]}))
    check_config_inputs(load_config(overrides={"rl": rl, "games": {"builtin": ["hanabi"]}}))


def test_a_processes_resource_that_is_no_whole_number_of_at_least_one_is_refused(tmp_path):
    """`processes=two` failed in the job with a bare int() traceback and an empty log; `processes=0` ran one process
    without a word."""
    from snakemake.resources import Resource

    from clemprm.checks.parse_time import processes_problems

    given = {"--set-resources prm_adapter": {"processes": Resource.from_cli_expression("processes", "two")},
             "--set-resources sft_adapter": {"processes": Resource("processes", 0)},
             "--set-resources eval_mode": {"processes": Resource("processes", 2), "mem_mb": Resource("mem_mb", 9)},
             "--default-resources": None}
    assert processes_problems(given) == [
        f"--set-resources {rule}: processes={value} is not a whole number of at least 1 (the processes a job runs in, "
        f"one per GPU: e.g. processes=2; docs/slurm.md, several GPUs per job)"
        for rule, value in (("prm_adapter", "two"), ("sft_adapter", 0))]
    (tmp_path / "user.yaml").write_text("seed: 1\n")
    done = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "-n",
                           "--cores", "1", "--directory", str(tmp_path), "--set-resources", "prm_adapter:processes=two",
                           "--configfile", str(tmp_path / "user.yaml")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode != 0
    assert "--set-resources prm_adapter: processes=two is not a whole number of at least 1" in done.stdout + done.stderr
    assert "Job stats" not in done.stdout + done.stderr


def test_a_held_out_set_capped_by_max_instances_or_missing_is_a_warning_naming_the_keys():
    """branch_points.validation_instances above games.max_instances.validation was capped silently; no held-out set
    at all was an INFO line of the PRM stage ("not measured")."""
    warnings = check_config_inputs(load_config(overrides={"branch_points": {"validation_instances": 6},
                                                          "games": {"max_instances": {"validation": 4}}}))
    assert warnings == ["branch_points.validation_instances 6 is above games.max_instances.validation 4: the PRM's "
                        "held-out set gets 4 instances per game, not 6 (raise games.max_instances.validation, or lower "
                        "branch_points.validation_instances)"]
    assert check_config_inputs(load_config(overrides={"branch_points": {"validation_instances": 0},
                                                      "prm": {"validation_fraction": 0.0}})) == [
        "branch_points.validation_instances and prm.validation_fraction are 0: the PRM has no held-out set, so its "
        "ranking metrics and its gate judge nothing (set branch_points.validation_instances, e.g. 4)"]


def test_a_held_out_set_smaller_than_asked_is_a_warning_in_the_job(caplog):
    """The job's side of the cap above (and a game whose validation split holds fewer): branch_points says so at
    WARNING, naming the key and each short game with its count."""
    import logging

    from clemprm.play.catalog import GameCatalog
    from clemprm.stages.branch_points import held_out_instances

    games = {**DEFAULT["games"], "builtin": ["guessnumber", "wordref"], "max_instances": {"train": 1, "validation": 2,
                                                                                          "test": 1}}
    with caplog.at_level(logging.INFO, logger="clemprm"):
        instances, marks = held_out_instances(GameCatalog(games, 0), 2)
        assert len(instances) == 4 and marks == []
        assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
        instances, marks = held_out_instances(GameCatalog(games, 0), 3)
        assert len(instances) == 4
    said = ("branch_points: branch_points.validation_instances 3: the held-out set gets fewer instances of "
            "guessnumber (2), wordref (2) (games.max_instances.validation 2, or the game's validation split holds no "
            "more): the PRM is judged on fewer than asked")
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [("WARNING", f"WARNING: {said}")]
    # the mark the stage records in its provenance: the summary lists it with the run's warnings
    assert [(mark.stage, mark.condition, mark.count, mark.message) for mark in marks] == [
        ("branch_points", "heldout_capped", 2, said)]


def test_a_target_after_configfile_and_a_number_yaml_reads_as_text_in_a_snakemake_run(tmp_path):
    """`snakemake --configfile tiny.yaml results/prm/metrics.json` read the metrics file as a config (`unknown key
    'baselines'`, file not named); `sft: {lr: 1e-4}` (text to YAML 1.1) was refused as "not of type 'number'"."""
    (tmp_path / "user.yaml").write_text("sft:\n  lr: 1e-4\nprm:\n  lr: 5E-5\n")
    metrics = tmp_path / "results" / "prm" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps({"baselines": {}, "gate": {}}))
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "-n", "--cores", "1",
               "--directory", str(tmp_path), "--configfile", str(tmp_path / "user.yaml")]
    run = dict(capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    done = subprocess.run(command + ["results/prm/metrics.json"], **run)
    assert done.returncode != 0
    assert (f"config file {metrics}: baselines, gate are no config keys (allowed: base_rollouts,"
            in done.stdout + done.stderr)
    assert "put targets before --configfile, or end its files with --" in done.stdout + done.stderr
    done = subprocess.run(command, **run)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
