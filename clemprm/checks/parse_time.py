"""Checks run when the Snakefile is parsed, before any job: a run that cannot work stops at once, saying why.

:func:`check_config_inputs` checks what the config names outside this repository without loading any model or
game code:

* ``model.spec`` (and ``prm.base_model``) resolve: a known ``embedded:``/``tiny:`` spec, a local model folder
  holding a config and a tokenizer, or a hub id: a spec that looks like a path (absolute, ``./``, ``~``, more than
  one ``/``, or under an existing local folder) must be such a folder; a hub id where the jobs cannot reach the hub
  (:func:`clemprm.config.hub_offline_reason`) must be in the hub cache; no weights are loaded;
* ``model.adapter`` is a PEFT adapter folder (``adapter_config.json`` and its weights);
* ``cache_dir`` (else ``$CLEMPRM_CACHE``) is a folder that can be created and written, not under ``results/``;
* ``games.experiments``, ``games.parse_mode_overrides`` and ``games.instances_files`` name played games, and
  ``games.experiments`` experiments their instances files hold; ``games.clembench_path`` is a folder when set;
* every row of ``games.instance_list`` matches an instance of a played game (a warning under ``on_failure:
  continue``), and the input files the rules read (the instance list, ``sft.extra_data``) are there;
* ``games.clembench_path`` is a clembench checkout and every game of ``games.clembench_games`` is found in it
  (:func:`clemprm.play.catalog.clembench_specs`) with its instances file;
* each game's Python imports resolve: the modules its ``master.py`` imports at module level, followed through the
  game's own modules (decoded as Python decodes them and read with :mod:`ast`, never executed), must be importable
  here; a file Python cannot compile is a problem of the list;
* the NLTK data a game downloads at import time (``nltk.download("stopwords")`` in taboo, ``"wordnet"`` in taboo
  and codenames) is installed: offline the download fails and the game breaks later, inside a job;
* with ``generation.backend: vllm``, no eval mode ranks by the policy's log-probabilities (the job holds no policy
  weights then);
* the tracker of ``tracking.report_to`` is installed (:func:`clemprm.tracking.tracker_problem`).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
from pathlib import Path

from clemprm.tracking import tracker_problem

NLTK_DATA_FOLDERS = ("corpora", "tokenizers", "taggers", "chunkers", "grammars", "models", "misc", "sentiment",
                     "stemmers")
"""Where NLTK keeps a data package, by kind (``nltk.data.find("corpora/stopwords")``)."""


class ConfigInputError(ValueError):
    """Something the config names (a model, a checkout, a game, its packages or data) is not usable here."""


def check_config_inputs(config: dict, also: list[str] = ()) -> list[str]:
    """Raise :class:`ConfigInputError` listing every problem found (see the module doc), and those of ``also``; return
    the warnings (:func:`config_input_problems`)."""
    problems, warnings = config_input_problems(config)
    problems = [*also, *problems]
    if problems:
        raise ConfigInputError("the config names things this run cannot use:\n  - " + "\n  - ".join(problems))
    return warnings


def config_input_problems(config: dict) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of what the config names (see the module doc). Rows of ``games.instance_list`` that
    match no instance are a problem, or a warning under ``on_failure: continue``."""
    from clemprm.config import hub_offline_reason

    offline = hub_offline_reason(config)
    hf_home = config.get("hf_home")
    problems = model_problems(config["model"]["spec"], "model.spec", offline, hf_home)
    problems += adapter_problems(config["model"].get("adapter"), "model.adapter")
    if config.get("prm", {}).get("base_model"):
        problems += model_problems(config["prm"]["base_model"], "prm.base_model", offline, hf_home)
    problems += cache_dir_problems(config.get("cache_dir"))
    problems += clembench_problems(config["games"])
    problems += unplayed_game_problems(config["games"])
    problems += experiment_problems(config["games"])
    unreadable, unmatched = instance_list_problems(config["games"])
    warnings = unmatched if config["on_failure"] == "continue" else []
    problems += unreadable + ([] if warnings else unmatched)
    problems += input_file_problems(config)
    problems += generation_problems(config.get("generation") or {})
    problems += vllm_mode_problems(config)
    tracker = tracker_problem(config["tracking"]["report_to"])
    problems += [tracker] if tracker else []
    return problems, warnings


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""A model folder holds a tokenizer when it holds one of these (``AutoTokenizer.from_pretrained`` reads them)."""
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def looks_like_path(spec: str) -> bool:
    """Whether a model spec can only be a local folder, not a hub id (``org/name`` or ``name``): absolute,
    starting with ``.`` or ``~``, more than one ``/``, a backslash, or its first part an existing local folder
    (``models/x`` where ``models/`` is here)."""
    return (os.path.isabs(spec) or spec.startswith((".", "~")) or "\\" in spec or spec.count("/") > 1
            or spec.endswith("/") or ("/" in spec and os.path.isdir(spec.split("/")[0])))


def model_folder_problems(folder: str, key: str) -> list[str]:
    """Why ``folder`` (as the config names it) is not a model folder ``from_pretrained`` can load: no
    ``config.json``, no tokenizer."""
    path, problems = os.path.expanduser(folder), []
    if not os.path.isfile(os.path.join(path, "config.json")):
        problems.append(f"{key}: model folder {folder} holds no config.json (a transformers model folder holds "
                        f"config.json, the weights and the tokenizer)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        problems.append(f"{key}: model folder {folder} holds no tokenizer ({', '.join(TOKENIZER_FILES)})")
    return problems


def hub_cache(hf_home: str | None) -> str:
    """The hub cache the jobs read: ``$HF_HUB_CACHE`` where set, else ``hf_home``'s (the jobs set ``HF_HOME``),
    else this environment's."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE") or not hf_home:
        return constants.HF_HUB_CACHE
    return os.path.join(os.path.expanduser(hf_home), "hub")


def hub_cache_holds(repo_id: str, hf_home: str | None) -> bool:
    """Whether the hub cache the jobs read holds ``repo_id``'s config."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache(hf_home)), str)


def model_problems(spec: str, key: str, offline: str | None = None, hf_home: str | None = None) -> list[str]:
    """Why ``spec`` cannot name a model here ([] when it can): a malformed or unknown spec, a missing folder, a
    folder without a config or a tokenizer, an invalid hub id, or a hub id the jobs cannot download (``offline``:
    why, :func:`clemprm.config.hub_offline_reason`) that is not in the hub cache."""
    from clemprm.models.loader import parse_spec

    try:
        kind, value = parse_spec(spec)
    except ValueError as error:
        return [f"{key}: {error}"]
    if kind != "path":
        return []
    folder = os.path.expanduser(value)
    if os.path.isdir(folder):
        return model_folder_problems(value, key)
    if looks_like_path(value):
        return [f"{key}: model folder {value} does not exist (relative to {os.getcwd()})"]
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError as error:
        return [f"{key}: {value} is neither a local folder (relative to {os.getcwd()}) nor a hub id ({error})"]
    if offline and not hub_cache_holds(value, hf_home):
        return [f"{key}: {value} is not a local folder (relative to {os.getcwd()}), and as a hub id it cannot be "
                f"downloaded: hub access is off ({offline}) and the hub cache {hub_cache(hf_home)} does not hold it"]
    return []


def adapter_problems(adapter: str | None, key: str) -> list[str]:
    """Why ``adapter`` is not a PEFT adapter folder ([] when it is, or is None)."""
    if adapter is None:
        return []
    folder = os.path.expanduser(adapter)
    if not os.path.isdir(folder):
        return [f"{key}: adapter folder {adapter} does not exist (relative to {os.getcwd()})"]
    problems = []
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        problems.append(f"{key}: adapter folder {adapter} holds no adapter_config.json (a PEFT adapter folder)")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in ADAPTER_WEIGHTS):
        problems.append(f"{key}: adapter folder {adapter} holds no weights ({', '.join(ADAPTER_WEIGHTS)})")
    return problems


def generation_problems(generation: dict) -> list[str]:
    """The vllm backend needs a server: a URL, or a Python that can start one (vLLM importable there is checked when
    the job starts it: importing vLLM takes seconds)."""
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
    return []


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


def cache_dir_problems(cache_dir: str | None) -> list[str]:
    """Why the model cache (``cache_dir``, else ``$CLEMPRM_CACHE``) cannot be used: an empty string (not null), under
    ``results/``, or no folder that can be created and written (:func:`writable_folder_problem`)."""
    from clemprm.models.loader import ModelConfig, cache_root

    key = "cache_dir" if cache_dir is not None else "$CLEMPRM_CACHE (cache_dir is null)"
    if cache_dir is not None and not cache_dir.strip():
        return [f"cache_dir: {cache_dir!r} names no folder: give a folder for the model cache, or null for "
                f"$CLEMPRM_CACHE (else ~/.cache/clemprm)"]
    try:
        root = cache_root(ModelConfig(cache_dir=cache_dir))
    except ValueError as error:
        return [f"{key}: {error}"]
    problem = writable_folder_problem(root)
    return [f"{key}: the model cache {root} {problem}"] if problem else []


def writable_folder_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a folder a job can create (where missing) and write into, as the end of a sentence
    (``is a file, not a folder``), or None. It, or else its nearest existing parent, must be a folder this account
    may write into."""
    folder = Path(folder)
    existing = next(path for path in [folder, *folder.parents] if path.exists() or path == path.parent)
    if existing != folder and not existing.is_dir():
        return f"cannot be created: {existing} is a file, not a folder"
    if not existing.is_dir():
        return "is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "is" if existing == folder else f"cannot be created: {existing} is"
        return f"{where} not writable by this account (choose a folder the jobs can write into)"
    return None


def experiment_problems(games: dict) -> list[str]:
    """Why ``games.experiments`` cannot select what it names: a game that is not configured, or an experiment its
    instances files do not hold. A clembench game that cannot be found is :func:`clembench_problems`' to report."""
    from clemprm.games import SPLITS, builtin_game_dir
    from clemprm.play.catalog import clembench_specs, experiment_names, instances_file

    selected = games.get("experiments") or {}
    clembench = games.get("clembench_games") or []
    specs = {}
    if any(game in clembench for game in selected) and games.get("clembench_path"):
        try:
            specs = clembench_specs(games["clembench_path"])
        except ValueError:
            specs = {}
    problems = []
    for game, names in sorted(selected.items()):
        try:
            if game in games["builtin"]:
                files = [builtin_game_dir(game) / "in" / f"instances_{split}.json" for split in SPLITS]
            elif game in clembench:
                if game not in specs:
                    continue
                game_dir, spec = specs[game]
                files = [instances_file(game_dir, spec, (games.get("instances_files") or {}).get(game))]
            else:
                problems.append(f"games.experiments.{game}: {game!r} is not a configured game (games.builtin: "
                                f"{', '.join(games['builtin']) or 'none'}; games.clembench_games: "
                                f"{', '.join(clembench) or 'none'})")
                continue
            known = set().union(*(experiment_names(path) for path in files))
        except ValueError as error:
            if game in clembench:
                continue   # clembench_problems names the instances file
            problems.append(f"games.experiments.{game}: {error}")
            continue
        unknown = [name for name in names if name not in known]
        if unknown:
            problems.append(f"games.experiments.{game}: no experiment {', '.join(map(repr, unknown))} in game "
                            f"{game!r} (known: {', '.join(sorted(known)) or 'none'})")
    return problems


def played_games(games: dict) -> list[str]:
    """The games a run plays: ``games.builtin`` and ``games.clembench_games``."""
    return list(games["builtin"]) + list(games.get("clembench_games") or [])


def unplayed_game_problems(games: dict) -> list[str]:
    """Keys that name a game the run does not play (``games.parse_mode_overrides``, ``games.instances_files``: a
    misspelled name would be ignored), and a ``games.clembench_path`` that is no folder (also when no clembench game
    is played yet)."""
    played, problems = played_games(games), []
    for key in ("parse_mode_overrides", "instances_files"):
        for name in sorted(set(games.get(key) or {}) - set(played)):
            problems.append(f"games.{key} names {name!r}, which is not a game this run plays (games.builtin: "
                            f"{', '.join(games['builtin']) or 'none'}; games.clembench_games: "
                            f"{', '.join(games.get('clembench_games') or []) or 'none'})")
    path = games.get("clembench_path")
    if path and not games.get("clembench_games") and not os.path.isdir(os.path.expanduser(path)):
        problems.append(f"games.clembench_path: {path} is not a directory (a clembench checkout; null when no "
                        f"clembench game is played)")
    return problems


UNMATCHED_SHOWN = 5
"""How many unmatched rows of an instance list a message quotes (then the count of all)."""


def instance_list_problems(games: dict) -> tuple[list[str], list[str]]:
    """``(why games.instance_list cannot be read, its rows that match no instance of a played game)``: an unknown
    game (no built-in game, none of the checkout: a misspelling), experiment or task_id, or a split the game does not
    hold it in; the first :data:`UNMATCHED_SHOWN` of them and their count. Rows of games this run does not play
    (:func:`other_games`) are left out, as the catalog leaves them: one list may serve several runs. The games'
    instances are read from their instances files (no game code runs)."""
    from clemprm.games import SPLITS
    from clemprm.play.catalog import read_instance_list

    path = games.get("instance_list")
    if not path:
        return [], []
    if not os.path.isfile(os.path.expanduser(path)):
        return [f"games.instance_list: {path} is not a file (relative to {os.getcwd()}; a playpen-data instances "
                f"table: parquet, csv, jsonl or json)"], []
    try:
        rows = read_instance_list(os.path.expanduser(path))
        known = instance_keys(games)
    except ValueError as error:
        return [f"games.instance_list: {error}"], []
    if known is None:   # a game that cannot be found: clembench_problems names it
        return [], []
    others = other_games(games)   # a shared list's rows of games this run does not play: not ours to judge
    unmatched = sorted(row for row in rows if row[0] not in others and row[:3] not in known.get(row[3], set()))
    if not unmatched:
        return [], []
    shown = "; ".join("/".join(map(str, row)) for row in unmatched[:UNMATCHED_SHOWN])
    more = f" and {len(unmatched) - UNMATCHED_SHOWN} more" if len(unmatched) > UNMATCHED_SHOWN else ""
    return [], [f"games.instance_list: {len(unmatched)} of {len(rows)} rows of {path} match no instance of a played "
                f"game (game/experiment/task_id/split): {shown}{more} (splits: {', '.join(SPLITS)}; games: "
                f"{', '.join(played_games(games))})"]


def other_games(games: dict) -> set[str]:
    """The games this run could play but does not: the other built-in games and the other games of the checkout."""
    from clemprm.games import BUILTIN_GAMES
    from clemprm.play.catalog import clembench_specs

    try:
        checkout = set(clembench_specs(games["clembench_path"])) if games.get("clembench_path") else set()
    except ValueError:   # clembench_problems names it
        checkout = set()
    return (set(BUILTIN_GAMES) | checkout) - set(played_games(games))


def instance_keys(games: dict) -> dict[str, set[tuple[str, str, int]]] | None:
    """Per split, the ``(game, experiment, game_id)`` an instance list may name: a built-in game's from its file of
    that split, a clembench game's from its instances file in every split (the list assigns them). None when a
    clembench game or its instances file cannot be found (:func:`clembench_problems` names it)."""
    from clemprm.games import SPLITS, builtin_game_dir
    from clemprm.play.catalog import clembench_specs, instances_file

    keys: dict[str, set] = {split: set() for split in SPLITS}
    for game in games["builtin"]:
        for split in SPLITS:
            keys[split] |= file_instance_keys(game, builtin_game_dir(game) / "in" / f"instances_{split}.json")
    clembench = games.get("clembench_games") or []
    try:
        specs = clembench_specs(games["clembench_path"]) if clembench else {}
        files = {game: instances_file(*specs[game], (games.get("instances_files") or {}).get(game))
                 for game in clembench}
    except (ValueError, KeyError, TypeError):   # TypeError: no clembench_path
        return None
    for game, path in files.items():
        found = file_instance_keys(game, path)
        for split in SPLITS:
            keys[split] |= found
    return keys


def file_instance_keys(game: str, path: Path) -> set[tuple[str, str, int]]:
    """The ``(game, experiment, game_id)`` of every instance of an instances file; ValueError naming the file."""
    try:
        experiments = json.loads(Path(path).read_text(encoding="utf-8"))["experiments"]
        return {(game, experiment["name"], int(instance["game_id"]))
                for experiment in experiments for instance in experiment["game_instances"]}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"instances file {path}: cannot read its instances ({type(error).__name__}: {error})") \
            from error


def input_file_problems(config: dict) -> list[str]:
    """Input files of rules that the config names and that are not there (a rule would stop the run at once with
    Snakemake's "Missing input files"): ``sft.extra_data``."""
    extra = (config.get("sft") or {}).get("extra_data")
    if extra and not os.path.isfile(os.path.expanduser(extra)):
        return [f"sft.extra_data: {extra} is not a file (relative to {os.getcwd()}; playpen-data interactions: "
                f"parquet, jsonl or json)"]
    return []


def clembench_problems(games: dict) -> list[str]:
    """Why the configured clembench games cannot be played here ([] when they can)."""
    from clemprm.play.catalog import clembench_specs, instances_file

    names = games.get("clembench_games") or []
    if not names:
        return []
    if not games.get("clembench_path"):
        return ["games.clembench_games is set but games.clembench_path is null"]
    try:
        specs = clembench_specs(games["clembench_path"])
    except ValueError as error:
        return [str(error)]
    problems = []
    chosen = games.get("instances_files") or {}
    for name in names:
        if name not in specs:
            problems.append(f"games.clembench_games: no game {name!r} in clembench checkout "
                            f"{games['clembench_path']} (found: {', '.join(sorted(specs)) or 'none'})")
            continue
        game_dir, spec = specs[name]
        try:
            instances_file(game_dir, spec, chosen.get(name))
        except ValueError as error:
            problems.append(str(error))
        try:
            modules, nltk_data = game_imports(game_dir)
        except (SyntaxError, ValueError, OSError) as error:   # ValueError: a null byte in the source
            problems.append(f"game {name!r}: cannot read its code: {code_error(error)}")
            continue
        missing = sorted(module for module in modules if not importable(module))
        if missing:
            problems.append(f"game {name!r} imports {', '.join(missing)}, not installed here ({install_hint(missing)})")
        absent = [package for package in nltk_data if not nltk_data_installed(package)]
        if absent:
            problems.append(f"game {name!r} needs the NLTK data {', '.join(absent)}, which NLTK does not find here "
                            f"(on a machine with network: python -m nltk.downloader -d DIR {' '.join(absent)}, then "
                            f"set NLTK_DATA=DIR; NLTK also refuses data writable by other accounts: chmod -R go-w "
                            f"DIR; docs/games.md: clembench games)")
    return problems


CLEMBENCH_EXTRA_MODULES = ("lark", "jinja2", "networkx")
"""The modules clemprm's ``clembench`` extra installs (pyproject.toml)."""
MODULE_PACKAGES = {"clingo": "clingo", "sklearn": "scikit-learn", "spacy": "spacy", "yaml": "pyyaml",
                   "PIL": "pillow", "cv2": "opencv-python", "bs4": "beautifulsoup4", "Levenshtein": "levenshtein"}
"""The pip package of a module whose name is not the package's, or that the ``clembench`` extra does not install."""


def install_hint(modules: list[str]) -> str:
    """What installs ``modules``: clemprm's ``clembench`` extra for those it holds, pip for the others (by package
    name where it differs from the module's)."""
    extra = [module for module in modules if module in CLEMBENCH_EXTRA_MODULES]
    others = [MODULE_PACKAGES.get(module, module) for module in modules if module not in CLEMBENCH_EXTRA_MODULES]
    hints = [f'pip install -e ".[clembench]" installs {", ".join(extra)}'] if extra else []
    if others:
        hints.append(f"pip install {' '.join(others)} (not in clemprm's clembench extra)")
    return "; ".join(hints)


def code_error(error: Exception) -> str:
    """A game file that Python cannot compile, as ``file, line N: message``."""
    if isinstance(error, SyntaxError):
        return f"{error.filename}, line {error.lineno}: {error.msg}"
    return str(error)


def local_roots(game_dir: Path) -> list[Path]:
    """The folders clemcore puts on ``sys.path`` for a game: the game folder, and its parent when the folder's name
    starts with the parent's (``textmapworld/textmapworld_main``)."""
    game_dir = Path(game_dir).resolve()
    return [game_dir] + ([game_dir.parent] if game_dir.name.startswith(game_dir.parent.name) else [])


def game_imports(game_dir: Path) -> tuple[set[str], list[str]]:
    """``(top-level modules the game imports from outside its folders, NLTK data packages it downloads)``: from
    ``master.py`` and, transitively, the game's own modules it imports; module level only (imports inside
    functions run later, or never)."""
    roots = local_roots(game_dir)
    external: set[str] = set()
    nltk_data: list[str] = []
    todo, seen = [Path(game_dir) / "master.py"], set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        tree = ast.parse(python_source(path), filename=str(path))
        for node in module_level_nodes(tree):
            if isinstance(node, ast.Call) and nltk_download_target(node):
                nltk_data.append(nltk_download_target(node))
            for module, maybe_attribute in imported_modules(node):
                local = local_module_file(module, roots)
                if local is not None:
                    todo.append(local)
                elif not maybe_attribute and module.split(".")[0] not in sys.stdlib_module_names:
                    external.add(module.split(".")[0])
    return external, list(dict.fromkeys(nltk_data))


def python_source(path: Path) -> str:
    """A Python file's text decoded as the interpreter decodes it on import: its coding line (PEP 263) or UTF-8, a
    byte-order mark dropped (``importlib.util.decode_source``); ``SyntaxError`` naming the file for a coding it cannot
    decode with."""
    try:
        return importlib.util.decode_source(path.read_bytes())
    except (SyntaxError, UnicodeDecodeError, LookupError) as error:   # bytes not in its coding, an unknown coding
        message = error.msg if isinstance(error, SyntaxError) else str(error)
        raise SyntaxError(f"{message} (Python reads a file in the coding of its coding line, else in UTF-8)",
                          (str(path), getattr(error, "lineno", None) or 1, 0, None)) from error


def module_level_nodes(tree: ast.Module):
    """Every node of a module except those inside function bodies (those run only when called)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def imported_modules(node: ast.AST) -> list[tuple[str, bool]]:
    """``(module, maybe an attribute)`` per module an import statement may load: ``from a import b`` loads ``a``
    and, when ``a.b`` is a module rather than a name in ``a``, ``a.b`` too."""
    if isinstance(node, ast.Import):
        return [(alias.name, False) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [(node.module, False)] + [(f"{node.module}.{alias.name}", True) for alias in node.names]
    return []


def local_module_file(module: str, roots: list[Path]) -> Path | None:
    """The file of ``module`` in the game's folders (a module or a package's ``__init__``), else None."""
    parts = module.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        if base.is_dir():  # a namespace package of the game
            return base / "__init__.py"
    return None


def nltk_download_target(node: ast.Call) -> str | None:
    """``"stopwords"`` for a call ``nltk.download("stopwords", ...)``, else None."""
    func = node.func
    if (isinstance(func, ast.Attribute) and func.attr == "download" and isinstance(func.value, ast.Name)
            and func.value.id == "nltk" and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return node.args[0].value
    return None


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def nltk_data_installed(package: str) -> bool:
    """Whether NLTK finds the data package ``package`` (as a folder or a zip) on its data path."""
    import nltk

    for folder in NLTK_DATA_FOLDERS:
        try:
            nltk.data.find(f"{folder}/{package}")
            return True
        except LookupError:
            continue
    return False
