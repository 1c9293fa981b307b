"""Parse-time checks of the models the config names (:mod:`clemprm.checks.parse_time` runs them): the model specs
resolve, the adapter is a policy's PEFT adapter folder, the model cache can be written, and each LoRA's
``target_modules`` names modules of the model it trains. No weights are loaded.

* ``model.spec`` (and ``prm.base_model``) resolve: a known ``embedded:``/``tiny:`` spec, a local model folder
  holding a config and a tokenizer, or a hub id: a spec that looks like a path (absolute, ``./``, ``~``, more than
  one ``/``, or under an existing local folder) must be such a folder; a hub id where the jobs cannot reach the hub
  (:func:`clemprm.config.hub_offline_reason`) must be in the hub cache;
* ``model.adapter`` is a PEFT adapter folder (``adapter_config.json`` and its weights) of a policy, not of a PRM
  (its ``task_type``);
* ``cache_dir`` (else ``$CLEMPRM_CACHE``) is a folder that can be created and written, not under ``results/``;
* every name of a LoRA's ``target_modules`` list (``sft.lora``, ``prm.lora``, ``rl.lora``) names a module of the
  model it trains, where that model is here: a local folder, an embedded or tiny model (materialised here once, as
  the first job would) or a hub id in the hub cache; the module names come from the model's config on the meta
  device (no weights) and are kept in the model cache (:func:`model_module_names`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


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


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``, default https://huggingface.co) cannot be reached from here (a TCP
    connection to it, at most ``timeout`` seconds), or None when it can. Asked only for a hub id the cache does not
    hold: without it, the first job would spend a minute on retries and fail naming neither the key nor the cure."""
    import socket
    import urllib.parse

    from huggingface_hub import constants

    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError as error:
        return f"{constants.ENDPOINT} cannot be reached: {error}"
    return None


def model_problems(spec: str, key: str, offline: str | None = None, hf_home: str | None = None) -> list[str]:
    """Why ``spec`` cannot name a model here ([] when it can): a malformed or unknown spec, a missing folder, a
    folder without a config or a tokenizer, an invalid hub id, or a hub id the hub cache does not hold that the jobs
    cannot download (``offline``: why, :func:`clemprm.config.hub_offline_reason`; or the hub cannot be reached,
    :func:`hub_unreachable`)."""
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
    if hub_cache_holds(value, hf_home):
        return []
    if offline:
        return [f"{key}: {value} is not a local folder (relative to {os.getcwd()}), and as a hub id it cannot be "
                f"downloaded: hub access is off ({offline}) and the hub cache {hub_cache(hf_home)} does not hold it"]
    if unreachable := hub_unreachable():
        return [f"{key}: {value} is not a local folder (relative to {os.getcwd()}) nor in the hub cache "
                f"{hub_cache(hf_home)}, and {unreachable}: download it where there is network "
                f"(`hf download {value}` into that cache, or a folder named by {key}); HF_HUB_OFFLINE=1 tells the "
                f"jobs to read the cache only"]
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
    return problems or adapter_task_problems(adapter, key)


POLICY_TASK_TYPES = (None, "CAUSAL_LM")
"""The ``task_type`` of a PEFT adapter that a policy can play with (a PRM adapter is ``SEQ_CLS``: a score head)."""


def adapter_task_problems(adapter: str, key: str) -> list[str]:
    """Why the adapter folder ``adapter`` is no policy adapter: its ``adapter_config.json`` is not JSON, or its
    ``task_type`` is not a causal LM's (a PRM's adapter loads onto the policy with only PEFT's "missing adapter keys"
    warning in a log, and the policy then plays with a LoRA trained for another head)."""
    path = os.path.join(os.path.expanduser(adapter), "adapter_config.json")
    try:
        task_type = json.loads(Path(path).read_text(encoding="utf-8-sig")).get("task_type")
    except (OSError, ValueError, AttributeError) as error:
        return [f"{key}: {path} is not a PEFT adapter config ({type(error).__name__}: {error})"]
    if task_type in POLICY_TASK_TYPES:
        return []
    return [f"{key}: adapter folder {adapter} holds a {task_type} adapter (task_type in its adapter_config.json), not "
            f"a policy's (CAUSAL_LM): a PRM's adapter (results/prm/adapter) scores steps, it cannot play; give a "
            f"policy adapter such as results/sft/adapter"]


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


LORA_SECTIONS = (("sft", "causal-lm"), ("prm", "seq-cls"), ("rl", "causal-lm"))
"""The config sections with a LoRA, and the head of the model it trains (the PRM's: a one-logit score head)."""


def lora_target_problems(config: dict) -> list[str]:
    """Names in a LoRA's ``target_modules`` list that match no module of the model it trains: PEFT matches a name to a
    module whose dotted name is it or ends with ``.`` and it, fails only when no name matches any (inside the job),
    and else trains the matching ones and drops the others without a word (``[q_proj, vproj]`` trained q_proj
    alone). Unused LoRAs are left out: ``sft.lora`` with ``model.adapter`` set (SFT trains that adapter on),
    ``rl.lora`` when null or no RL algorithm is trained. A model that is not here (a hub id not in the hub cache) is
    not checked; PEFT then names an unmatched list in the job."""
    problems = []
    for section, task in LORA_SECTIONS:
        lora = config.get(section, {}).get("lora")
        if (not lora or lora["target_modules"] == "all-linear" or (section == "sft" and config["model"].get("adapter"))
                or (section == "rl" and not config["rl"]["algorithms"])):
            continue
        spec = (config["prm"].get("base_model") if section == "prm" else None) or config["model"]["spec"]
        modules = model_module_names(spec, config.get("cache_dir"), config.get("hf_home"), task)
        if modules is None:
            continue
        names, targetable = modules
        unknown = [target for target in lora["target_modules"]
                   if not any(name == target or name.endswith(f".{target}") for name in names)]
        if unknown:
            effect = "fail in the job" if len(unknown) == len(lora["target_modules"]) else "train the others alone"
            problems.append(f"{section}.lora.target_modules: {', '.join(unknown)} "
                            f"{'names' if len(unknown) == 1 else 'name'} no module of {spec} (PEFT would {effect}; "
                            f"its layers LoRA can adapt: {', '.join(targetable)}; or all-linear)")
    return problems


LORA_LAYER_TYPES = ("Linear", "Conv1D", "Conv2d", "Embedding")
"""The module classes LoRA can adapt (PEFT's LoRA layers), listed as the names a ``target_modules`` list may give."""


def model_module_names(spec: str, cache_dir: str | None, hf_home: str | None,
                       task: str) -> tuple[list[str], list[str]] | None:
    """``(every module's dotted name, the last parts of those LoRA can adapt)`` of the model ``spec`` loaded for
    ``task`` (``causal-lm`` or ``seq-cls``), or None when its folder is not here (:func:`local_model_folder`). Built
    from the folder's config on the meta device (no weights; about 4 s with the imports), then kept in the model
    cache under ``module-names/``, by the config file's content: later parses read the file."""
    folder = local_model_folder(spec, cache_dir, hf_home)
    if folder is None:
        return None
    import hashlib

    from clemprm.models.loader import ModelConfig, cache_root

    config_bytes = (Path(folder) / "config.json").read_bytes()
    digest = hashlib.sha256(config_bytes + task.encode()).hexdigest()[:32]
    kept = cache_root(ModelConfig(cache_dir=cache_dir)) / "module-names" / f"{digest}.json"
    if kept.is_file():
        data = json.loads(kept.read_text(encoding="utf-8"))
        return data["names"], data["targetable"]
    try:
        names, targetable = meta_module_names(folder, task)
    except Exception:   # noqa: BLE001 - a config transformers cannot build: loading reports it in the job
        return None
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        scratch = kept.with_name(f".{kept.name}.tmp-{os.getpid()}")
        scratch.write_text(json.dumps({"spec": spec, "task": task, "names": names, "targetable": targetable}))
        os.replace(scratch, kept)
    except OSError:   # a cache that cannot be written: cache_dir_problems names it
        pass
    return names, targetable


def meta_module_names(folder: str, task: str) -> tuple[list[str], list[str]]:
    """:func:`model_module_names` built: the model of ``folder``'s config instantiated on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    model_config = AutoConfig.from_pretrained(folder, **({"num_labels": 1} if task == "seq-cls" else {}))
    with torch.device("meta"):
        model = (AutoModelForSequenceClassification if task == "seq-cls" else AutoModelForCausalLM).from_config(
            model_config)
    modules = list(model.named_modules())
    targetable = sorted({name.rsplit(".", 1)[-1] for name, module in modules
                         if name and type(module).__name__ in LORA_LAYER_TYPES})
    return [name for name, _ in modules if name], targetable


def local_model_folder(spec: str, cache_dir: str | None, hf_home: str | None) -> str | None:
    """The folder holding the config of the model ``spec`` here, or None: an embedded or tiny model's (materialised
    once, as the first job would: :func:`clemprm.models.loader.resolve_model_dir`), a local model folder, or a hub
    id's snapshot in the hub cache. A spec that names nothing usable is :func:`model_problems`' to report."""
    from clemprm.models.loader import ModelConfig, parse_spec, resolve_model_dir

    try:
        kind, value = parse_spec(spec)
        folder = resolve_model_dir(ModelConfig(spec=spec, cache_dir=cache_dir)) if kind != "path" else value
    except Exception:   # noqa: BLE001 - an embedded model whose package is missing, a cache that cannot be written
        return None
    folder = os.path.expanduser(folder)
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    if kind != "path" or looks_like_path(value):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(value, "config.json", cache_dir=hub_cache(hf_home))
    except ValueError:   # not a valid hub id: model_problems names it
        return None
    return os.path.dirname(cached) if isinstance(cached, str) else None
