"""The ``merge`` stage: a trained adapter merged into its base as a standalone checkpoint, and proof that it matches.

Merging
    The base is loaded by the one model loader in fp32 and full precision (``quantization: none``, even when the
    adapter was trained on a 4-bit NF4 base: a quantized base is never merged into) with the adapter on top and
    merged by :func:`clemprm.models.lora_merge.merge_adapter` (every LoRA layer into its base weight, adapted weights
    shared with another module, such as a tied ``lm_head``, untied first), then cast to ``merge.dtype`` (fp32 by
    default) and saved: config, tokenizer, safetensors shards.

Verification (``verification.json`` beside the weights)
    The saved folder, loaded again through the loader as a local path in fp32, against the reference PEFT(base fp32
    + adapter) on ``merge.examples`` held-out examples of at most ``merge.max_tokens`` tokens (their last tokens):

    - causal LM (the policy adapters): SFT pairs of the held-out SFT instances (the SFT stage's own split; the
      train side when there is none); for an RL adapter trained on a prompt set (``rl.data: states``, no SFT
      stage), its states' prompts with their reference answers (:func:`states_examples`). Per position over the
      vocabulary: mean and max |logit diff|, max KL(reference || merged), argmax agreement, and the mean per-token
      log-likelihood of the example's tokens under both.
    - sequence classification (the PRM, one logit): soft-labelled branch points of the held-out PRM instances. Per
      example the scalar logit: mean and max |logit diff|, max Bernoulli KL of ``sigmoid(logit)``, agreement of
      the decision ``logit > 0``, and the mean soft-label log-likelihood ``y log p + (1 - y) log(1 - p)``. The
      trained ``score`` head must survive the merge: every ``modules_to_save`` module of the adapter must equal its
      trained copy in the saved model (after the cast to ``merge.dtype``).

    The same numbers, so a reader sees the check could have seen a difference, for the adapter itself (the
    reference against the base with the LoRA layers switched off, trained heads kept) and, when ``merge.contrasts``,
    for two wrong merges: the same merge done in half precision (a bf16 base, updates rounded into bf16 weights)
    and, where weights were untied, PEFT's plain ``merge_and_unload()``. Each merge also reports its update:
    ``max ||dW|| / ||W||`` over the merged layers and how much of ``dW`` the merged weights lost
    (``||W_merged - W - dW|| / ||dW||``). The stage fails (:class:`VerificationError`, naming the metric) when the
    merged model misses a threshold of ``merge.thresholds``.

Load a merged model with ``ModelConfig(spec="results/merged/<name>")`` (a local folder: any loader, vLLM, TGI).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from clemprm.config import provenance, sections
from clemprm.play.chat import end_token_ids
from clemprm.model_card import merged_card, write_card
from clemprm.models.lora_merge import lora_disabled, merge_adapter, save_merged
from clemprm.training import peak_memory_mb, sample_at_most, split_instances
from clemprm.records import read_interactions, write_json

log = logging.getLogger(__name__)

# the config section that holds each task's examples (and, for seq-cls, the PRM's base model)
EXAMPLE_SECTION = {"causal-lm": "sft", "seq-cls": "prm"}
HALF_PRECISION = "bfloat16"
# metric -> whether the threshold is a minimum (True) or a maximum (False)
THRESHOLD_IS_MINIMUM = {"mean_abs_logit_diff": False, "max_abs_logit_diff": False, "max_kl": False,
                        "argmax_agreement": True, "log_likelihood_diff": False}
KL_CHUNK = 256   # positions per float64 log-softmax: bounds the memory of a large vocabulary


class VerificationError(RuntimeError):
    """The merged model does not match PEFT(base + adapter) within ``merge.thresholds``."""


def merge_params(config: dict, task: str) -> dict:
    """A merge rule's ``params`` (its rerun trigger): the model, where its examples come from, and ``merge`` but
    for ``adapters`` (which merges the default target asks for, not how one is made)."""
    params = sections(config, "seed", "model", EXAMPLE_SECTION[task], "merge")
    return {**params, "merge": {key: value for key, value in params["merge"].items() if key != "adapters"}}


# --------------------------------------------------------------------------------------------- examples


@dataclass
class Examples:
    """The verification inputs: token ids (each at most ``max_tokens``), soft labels for seq-cls, and where from."""

    sequences: list[list[int]]
    labels: list[float] | None
    source: str


def _held_out(examples: list, keys: list, fraction: float, seed: int, n: int) -> tuple[list, str]:
    """``n`` examples of the instances the training stage held out (its own split), else of its train side."""
    validation_keys = split_instances(keys, fraction, seed)
    held_out = [e for e, key in zip(examples, keys) if key in validation_keys]
    if held_out:
        return sample_at_most(held_out, n, seed), "validation"
    return sample_at_most(examples, n, seed), "train"


def sft_examples(settings: dict, tokenizer, eos_ids: list, data_path: str, n: int, max_tokens: int) -> Examples:
    """``n`` prompt + answer pairs of the SFT stage's held-out instances, rendered and split as it did."""
    from clemprm.stages import sft as sft_stage

    sft = settings["sft"]
    chat = sft_stage.ChatFormat(tokenizer, settings["model"].get("chat_template_kwargs"), eos_ids)
    rows = read_interactions(data_path)
    if sft.get("extra_data"):
        rows += [row for row in read_interactions(sft["extra_data"]) if sft_stage.is_success(row)]
    examples, _ = sft_stage.build_examples(rows, chat, sft["max_length"], "sft_data")
    chosen, source = _held_out(examples, [e.key for e in examples], sft["validation_fraction"], settings["seed"], n)
    return Examples([e.input_ids[-max_tokens:] for e in chosen], None, source)


def prm_examples(settings: dict, tokenizer, labels_path: str, n: int, max_tokens: int) -> Examples:
    """``n`` soft-labelled branch points of the PRM stage's held-out instances, as the PRM reads them."""
    from clemprm.stages import prm as prm_stage

    prm = settings["prm"]
    examples = prm_stage.build_examples(prm_stage.read_labels(labels_path), tokenizer,
                                        settings["model"].get("chat_template_kwargs"), prm["max_length"])
    chosen, source = _held_out(examples, [e.key for e in examples], prm["validation_fraction"], settings["seed"], n)
    return Examples([e.input_ids[-max_tokens:] for e in chosen], [e.label for e in chosen], source)


def is_states_file(path: str) -> bool:
    """Whether ``path`` holds prompt-set states (:data:`clemprm.records.STATES`, parquet) rather than SFT data (a
    parquet or jsonl export of interactions)."""
    import pyarrow.parquet as pq

    from clemprm import records

    return str(path).endswith(".parquet") and set(records.STATES.names) <= set(pq.read_schema(path).names)


def states_examples(settings: dict, tokenizer, eos_ids: list, states_path: str, n: int, max_tokens: int) -> Examples:
    """``n`` states of a prompt set (seeded sample): the prompt the policy saw there + the reference answer, rendered
    as SFT renders a pair (``sft.max_length``)."""
    from clemprm import records
    from clemprm.stages import sft as sft_stage

    chat = sft_stage.ChatFormat(tokenizer, settings["model"].get("chat_template_kwargs"), eos_ids)
    encoded = [chat.encode(row["messages"], row["reference"], settings["sft"]["max_length"])
               for row in records.read_records(states_path, records.STATES)]
    sequences = [prompt + completion for prompt, completion, _ in filter(None, encoded)]
    chosen = sample_at_most(sequences, n, settings["seed"])
    return Examples([ids[-max_tokens:] for ids in chosen], None, "states")


def build_examples(task: str, settings: dict, tokenizer, model, data_path: str) -> Examples:
    """The verification examples of ``task`` from ``data_path``, tokenised for ``model``; an error if there is none."""
    n, max_tokens = settings["merge"]["examples"], settings["merge"]["max_tokens"]
    if task == "causal-lm":
        eos_ids = end_token_ids(tokenizer, model.generation_config)
        from_states = is_states_file(data_path)
        examples = (states_examples if from_states else sft_examples)(settings, tokenizer, eos_ids, data_path, n,
                                                                      max_tokens)
    else:
        examples = prm_examples(settings, tokenizer, data_path, n, max_tokens)
    if not examples.sequences:
        raise VerificationError(f"no example in {data_path} to verify the merge on")
    return examples


# ------------------------------------------------------------------------------------- the model to merge


def adapted_model_config(task: str, settings: dict, adapter_dir: str, dtype: str = "float32",
                         cache_dir: str | None = None):
    """The adapter's base (the PRM's: ``prm.base_model`` or ``model.spec``) + the adapter, unquantized, in ``dtype``."""
    from clemprm.models.loader import ModelConfig
    from clemprm.models.prm import prm_model_config

    model = {**settings["model"], "quantization": "none", "dtype": dtype}
    if task == "seq-cls":
        return prm_model_config(model, settings["prm"], adapter_dir, cache_dir)
    return ModelConfig.from_dict({**model, "adapter": adapter_dir, "cache_dir": cache_dir})


# ----------------------------------------------------------------------------------------- verification


def forward_outputs(model, sequences: list[list[int]]) -> list:
    """fp32 logits on CPU, one unpadded example at a time: ``(T, vocab)`` for a causal LM, ``(1,)`` for seq-cls."""
    import torch

    device = next(model.parameters()).device
    outputs = []
    model.eval()
    with torch.inference_mode():
        for ids in sequences:
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]
            outputs.append(logits.float().cpu())
    return outputs



@dataclass
class Comparison:
    """Accumulates the agreement of two models' outputs over examples (one row of the verification table)."""

    abs_sum: float = 0.0
    values: int = 0
    max_abs: float = 0.0
    max_kl: float = 0.0
    agree: int = 0
    positions: int = 0
    ll_reference: float = 0.0
    ll_other: float = 0.0
    ll_count: int = 0
    max_abs_reference_logit: float = 0.0

    def add_causal_lm(self, reference, other, ids: list[int]) -> None:
        """Per position of one example: |logit diff| over the vocabulary, KL, argmax, next-token log-likelihood."""
        import torch

        self._add_logits(reference, other)
        self.agree += int((reference.argmax(-1) == other.argmax(-1)).sum())
        self.positions += reference.shape[0]
        targets = torch.tensor(ids[1:])
        for start in range(0, reference.shape[0], KL_CHUNK):
            a = torch.log_softmax(reference[start:start + KL_CHUNK].double(), -1)
            b = torch.log_softmax(other[start:start + KL_CHUNK].double(), -1)
            self.max_kl = max(self.max_kl, float((a.exp() * (a - b)).sum(-1).max()))
            chunk_targets = targets[start:start + KL_CHUNK]
            n = chunk_targets.shape[0]   # the last position predicts nothing
            self.ll_reference += float(a[:n].gather(-1, chunk_targets[:, None]).sum())
            self.ll_other += float(b[:n].gather(-1, chunk_targets[:, None]).sum())
            self.ll_count += n

    def add_seq_cls(self, reference, other, label: float) -> None:
        """One example's scalar logit: |diff|, Bernoulli KL of the sigmoids, decision, soft-label log-likelihood."""
        import torch.nn.functional as F

        self._add_logits(reference, other)
        a, b = reference.double(), other.double()
        kl = (a.sigmoid() * (F.logsigmoid(a) - F.logsigmoid(b))
              + (-a).sigmoid() * (F.logsigmoid(-a) - F.logsigmoid(-b)))
        self.max_kl = max(self.max_kl, float(kl.max()))
        self.agree += int(((a > 0) == (b > 0)).sum())
        self.positions += a.numel()
        self.ll_reference += float(label * F.logsigmoid(a) + (1 - label) * F.logsigmoid(-a))
        self.ll_other += float(label * F.logsigmoid(b) + (1 - label) * F.logsigmoid(-b))
        self.ll_count += 1

    def _add_logits(self, reference, other) -> None:
        diff = (reference - other).abs()
        self.abs_sum += float(diff.double().sum())
        self.values += diff.numel()
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_abs_reference_logit = max(self.max_abs_reference_logit, float(reference.abs().max()))

    def as_dict(self) -> dict:
        ll_reference, ll_other = self.ll_reference / self.ll_count, self.ll_other / self.ll_count
        return {"mean_abs_logit_diff": self.abs_sum / self.values, "max_abs_logit_diff": self.max_abs,
                "max_kl": self.max_kl, "argmax_agreement": self.agree / self.positions,
                "log_likelihood": round(ll_other, 6), "reference_log_likelihood": round(ll_reference, 6),
                "log_likelihood_diff": abs(ll_other - ll_reference), "positions": self.positions,
                "max_abs_reference_logit": self.max_abs_reference_logit}


def compare(task: str, reference: list, other: list, examples: Examples) -> dict:
    """One row of the verification table: ``other``'s outputs against ``reference``'s on the examples."""
    comparison = Comparison()
    for i, (a, b) in enumerate(zip(reference, other)):
        if task == "causal-lm":
            comparison.add_causal_lm(a, b, examples.sequences[i])
        else:
            comparison.add_seq_cls(a, b, examples.labels[i])
    return comparison.as_dict()


def threshold_failures(row: dict, thresholds: dict) -> list[str]:
    """The thresholds a row misses, each naming its metric: ``max_abs_logit_diff 0.31 > 0.05``."""
    failures = []
    for metric, limit in thresholds.items():
        value = row[metric]
        if (value < limit) if THRESHOLD_IS_MINIMUM[metric] else (value > limit):
            failures.append(f"{metric} {value:.6g} {'<' if THRESHOLD_IS_MINIMUM[metric] else '>'} {limit:g}")
    return failures


def verification_table(verification: dict) -> str:
    """The verification rows side by side, one line each (for the log and the benchmark)."""
    rows = {"merged": verification["merged"], "adapter (base vs PEFT)": verification["adapter_effect"],
            **{f"contrast: {name}": row for name, row in verification["contrasts"].items() if "skipped" not in row}}
    header = (f"{'':34} {'mean|dlogit|':>12} {'max|dlogit|':>12} {'max KL':>10} {'argmax':>8} {'loglik':>11} "
              f"{'ref loglik':>11} {'max dW/W':>9} {'lost':>8}")
    lines = [header]
    for name, row in rows.items():
        update = row.get("update") or {}
        lines.append(f"{name:34} {row['mean_abs_logit_diff']:12.3g} {row['max_abs_logit_diff']:12.3g} "
                     f"{row['max_kl']:10.3g} {row['argmax_agreement']:8.4f} {row['log_likelihood']:11.6f} "
                     f"{row['reference_log_likelihood']:11.6f} {update.get('max_relative_update', math.nan):9.3g} "
                     f"{update.get('update_lost', math.nan):8.3g}")
    skipped = [f"contrast {name}: {row['skipped']}" for name, row in verification["contrasts"].items()
               if "skipped" in row]
    return "\n".join(lines + skipped)


def _contrast_row(task: str, cfg, reference: list, examples: Examples, naive: bool) -> dict:
    import torch

    merged = merge_adapter(cfg, task, naive=naive)
    row = compare(task, reference, forward_outputs(merged.model.to(torch.float32), examples.sequences), examples)
    if merged.update is not None:
        row["update"] = merged.update
    return row


def verify(task: str, settings: dict, cfg, merged_dir: Path, data_path: str, untied: list[str],
           cache_dir: str | None) -> dict:
    """The verification rows: the merged folder (loaded back through the loader) and, for contrast, the adapter's
    own effect and the wrong merges, each against the reference PEFT(base fp32 + adapter) ``cfg``; the examples."""
    from clemprm.models.loader import ModelConfig, load_tokenizer_and_model

    tokenizer, reference_model = load_tokenizer_and_model(cfg, task=task)
    examples = build_examples(task, settings, tokenizer, reference_model, data_path)
    reference = forward_outputs(reference_model, examples.sequences)
    with lora_disabled(reference_model) as base_model:
        base = forward_outputs(base_model, examples.sequences)
    del reference_model
    _, reloaded = load_tokenizer_and_model(ModelConfig.from_dict(
        {**settings["model"], "spec": str(merged_dir), "adapter": None, "quantization": "none", "dtype": "float32",
         "cache_dir": cache_dir}), task=task)
    rows = {"merged": compare(task, reference, forward_outputs(reloaded, examples.sequences), examples),
            "adapter_effect": compare(task, reference, base, examples), "contrasts": {}}
    del reloaded
    log.info("merge: verified on %d %s examples (%d tokens)", len(examples.sequences), examples.source,
             sum(map(len, examples.sequences)))
    if settings["merge"]["contrasts"]:
        half = adapted_model_config(task, settings, cfg.adapter, HALF_PRECISION, cache_dir)
        rows["contrasts"][f"{HALF_PRECISION}_merge"] = _contrast_row(task, half, reference, examples, naive=False)
        rows["contrasts"]["peft_merge_and_unload"] = (
            _contrast_row(task, cfg, reference, examples, naive=True) if untied else
            {"skipped": "no adapted weight is shared (tied): merge_and_unload() is the same merge"})
    rows["examples"] = {"n": len(examples.sequences), "source": examples.source,
                        "tokens": [len(ids) for ids in examples.sequences],
                        "max_tokens": settings["merge"]["max_tokens"]}
    return rows


def merge_and_verify(name: str, task: str, settings: dict, adapter_dir: str, data_path: str, output_dir: str,
                     cache_dir: str | None = None) -> dict:
    """Merge the adapter of ``adapter_dir`` into its base, save it as ``output_dir`` with ``verification.json``;
    raise :class:`VerificationError` (after logging the table, leaving no ``output_dir``) when the merged model misses
    a threshold. ``settings``: the rule's params (:func:`merge_params`); ``data_path``: the examples' source (SFT
    data for a causal LM, soft labels for seq-cls)."""
    import transformers

    if task not in EXAMPLE_SECTION:
        raise ValueError(f"merge task must be one of {', '.join(EXAMPLE_SECTION)}, got {task!r}")
    merge = settings["merge"]
    start = time.perf_counter()
    transformers.set_seed(settings["seed"])   # a seq-cls base draws a fresh head before the adapter's replaces it
    cfg = adapted_model_config(task, settings, adapter_dir, "float32", cache_dir)
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    tmp = tmp_root / output_dir.name   # created by save_pretrained with the usual permissions (mkdtemp's are 0700)
    try:
        merged = merge_adapter(cfg, task)
        modules = save_merged(merged, tmp, merge["dtype"])
        del merged.model
        merge_seconds, merge_memory = time.perf_counter() - start, peak_memory_mb()
        log.info("merge %s: %s (%s) merged into %s in %.1f s, untied %s; update %s; saved as %s", name, adapter_dir,
                 task, cfg.spec, merge_seconds, merged.untied or "nothing", merged.update, merge["dtype"])
        rows = verify(task, settings, cfg, tmp, data_path, merged.untied, cache_dir)
        rows["merged"]["update"] = merged.update
        thresholds = merge["thresholds"]
        failures = threshold_failures(rows["merged"], thresholds)
        failures += [f"modules_to_save {module} not kept" for module, kept in modules.items() if not kept]
        verification = {
            "name": name, "task": task, "adapter": str(adapter_dir), "base": cfg.spec, "dtype": merge["dtype"],
            "reference": "PEFT(base fp32 + adapter)", "untied": merged.untied, "modules_to_save": modules,
            "examples": rows["examples"], "thresholds": thresholds, "merged": rows["merged"],
            "adapter_effect": rows["adapter_effect"],
            "adapter_detectable": rows["adapter_effect"]["max_abs_logit_diff"] > thresholds["max_abs_logit_diff"],
            "contrasts": rows["contrasts"], "passed": not failures, "failures": failures,
            "seconds": {"merge": round(merge_seconds, 2), "total": round(time.perf_counter() - start, 2)},
            "peak_memory_mb": {"merge": merge_memory, "total": peak_memory_mb()},
            **provenance(settings)}
        log.info("merge %s verification (%s):\n%s", name, "passed" if not failures else "FAILED",
                 verification_table(verification))
        if not verification["adapter_detectable"]:
            log.warning("merge %s: the adapter moves no logit by more than the max_abs_logit_diff threshold (an "
                        "untrained adapter?): the check cannot tell a right merge from a wrong one", name)
        if failures:
            raise VerificationError(f"merged model {output_dir} does not match PEFT(base + adapter): "
                                    f"{'; '.join(failures)}")
        write_json(tmp / "verification.json", verification)
        write_card(tmp, merged_card(verification, output_dir))   # moves into place with the checkpoint
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(tmp, output_dir)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return verification
