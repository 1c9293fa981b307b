"""A probe PRM (``prm.kind: probe``): linear heads on the frozen policy's own hidden states, scored through the one
PRM interface (:class:`ProbeScorer` is a :class:`clemprm.models.prm.PRMScorer`: the same ``score(pairs)``, the
same text, the same counters), so every eval mode, the gate, the report and the seeds table read either kind.

Features
    The policy that plays (``model.spec`` + the SFT adapter, frozen, loaded by the one model loader) reads the pair
    text of :func:`clemprm.models.prm.encode_pair` (prefix + candidate, left-truncated to ``prm.max_length``) once,
    forward only. For each layer of ``prm.probe.layers`` (indices into the model's hidden states: ``-1`` the last
    layer's output, ``0`` the embeddings) the features are its state at the last token and the mean of its states
    over the last ``prm.probe.window`` tokens: ``2 x len(layers) x hidden_size`` numbers. Batches are padded on the
    right, so a pair's features do not depend on the batch it is in (no prefix sharing: the pooled window may reach
    into the shared prefix).

Heads
    A :class:`LinearProbe` standardises the features with the mean and standard deviation of the data it was fitted on
    (the train side) and gives one logit. The value head predicts the soft label; an optional validity head, fitted
    on answers of played episodes labelled by the game's verdict, predicts that the game accepts the candidate. The
    score is ``sigmoid(value)`` (combination ``value``) or ``sigmoid(value) x sigmoid(validity)`` (``product``).
    The fitting (:mod:`clemprm.stages.probe`) chooses the ridge strength and the combination on train instances.

Folder (the ``prm_adapter`` stage's output, ``results/prm/adapter/``)
    ``probe.safetensors`` (each head's mean, std, weight and bias), ``probe_config.json`` (kind, layers, window, the
    input and length the text was read with, the policy: model spec, SFT adapter path and its SHA-256, the choices
    and their cross-validation figures) and the model card ``README.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from clemprm.models.loader import ModelConfig, policy_settings, resolve_dtype
from clemprm.models.scoring import (PrefixGroup, forward_on_shared_prefixes, group_batches, micro_batches,
                                    pad_right, prefix_sharing_problem, shared_prefix_groups)

COMBINATIONS = ("value", "product")  # prm.probe.combination candidates
CONFIG_NAME = "probe_config.json"
WEIGHTS_NAME = "probe.safetensors"
HEADS = ("value", "validity")


def adapter_sha256(folder: str | None) -> str | None:
    """SHA-256 over the files of an adapter folder (relative names and contents, sorted), None without a folder: what
    ties a probe to the exact SFT policy it reads."""
    if not folder:
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name != "README.md"):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def policy_model_config(model_settings: dict, prm_settings: dict, sft_adapter: str | None,
                        cache_dir: str | None = None) -> ModelConfig:
    """The frozen policy a probe reads: ``model.spec`` + ``sft_adapter`` (None: the base policy). ``prm.base_model``
    names a LoRA PRM's own base; a probe has none, so a set one is an error."""
    if prm_settings.get("base_model"):
        raise ValueError(f"prm.base_model is {prm_settings['base_model']!r}, but prm.kind: probe reads the policy "
                         f"itself (model.spec + the SFT adapter): set prm.base_model: null or prm.kind: lora")
    return ModelConfig.from_dict({**policy_settings(model_settings, sft_adapter), "cache_dir": cache_dir})


class ProbeFeatures:
    """The features of encoded pairs (:func:`clemprm.models.prm.encode_pair`) from a frozen causal LM: per layer of
    ``layers``, the last token's hidden state and the mean over the last ``window`` tokens. Pairs of one key (a
    state's siblings, one search turn's candidates) read their common token prefix once
    (:func:`~clemprm.models.scoring.forward_on_shared_prefixes`) where the model's cache allows it: a blind search's
    N candidates then cost one pass over the prompt and N short ones over the answers. ``cache``: remember each
    sequence's features (the training stage reads the train side twice: to fit, then to evaluate)."""

    def __init__(self, cfg: ModelConfig, tokenizer, model, layers: list[int], window: int, token_budget: int,
                 cache: bool = False, share_prefixes: bool = True):
        if not layers or window < 1:
            raise ValueError(f"prm.probe.layers must name at least one layer and prm.probe.window be >= 1, got "
                             f"{layers!r} and {window!r}")
        self.cfg, self.tokenizer, self.model = cfg, tokenizer, model
        self.layers, self.window, self.token_budget = [int(layer) for layer in layers], int(window), int(token_budget)
        self.cache = {} if cache else None
        self.share_prefixes = share_prefixes and prefix_sharing_problem(model) is None

    def of(self, sequences: list[list[int]], keys: list | None = None):
        """``[len(sequences), features]`` fp32 CPU tensor; the pairs of one key on their shared prefix, the others in
        length-sorted micro-batches under the token budget. Equal with or without keys up to float rounding."""
        import torch

        todo = [i for i, ids in enumerate(sequences) if self.cache is None or tuple(ids) not in self.cache]
        pending = [sequences[i] for i in todo]
        groups, alone = shared_prefix_groups(pending, [keys[i] for i in todo] if keys and self.share_prefixes
                                             else None)
        rows = {}
        device = next(self.model.parameters()).device
        dtype = resolve_dtype(self.cfg, device.type)
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype,
                                                    enabled=device.type == "cuda" and dtype != torch.float32):
            for batch in micro_batches([len(pending[i]) for i in alone], self.token_budget):
                indices = [alone[i] for i in batch]
                rows.update(zip(indices, self._forward([pending[i] for i in indices])))
            for batch in group_batches(groups, self.token_budget):
                rows.update(zip([i for group in batch for i in group.rows], self._forward_shared(pending, batch)))
        if self.cache is not None:
            self.cache.update((tuple(pending[i]), row) for i, row in rows.items())
        if not sequences:
            return torch.zeros((0, 0))
        found = {todo[i]: row for i, row in rows.items()}
        return torch.stack([found[i] if i in found else self.cache[tuple(ids)] for i, ids in enumerate(sequences)])

    def _hidden(self, states) -> list:
        """The hidden states of :attr:`layers`, fp32; a clear error for a layer the model does not have."""
        if any(not -len(states) <= layer < len(states) for layer in self.layers):
            raise ValueError(f"prm.probe.layers {self.layers} reach outside the {len(states)} hidden states of "
                             f"{self.cfg.spec} (-{len(states)} .. {len(states) - 1}): choose layers it has")
        return [states[layer].float() for layer in self.layers]

    def _forward(self, sequences: list[list[int]]):
        """Features of whole sequences, padded on the right, in one pass."""
        import torch

        device = next(self.model.parameters()).device
        input_ids, attention_mask = pad_right(sequences, self.tokenizer.pad_token_id)
        states = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                            output_hidden_states=True, logits_to_keep=1).hidden_states
        lengths = attention_mask.sum(1)
        positions = torch.arange(input_ids.shape[1])
        window = ((positions < lengths[:, None]) & (positions >= (lengths - self.window)[:, None])).float().to(device)
        last = (lengths - 1).to(device)
        features = []
        for hidden in self._hidden(states):
            features.append(hidden[torch.arange(len(sequences), device=device), last])
            features.append((hidden * window[..., None]).sum(1) / window.sum(1, keepdim=True))
        return torch.cat(features, dim=1).cpu()

    def _forward_shared(self, sequences: list[list[int]], groups: list[PrefixGroup]):
        """Features of the groups' rows (in group order) on their shared prefixes: the last token is always the
        row's own (its suffix keeps one at least); a window longer than the suffix reaches back into the prefix
        pass's last columns (left padded: every prefix ends in the last one)."""
        import torch

        device = next(self.model.parameters()).device
        hidden_states = {"output_hidden_states": True, "logits_to_keep": 1}
        shared = forward_on_shared_prefixes(self.model, sequences, groups, self.tokenizer.pad_token_id,
                                            prefix_kwargs=hidden_states, suffix_kwargs=hidden_states)
        owner = torch.tensor([k for k, group in enumerate(groups) for _ in group.rows])
        prefix_lengths = torch.tensor([group.shared for group in groups for _ in group.rows])
        suffix_lengths = torch.tensor([len(sequences[i]) - group.shared for group in groups for i in group.rows])
        columns = torch.arange(shared.suffix_ids.shape[1])
        suffix_window = ((columns < suffix_lengths[:, None])
                         & (columns >= (suffix_lengths - self.window)[:, None])).float().to(device)
        width = shared.prefix.hidden_states[0].shape[1]
        from_end = width - torch.arange(width)   # 1 for the last column
        reach = (self.window - suffix_lengths).clamp_min(0).clamp_max(prefix_lengths)   # prefix tokens in the window
        prefix_window = (from_end <= reach[:, None]).float().to(device)
        count = suffix_window.sum(1, keepdim=True) + prefix_window.sum(1, keepdim=True)
        last = (suffix_lengths - 1).to(device)
        features = []
        for prefix, suffix in zip(self._hidden(shared.prefix.hidden_states), self._hidden(shared.suffix.hidden_states)):
            features.append(suffix[torch.arange(len(owner), device=device), last])
            window_sum = (suffix * suffix_window[..., None]).sum(1) + torch.einsum("rc,rcd->rd", prefix_window,
                                                                                   prefix[owner.to(device)])
            features.append(window_sum / count)
        return torch.cat(features, dim=1).cpu()


@dataclass
class LinearProbe:
    """One logit from standardised features: ``((features - mean) / std) @ weight + bias``."""

    mean: object   # torch tensors, [features]
    std: object
    weight: object
    bias: object   # [1]

    def logits(self, features):
        return ((features - self.mean) / self.std) @ self.weight + self.bias

    def tensors(self, name: str) -> dict:
        return {f"{name}.{key}": getattr(self, key).contiguous() for key in ("mean", "std", "weight", "bias")}


def combined_logits(value, validity, combination: str):
    """The score's logit: the value head's (``value``), or that of ``sigmoid(value) x sigmoid(validity)``
    (``product``: success needs an answer the game accepts), computed in log space."""
    import torch
    import torch.nn.functional as F

    if combination == "value":
        return value
    if combination != "product":
        raise ValueError(f"prm.probe.combination: unknown {combination!r} (known: {', '.join(COMBINATIONS)})")
    log_p = (F.logsigmoid(value) + F.logsigmoid(validity)).clamp(max=-1e-7)
    return log_p - torch.log(-torch.expm1(log_p))


@dataclass
class ProbeHead:
    """The value head, the optional validity head and how the score combines them."""

    value: LinearProbe
    validity: LinearProbe | None = None
    combination: str = "value"

    def logits(self, features):
        validity = self.validity.logits(features) if self.validity is not None else None
        return combined_logits(self.value.logits(features), validity, self.combination)

    def save(self, folder: str | Path, config: dict) -> None:
        """Write the weights and ``config`` (:data:`CONFIG_NAME`, with the combination) into ``folder``."""
        from safetensors.torch import save_file

        Path(folder).mkdir(parents=True, exist_ok=True)
        tensors = self.value.tensors("value")
        if self.validity is not None:
            tensors.update(self.validity.tensors("validity"))
        save_file(tensors, str(Path(folder) / WEIGHTS_NAME))
        text = json.dumps({**config, "combination": self.combination}, indent=2, sort_keys=True, default=str)
        (Path(folder) / CONFIG_NAME).write_text(text + "\n")

    @classmethod
    def load(cls, folder: str | Path, combination: str) -> "ProbeHead":
        from safetensors.torch import load_file

        tensors = load_file(str(Path(folder) / WEIGHTS_NAME))
        heads = {name: LinearProbe(*(tensors[f"{name}.{key}"] for key in ("mean", "std", "weight", "bias")))
                 for name in HEADS if f"{name}.weight" in tensors}
        return cls(heads["value"], heads.get("validity"), combination)


def read_probe_config(adapter_dir: str) -> dict:
    """The probe folder's config, its policy checked: the SFT adapter it was fitted on is there, unchanged (its
    SHA-256: a probe reads one policy's states). A folder without a config, or a changed policy, is an error that says
    what to do."""
    path = Path(adapter_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no {CONFIG_NAME}: it is no probe PRM, but prm.kind is probe; rerun "
                                f"the prm_adapter rule with prm.kind: probe (or set prm.kind: lora)")
    config = json.loads(path.read_text())
    sft_adapter = config["policy"]["sft_adapter"]
    if sft_adapter and not os.path.isdir(sft_adapter):
        raise FileNotFoundError(f"the probe PRM of {adapter_dir} reads the SFT policy {sft_adapter}, which does not "
                                f"exist here: rerun the sft_adapter and prm_adapter rules")
    if adapter_sha256(sft_adapter) != config["policy"]["sft_adapter_sha256"]:
        raise ValueError(f"the SFT adapter {sft_adapter} changed since the probe PRM of {adapter_dir} was fitted on "
                         f"its states: rerun the prm_adapter rule")
    return config
