"""Model cards: the ``README.md`` in the Hugging Face format that every adapter folder (SFT, the PRM, each RL
algorithm, SCoRe) and every merged checkpoint carries, and the opt-in upload of such a folder to the Hub.

A card is YAML front matter (``base_model`` where the base is a Hub model, ``library_name``, ``pipeline_tag``,
``tags``, ``license`` where known) and a body rendered from the stage's finished metrics (for a merged checkpoint: its
``verification.json``): the method, the hyperparameters (the config sections that made it, the metrics' ``config``),
the training data, the metrics, the package versions and the command that reproduces it. The stages write it after
:func:`clemprm.training.finish_metrics`, so it holds the final metrics; it is written atomically (a temporary file
moved into place). :func:`publish_folder` (``clemprm publish``, never part of the DAG) uploads a folder.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from clemprm import distributed

CARD_NAME = "README.md"
# the embedded models' Hub originals and licences (clemprm.models.embedded.EMBEDDED_MODELS converts them from GGUF)
EMBEDDED_ORIGINALS = {"embedded:smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}

# kind -> (title, method sentence, pipeline tag, tags, config section)
KINDS = {
    "sft": ("SFT adapter", "A LoRA adapter fine-tuned (supervised, TRL's SFTTrainer, loss on the answer tokens) on the "
            "player turns of won clembench episodes the base policy played.", "text-generation", ["sft"], "sft"),
    "prm": ("Process reward model (PRM) adapter", "A LoRA adapter with a one-logit score head (sequence "
            "classification) trained on soft labels of branch points (the success rate of continuations after each "
            "candidate turn): it scores a candidate turn of a clembench game by its chance of leading to a win.",
            "text-classification", ["prm", "reward-model"], "prm"),
    "prm_probe": ("Process reward model (PRM) probe", "Linear heads (no LoRA) on the frozen policy's own hidden "
                  "states (model spec + SFT adapter, named in probe_config.json): chosen layers at the candidate's "
                  "last token and pooled over its last tokens, standardised, fitted on soft labels of branch points "
                  "(and, with a validity head, on the game's verdicts on played answers); it scores a candidate "
                  "turn of a clembench game by its chance of leading to a win.", "text-classification",
                  ["prm", "reward-model", "probe"], "prm"),
    "grpo": ("GRPO policy adapter", "A LoRA policy adapter trained online by GRPO: groups of episodes played per "
             "instance, each turn's advantage its episode's reward relative to its group.", "text-generation",
             ["rl", "grpo"], "rl"),
    "prime": ("PRIME policy adapter", "A LoRA policy adapter trained online by PRIME: an implicit PRM (the prm/ "
              "sub-folder) learns from episode outcomes and gives per-turn process rewards.", "text-generation",
              ["rl", "prime"], "rl"),
    "score": ("SCoRe self-correction adapter", "A LoRA policy adapter trained by SCoRe (two attempts per episode; "
              "stage I keeps the first attempt near the SFT policy, stage II rewards improving on it).",
              "text-generation", ["rl", "score", "self-correction"], "score"),
}


def base_model_of(spec: str) -> tuple[str | None, str | None]:
    """The Hub id of a model spec and its licence (None where not known): the embedded models' originals, a hub id
    as it is; None for the tiny test model and local folders."""
    if spec in EMBEDDED_ORIGINALS:
        return EMBEDDED_ORIGINALS[spec]
    if spec.startswith(("tiny:", "embedded:")) or Path(spec).exists() or spec.count("/") != 1:
        return None, None
    return spec, None


def front_matter(spec: str, pipeline_tag: str, tags: list[str], *, library_name: str) -> dict:
    base, licence = base_model_of(spec)
    data = {"base_model": base, "library_name": library_name, "pipeline_tag": pipeline_tag,
            "tags": ["clemprm", "clembench", *tags], "license": licence}
    return {key: value for key, value in data.items() if value is not None}


# ------------------------------------------------------------------------------------------- rendering


def _value(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value, sort_keys=True)}`"
    return str(value)


def _table(rows: list[tuple], header: tuple = ("", "")) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_value(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _yaml_block(data) -> str:
    import yaml

    return "```yaml\n" + yaml.safe_dump(data, sort_keys=True, default_flow_style=False).rstrip() + "\n```"


def _present(metrics: dict, keys: tuple) -> list[tuple]:
    return [(key, metrics[key]) for key in keys if key in metrics]


def render(meta: dict, title: str, sections: list[tuple[str, str]]) -> str:
    """THE card renderer: YAML front matter, a title and ``(heading, text)`` sections (empty ones left out)."""
    import yaml

    body = [f"# {title}"] + [f"## {heading}\n\n{text.strip()}" for heading, text in sections if text and text.strip()]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False).rstrip() + "\n---\n\n" + "\n\n".join(body) + "\n"


def _common_sections(metrics: dict, output: str | Path) -> list[tuple[str, str]]:
    versions = metrics.get("versions") or {}
    command = (f"```bash\nsnakemake --cores all {output} --configfile CONFIG.yaml\n```\n\nwhere `CONFIG.yaml` holds "
               f"the configuration above (the rule's config sections; the other keys do not change this output; "
               f"the target comes before `--configfile`, which takes every word after it).")
    return [("Versions", _table(sorted(versions.items()), ("package", "version")) if versions else ""),
            ("Reproduce", command)]


def _model_lines(model: dict) -> str:
    return _table([(key, value) for key, value in sorted(model.items()) if value is not None], ("model", ""))


def _examples_section(metrics: dict) -> str:
    examples = metrics.get("examples") or {}
    counts = [(key, value) for key, value in examples.items()
              if not isinstance(value, (dict, list)) and value is not None]
    text = _table(counts, ("split", "count")) if counts else ""
    by_game = {key: value for key, value in examples.items() if key.endswith("_by_game") and value}
    for key, games in by_game.items():
        text += f"\n\n{key.removesuffix('_by_game')} examples by game:\n\n" + _table(sorted(games.items()),
                                                                                    ("game", "examples"))
    for key in ("rows", "pairs_by_source"):
        if examples.get(key):
            text += f"\n\n{key}: {_value(examples[key])}"
    tokens = metrics.get("tokens")
    if tokens:
        text += "\n\ntokens: " + _value(tokens)
    return text


def _training_metrics(metrics: dict) -> str:
    rows = _present(metrics, ("status", "steps", "epochs_run", "max_epochs", "stopped_early", "best_epoch",
                              "train_loss", "final_train_loss", "initial_eval_loss", "eval_loss",
                              "initial_eval_token_accuracy", "eval_token_accuracy", "learning_rates", "optimizer",
                              "effective_batch", "train_seconds", "seconds", "peak_memory_mb"))
    return _table(rows, ("metric", "value"))


PRM_INPUTS = {   # what the card says a PRM reads, by prm.input
    "candidate": "Input: the player's perspective and the candidate answer, P(success | prefix + candidate). Blind: "
                 "it scores a candidate before the game sees it, as clembench plays (one answer per turn).",
    "candidate_with_reply": "Input: the player's perspective, the candidate and the game's reply to it. LOOKAHEAD "
                            "only: a search must play every candidate in a fork of the game to read the reply; its "
                            "figures are no clembench scores.",
}


def _prm_metrics(metrics: dict) -> str:
    text = PRM_INPUTS.get(metrics.get("input"), PRM_INPUTS["candidate_with_reply"]) + "\n\n"
    evaluation = metrics.get("evaluation") or {}
    sides = [(side, values) for side, values in evaluation.items() if values]
    if sides:
        keys = ("n", "auroc", "pearson", "spearman", "bce", "mse")
        text += "Predictions per side:\n\n" + _table(
            [(side, *(values.get(key) for key in keys)) for side, values in sides], ("side", *keys))
    scorers = (metrics.get("ranking") or {}).get("scorers") or {}
    if scorers:
        def overall(values, key):
            return (((values or {}).get("overall") or {}).get(key) or {}).get("value")
        text += ("\n\nWithin-state ranking (held-out siblings), PRM and baselines:\n\n" + _table(
            [(name, overall(values, "pairwise_accuracy"), overall(values, "top1_regret"))
             for name, values in scorers.items()], ("scorer", "pairwise_accuracy", "top1_regret")))
    gate = metrics.get("gate")
    if gate:
        text += f"\n\nQuality gate: **{gate.get('status')}**"
        if gate.get("checks"):
            text += "\n\n" + _table([(c["check"], "passed" if c["passed"] else "FAILED", c["value"], c["threshold"],
                                      c.get("baseline")) for c in gate["checks"]],
                                    ("check", "result", "value", "threshold", "baseline"))
        for check in gate.get("reported") or []:   # calibration where no search reads the values as probabilities
            text += f"\n\nreported, not decisive: {check['check']}: {check['message']}"
        if gate.get("not_judged"):
            text += "\n\nnot judged (no evidence is no pass): " + "; ".join(gate["not_judged"])
    return text


def _rl_metrics(metrics: dict) -> str:
    history = metrics.get("history") or []
    rows = _present(metrics, ("status", "algorithm", "method", "loss", "seconds", "peak_memory_mb"))
    rows.append(("steps", len(history)))
    if history:
        first, last = history[0], history[-1]
        for key in ("reward", "success_rate", "percent_played", "kl", "grad_norm", "trained_turns"):
            if key in first:
                pick = (lambda step: (step[key] or {}).get("mean")) if isinstance(first[key], dict) else \
                    (lambda step: step.get(key))
                rows.append((f"{key} (first step -> last step)", f"{_value(pick(first))} -> {_value(pick(last))}"))
    text = _table(rows, ("metric", "value"))
    stages = metrics.get("stages")
    if stages:
        keys = sorted({key for values in stages.values() for key in (values or {})})
        text += "\n\nPer SCoRe stage:\n\n" + _table([(stage, *((values or {}).get(k) for k in keys))
                                                     for stage, values in stages.items()], ("stage", *keys))
    return text


def adapter_card(kind: str, metrics: dict, output: str | Path) -> str:
    """The card of an adapter folder of ``kind`` (:data:`KINDS`) from its stage's finished metrics."""
    title, method, pipeline_tag, tags, section = KINDS[kind]
    model = metrics.get("model") or {}
    spec = model.get("spec") or (metrics.get("config") or {}).get("model", {}).get("spec", "")
    probe = kind == "prm_probe"
    meta = front_matter(spec, pipeline_tag, tags if probe else ["lora", *tags], library_name="clemprm" if probe
                        else "peft")
    config = metrics.get("config") or {}
    hyper = _yaml_block(config) if config else ""
    if kind in ("sft", "prm", "prm_probe"):
        data, results = _examples_section(metrics), _training_metrics(metrics)
        if kind != "sft":
            results += "\n\n" + _prm_metrics(metrics)
    else:
        states = (metrics.get("data") or {}).get("states")
        data = ("Episodes played online by the policy being trained, on the train split of the configured games"
                + (f" (single turns of the prompt set `{states}`)" if states else "")
                + (f"; games: {_value(config['games'])}" if config.get("games") is not None else "") + ".")
        results = _rl_metrics(metrics)
    base = (f"Base model: `{spec}`" + (f" (Hub: [{meta['base_model']}](https://huggingface.co/{meta['base_model']}))"
                                       if "base_model" in meta else "") + "\n\n" + _model_lines(model))
    usage = ("Load it with clemprm (`clemprm.models.prm.load_prm` with `prm.kind: probe`): it reads the policy "
             "its probe_config.json names." if probe else
             "Load it with PEFT on top of its base model (`PeftModel.from_pretrained(base, folder)`), or with "
             "clemprm's loader (`model.spec` + `model.adapter`).")
    sections = [("Method", method), ("Base model", base), ("Hyperparameters", hyper), ("Training data", data),
                ("Metrics", results), ("Usage", usage), *_common_sections(metrics, output)]
    return render(meta, f"clemprm {title}", sections)


def merged_card(verification: dict, output: str | Path) -> str:
    """The card of a merged checkpoint from its ``verification.json`` content."""
    task, name = verification.get("task"), verification.get("name")
    meta = front_matter(verification.get("base", ""), "text-classification" if task == "seq-cls" else "text-generation",
                        ["merged", *([name] if name else [])], library_name="transformers")
    method = (f"The adapter `{verification.get('adapter')}` ({name}, {task}) merged into its base "
              f"`{verification.get('base')}` (computed in fp32, saved as {verification.get('dtype')}); verified "
              f"against {verification.get('reference')}: the adapter folder's own card describes how it was trained.")
    merged = verification.get("merged") or {}
    rows = [("passed", verification.get("passed")), ("failures", verification.get("failures") or None),
            ("adapter_detectable", verification.get("adapter_detectable")),
            *[(f"merged {key}", value) for key, value in merged.items() if not isinstance(value, dict)],
            ("thresholds", verification.get("thresholds")), ("untied", verification.get("untied") or None),
            ("seconds", verification.get("seconds"))]
    examples = verification.get("examples") or {}
    data = (f"Verified on {examples.get('n')} {examples.get('source')} examples "
            f"({sum(examples.get('tokens') or [])} tokens, at most {examples.get('max_tokens')} each).")
    config = verification.get("config") or {}
    sections = [("Method", method), ("Hyperparameters", _yaml_block(config) if config else ""),
                ("Verification data", data), ("Metrics", _table(rows, ("metric", "value"))),
                *_common_sections(verification, output)]
    return render(meta, f"clemprm merged checkpoint: {name}", sections)


def write_card(folder: str | Path, text: str) -> Path:
    """Write ``text`` as ``folder/README.md`` atomically (a temporary file beside it, moved into place); rank 0 alone in
    a job of several processes."""
    folder = Path(folder)
    if not distributed.is_main():
        return folder / CARD_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{CARD_NAME}.tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / CARD_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder / CARD_NAME


def write_adapter_card(kind: str, adapter_dir: str | Path, metrics: dict) -> Path:
    return write_card(adapter_dir, adapter_card(kind, metrics, adapter_dir))


# ------------------------------------------------------------------------------------------- publishing


class PublishError(RuntimeError):
    """Why a folder cannot be published (offline, no token, no card), raised before anything is uploaded."""


TRUE = {"1", "on", "yes", "true"}


def _reachable(endpoint: str, timeout: float = 5.0) -> bool:
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


def publish_folder(folder: str | Path, repo_id: str, *, private: bool = False) -> str:
    """Upload ``folder`` (an adapter folder or merged checkpoint with its card) to the Hub model repo ``repo_id``
    (created when missing); return the repo's URL. Fails with :class:`PublishError` before uploading anything when
    the folder has no card, the Hub is switched off (``HF_HUB_OFFLINE``) or out of reach, or no token is set
    (``HF_TOKEN`` or ``hf auth login``)."""
    folder = Path(folder)
    if not (folder / CARD_NAME).is_file():
        raise PublishError(f"{folder} has no {CARD_NAME} model card: publish a folder the pipeline wrote "
                           f"(an adapter folder or a merged checkpoint)")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE:
        raise PublishError("offline: HF_HUB_OFFLINE is set, so nothing can be uploaded to the Hub (unset it to "
                           "publish)")
    from huggingface_hub import HfApi, constants, get_token

    token = get_token()
    if not token:
        raise PublishError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    if not _reachable(constants.ENDPOINT):
        raise PublishError(f"offline: {constants.ENDPOINT} cannot be reached from this machine")
    api = HfApi(token=token)
    url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                      ignore_patterns=[".*", "**/.*"], commit_message="Upload from clemprm")
    return str(url)
