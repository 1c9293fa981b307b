"""What the decoder samples: what HF ``model.generate`` samples, from one uniform draw per row and step.

The model's ``generation_config.sequence_bias`` (single-token entries, :func:`sequence_bias_of`), then temperature,
top-k (HF's default: the generation config's ``top_k``, else 50; 0 turns it off) and top-p with HF's semantics (drop
the tokens whose ascending cumulative probability is <= 1 - top_p, always keep the best). Greedy (temperature 0)
picks the same tokens as HF greedy ``generate``. A uniform turns into a token by inverse-CDF sampling on the top-k
candidates only (no full-vocabulary sort or multinomial per step), so a row's token depends only on its logits, its
uniform and the settings. :func:`unsupported_generation_settings` names what HF would apply and this does not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

NUCLEUS_CANDIDATES = 1024   # top-p without top-k: candidates looked at before a full sort is needed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: off
    max_new_tokens: int = 64
    min_new_tokens: int = 0        # HF semantics: end tokens are impossible before this many new tokens

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i of each row with cumsum(probs)[i-1] <= u * total < cumsum(probs)[i] (probs >= 0, any scale)."""
    cdf = probs.double().cumsum(-1)
    target = u.double().unsqueeze(-1) * cdf[:, -1:]
    idx = (cdf <= target).sum(-1)
    # never past the last token with mass (u * total < total, but guard against rounding)
    last = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(idx, last)


def _nucleus_keep(sorted_probs: torch.Tensor, top_p: float, outside_mass: torch.Tensor | float = 0.0) -> torch.Tensor:
    """HF TopP on descending-sorted probs: keep j unless (mass of j and all below it) <= 1 - top_p; keep the best."""
    tail = sorted_probs.flip(-1).cumsum(-1).flip(-1)  # ascending cumulative sum, as HF computes it
    if not isinstance(outside_mass, float) or outside_mass:
        tail = tail + (outside_mass.unsqueeze(-1) if isinstance(outside_mass, torch.Tensor) else outside_mass)
    keep = tail > (1 - top_p)
    keep[:, 0] = True
    return keep


def sample_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Next tokens for rows of float32 ``logits`` (bias already added); ``uniforms`` one U[0,1) per row."""
    if params.greedy:
        return logits.argmax(-1)
    scores = logits / params.temperature if params.temperature != 1.0 else logits
    vocab = scores.shape[-1]
    top_p = params.top_p
    if params.top_k and params.top_k < vocab:
        values, indices = scores.topk(params.top_k, dim=-1)        # sorted, descending
        probs = values.softmax(-1)
        if top_p < 1.0:
            probs = probs * _nucleus_keep(probs, top_p)
        return indices.gather(-1, _inverse_cdf(probs, uniforms).unsqueeze(-1)).squeeze(-1)
    if top_p >= 1.0:                                                # the full distribution
        return _inverse_cdf(scores.softmax(-1), uniforms)
    # top-p alone: look at the best candidates; rows whose nucleus is wider get a full sort
    k = min(NUCLEUS_CANDIDATES, vocab)
    values, indices = scores.topk(k, dim=-1)
    log_z = scores.logsumexp(-1, keepdim=True)
    probs = (values - log_z).exp()
    outside = (1.0 - probs.sum(-1)).clamp_min(0.0)
    wide = outside > (1 - top_p)
    if bool(wide.any()):
        rows = wide.nonzero().squeeze(-1)
        full_values, full_indices = scores[rows].sort(-1, descending=True)
        full_probs = full_values.softmax(-1)
        full_probs = full_probs * _nucleus_keep(full_probs, top_p)
        full_choice = full_indices.gather(-1, _inverse_cdf(full_probs, uniforms[rows]).unsqueeze(-1)).squeeze(-1)
    probs = probs * _nucleus_keep(probs, top_p, outside)
    choice = indices.gather(-1, _inverse_cdf(probs, uniforms).unsqueeze(-1)).squeeze(-1)
    if bool(wide.any()):
        choice[rows] = full_choice
    return choice


def sequence_bias_of(generation_config) -> dict[int, float]:
    """Single-token entries of ``generation_config.sequence_bias`` (longer sequences are not supported)."""
    bias = getattr(generation_config, "sequence_bias", None)
    if not bias:
        return {}
    items = bias.items() if isinstance(bias, dict) else [(tuple(seq), value) for seq, value in bias]
    out: dict[int, float] = {}
    for seq, value in items:
        seq = tuple(seq)
        if len(seq) != 1:
            log.warning("ignoring multi-token sequence_bias entry %s (only single tokens are supported)", seq)
            continue
        out[int(seq[0])] = out.get(int(seq[0]), 0.0) + float(value)
    return out


_UNSUPPORTED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_p": None, "typical_p": 1.0,
                "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "bad_words_ids": None, "suppress_tokens": None,
                "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                "min_new_tokens": None, "min_length": 0, "top_h": None, "exponential_decay_length_penalty": None,
                "encoder_repetition_penalty": 1.0, "guidance_scale": None}


def unsupported_generation_settings(generation_config) -> dict:
    """Settings of a model's generation config that HF generate would apply and this decoder does not."""
    found = {}
    for key, neutral in _UNSUPPORTED.items():
        value = getattr(generation_config, key, neutral)
        if value is not None and value != neutral and not (key == "min_length" and value == 0):
            found[key] = value
    return found
