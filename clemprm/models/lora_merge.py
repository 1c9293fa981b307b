"""Merging a LoRA adapter into its base weights, in the weights' own dtype, and what the merge did to them.

:func:`merge_adapter` loads a base + adapter through the one model loader, merges every LoRA layer into its base
weight (``W + B @ A * scale``, PEFT's own per-layer ``merge``) and unwraps the model (a ``modules_to_save`` copy such
as the PRM's ``score`` head replaces the original module); :func:`save_merged` casts and saves it. The merge stage
(:mod:`clemprm.stages.merge`) loads the base in fp32 and checks the result; this module knows no pipeline config.

Tied embeddings
    When the base ties ``lm_head`` to ``embed_tokens`` (SmolLM2 does) and the adapter targets one of them, PEFT's
    ``merge_and_unload()`` adds the delta to the one shared tensor, so the merged model also reads changed input
    embeddings, which the adapted model never did. Here every adapted weight that another module shares gets its
    own copy before the merge: ``lm_head.weight = embed_tokens.weight + B @ A`` as its own tensor, ``embed_tokens``
    unchanged, and ``tie_word_embeddings: false`` in the saved config. ``merge_adapter(..., naive=True)`` is PEFT's
    plain ``merge_and_unload()``, the stage's contrast.
"""

from __future__ import annotations

import collections
import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path


def lora_layers(peft_model) -> dict:
    """The LoRA layers of a PEFT model by module name (relative to the base model)."""
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in peft_model.get_base_model().named_modules()
            if isinstance(module, LoraLayer)}


def untie_adapted_weights(peft_model) -> list[str]:
    """Give every adapted weight that another module shares (``lm_head`` tied to ``embed_tokens``) its own copy, and
    untie the config, so merging changes that module alone. Returns the names of the untied modules."""
    import torch

    base = peft_model.get_base_model()
    owners = collections.Counter(id(p) for _, p in base.named_parameters(remove_duplicate=False))
    untied = []
    for name, layer in lora_layers(peft_model).items():
        module = layer.get_base_layer()
        if owners[id(module.weight)] > 1:
            module.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            untied.append(name)
    if untied:
        for config in {id(c): c for c in (base.config, base.config.get_text_config())}.values():
            config.tie_word_embeddings = False
    return untied


@dataclass
class UpdateStats:
    """What a merge did to the weights: merged layers, the largest relative update ``||dW|| / ||W||`` and how much of
    the updates the merged weights lost, ``||W_merged - W - dW|| / ||dW||`` over all layers (0: exact)."""

    layers: int = 0
    max_relative_update: float = 0.0
    squared_update: float = 0.0
    squared_error: float = 0.0

    def add(self, before, after, delta) -> None:
        """One layer's fp32 weights before and after its merge, and its update; no float64 copies (an lm_head is
        large): ``after - before`` is exact in fp32 for an update much smaller than the weights (Sterbenz)."""
        import torch

        def norm(tensor) -> float:
            return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))

        self.layers += 1
        update = norm(delta)
        self.max_relative_update = max(self.max_relative_update, update / max(norm(before), 1e-30))
        self.squared_update += update ** 2
        error = after - before
        error -= delta
        self.squared_error += norm(error) ** 2

    def as_dict(self) -> dict:
        lost = math.sqrt(self.squared_error / self.squared_update) if self.squared_update else 0.0
        return {"layers": self.layers, "max_relative_update": self.max_relative_update, "update_lost": lost}


def merge_lora_layers(peft_model):
    """Merge every LoRA layer into its base weight (PEFT's per-layer merge, in the weights' dtype) and unwrap the
    model; ``(model, UpdateStats)``."""
    import torch

    stats = UpdateStats()
    for layer in lora_layers(peft_model).values():
        weight = layer.get_base_layer().weight
        before = weight.detach().to(torch.float32, copy=True)
        delta = sum(layer.get_delta_weight(adapter).float() for adapter in layer.active_adapters)
        layer.merge(adapter_names=list(layer.active_adapters))
        stats.add(before, weight.detach().float(), delta)
    return peft_model.unload(), stats


def saved_modules(peft_model) -> dict:
    """The trained ``modules_to_save`` copies (e.g. the PRM's ``score`` head) by module name: their state dicts."""
    from peft.utils import ModulesToSaveWrapper

    return {name: {key: value.detach().clone() for key, value in
                   module.modules_to_save[module.active_adapter].state_dict().items()}
            for name, module in peft_model.get_base_model().named_modules() if isinstance(module, ModulesToSaveWrapper)}


def modules_kept(model, trained: dict, dtype) -> dict:
    """Per ``modules_to_save`` module: whether the merged model holds its trained weights (cast to ``dtype``)."""
    kept = {}
    for name, state in trained.items():
        merged = model.get_submodule(name).state_dict()
        kept[name] = all(key in merged and merged[key].dtype == dtype and bool((merged[key] == value.to(dtype)).all())
                         for key, value in state.items())
    return kept


@dataclass
class Merged:
    """A merged model and what its merge did."""

    model: object
    tokenizer: object
    update: dict | None
    untied: list[str] = field(default_factory=list)
    modules_to_save: dict = field(default_factory=dict)


def merge_adapter(cfg, task: str, *, naive: bool = False) -> Merged:
    """Load ``cfg`` (base + adapter, through the loader) and merge it: adapted shared weights untied first, every
    LoRA layer merged in the weights' dtype; or, ``naive``, by PEFT's own ``merge_and_unload()`` (a contrast)."""
    from clemprm.models.loader import load_tokenizer_and_model

    tokenizer, peft_model = load_tokenizer_and_model(cfg, task=task)
    trained = saved_modules(peft_model)
    if naive:
        with _quiet_peft_tying_warnings():
            return Merged(peft_model.merge_and_unload(), tokenizer, None, [], trained)
    untied = untie_adapted_weights(peft_model)
    model, stats = merge_lora_layers(peft_model)
    return Merged(model, tokenizer, stats.as_dict(), untied, trained)


@contextlib.contextmanager
def _quiet_peft_tying_warnings():
    """PEFT warns that merging a tied layer 'can lead to complications': the naive contrast shows which."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*no longer tied.*")
        yield


def save_merged(merged: Merged, out_dir: Path, dtype_name: str) -> dict:
    """Cast to ``dtype_name`` and save weights, config, generation config and tokenizer; the ``modules_to_save``
    check of the saved weights."""
    import torch

    dtype = getattr(torch, dtype_name)
    model = merged.model.to(dtype)
    kept = modules_kept(model, merged.modules_to_save, dtype)
    model.config.dtype = dtype_name
    model.save_pretrained(str(out_dir))
    merged.tokenizer.save_pretrained(str(out_dir))
    return kept


@contextlib.contextmanager
def lora_disabled(peft_model):
    """The base model inside ``peft_model``: LoRA layers off, trained ``modules_to_save`` heads kept."""
    layers = list(lora_layers(peft_model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield peft_model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
