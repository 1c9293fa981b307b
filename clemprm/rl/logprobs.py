"""Per-token log-probabilities of played answers under one base model with several LoRA adapters.

* Selective log-softmax: ``logit[token] - logsumexp(logits)`` per position, never a full ``[T, vocab]`` log-softmax
  tensor (nor its gradient).
* Only the answer's positions reach the LM head (``logits_to_keep``); ``use_cache=False``: a training forward
  builds no cache.
* The policy's reference is the same weights with the adapters disabled (:func:`adapters_disabled`); the implicit
  PRM is a second adapter on the same base (:func:`using_adapter`): one model in memory.
* Log-probabilities are of the model's own distribution (temperature 1), whatever temperature sampled the answer.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from clemprm.models.scoring import selective_log_softmax


def _keeps_logits(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(type(base).forward).parameters


def answer_logprobs(model, prompt_ids: list[int], completion_ids: list[int],
                    compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``log p(completion token t | prompt, completion[:t])`` for every answer token (``[len(completion)]``), with
    gradients if enabled. ``compute_dtype`` (bf16/fp16 on CUDA): under autocast to it, as a 4-bit base whose LoRA
    and norms were made fp32 for training computes."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long, device=device)
    n = len(completion_ids)
    kwargs = {"use_cache": False}
    if _keeps_logits(model):
        kwargs["logits_to_keep"] = n + 1
    autocast = compute_dtype is not None and compute_dtype != torch.float32 and device.type == "cuda"
    with torch.autocast(device.type, dtype=compute_dtype or torch.float32, enabled=autocast):
        logits = model(input_ids=input_ids, **kwargs).logits[0]
    logits = logits[-(n + 1):-1]    # position i predicts token i + 1: the n positions before each answer token
    return selective_log_softmax(logits, input_ids[0, -n:])


@contextlib.contextmanager
def using_adapter(model, name: str):
    """Run ``model`` with the LoRA adapter ``name`` active. PEFT's ``set_adapter`` also makes the active adapter
    trainable and the others frozen: the trainable flags are kept as they were."""
    previous = model.active_adapter
    flags = [(param, param.requires_grad) for param in model.parameters()]
    model.set_adapter(name)
    try:
        yield model
    finally:
        model.set_adapter(previous)
        for param, requires_grad in flags:
            param.requires_grad_(requires_grad)


@contextlib.contextmanager
def merged_for_generation(model, name: str):
    """Generate with the LoRA adapter ``name`` active and, where exact, merged into the base weights, unmerged on
    exit. Merged, a forward costs what the plain model's does (SmolLM2 with the SFT adapter, batch 12, 1 thread:
    31 tokens/s unmerged, 52 as the plain model). Only an fp32, unquantized base is merged (never merge into a 4-bit
    base; a bf16 merge and unmerge would round the weights); otherwise the adapter just stays active."""
    base = model.get_base_model()
    mergeable = getattr(base, "hf_quantizer", None) is None and base.dtype == torch.float32
    with using_adapter(model, name):
        if not mergeable:
            yield model
            return
        model.base_model.merge_adapter([name])
        try:
            yield model
        finally:
            model.base_model.unmerge_adapter()


def adapters_disabled(model):
    """The base model (every adapter off): the policy's KL reference."""
    return model.disable_adapter()


@contextlib.contextmanager
def frozen(model):
    """No gradients and eval mode (no dropout: a reference is a fixed distribution), restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def reference_logprobs(model, prompt_ids: list[int], completion_ids: list[int],
                       compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Answer log-probabilities of the base model (adapters disabled), without gradients or dropout."""
    with frozen(model), adapters_disabled(model):
        return answer_logprobs(model, prompt_ids, completion_ids, compute_dtype)
