"""One-token decode attention on CPU without the SDPA kernel, whose per-call overhead dominates at one query token.

Within :class:`fast_decode_attention`, a CPU model whose layers use "sdpa" attention uses :func:`_decode_attention`
instead (registered with transformers' attention interface as :data:`FAST_ATTENTION`): two small matmuls and a softmax
for a one-token step, SDPA itself for everything else (prefill, GPU, dropout, keyword arguments that change the
computation). It saves about 10% of a SmolLM2 decode step; :data:`FAST_DECODE_ATTENTION` False turns it off.
"""

from __future__ import annotations

import torch

FAST_DECODE_ATTENTION = True  # one-token attention steps on CPU without the SDPA kernel (see _decode_attention)

FAST_ATTENTION = "clemprm_sdpa"
# keyword arguments attention layers pass along that do not change the computation (None values never do)
_SAFE_ATTENTION_KWARGS = {"position_ids", "sliding_window", "use_cache", "cache", "past_key_values", "cache_position",
                          "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


def _decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """SDPA, except for one-token decode steps on CPU: two small matmuls and a softmax instead of the flash
    kernel, whose per-call overhead dominates at one query token (about 10% of a SmolLM2 decode step)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    extra = {k for k, v in kwargs.items() if v is not None and v is not False and k not in _SAFE_ATTENTION_KWARGS}
    if query.shape[2] != 1 or query.device.type != "cpu" or extra or (dropout and module.training):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    global FAST_ATTENTION_CALLS
    FAST_ATTENTION_CALLS += 1
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)      # the query heads of each key/value head
    scores = torch.matmul(q, key.transpose(-1, -2))
    scores = scores * (scaling if scaling is not None else dim ** -0.5)
    if attention_mask is not None:                                  # (batch, 1, 1, kv) bool or additive
        mask = attention_mask[..., -key.shape[2]:]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(scores.softmax(-1), value)                   # (batch, kv_heads, group, dim_v)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


_FAST_ATTENTION_REGISTERED = False
FAST_ATTENTION_CALLS = 0  # layer calls that took the fast path (tests check that it is used)


class fast_decode_attention:
    """Within the block, a CPU model that uses "sdpa" attention uses :func:`_decode_attention` instead."""

    def __init__(self, model):
        self.configs = []
        try:
            device = next(model.parameters()).device.type
        except StopIteration:
            device = "cpu"
        if device != "cpu" or not FAST_DECODE_ATTENTION:
            return
        seen = set()
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and id(config) not in seen:
                seen.add(id(config))
                if getattr(config, "_attn_implementation_internal", None) == "sdpa":
                    self.configs.append(config)

    def __enter__(self):
        global _FAST_ATTENTION_REGISTERED
        if self.configs and not _FAST_ATTENTION_REGISTERED:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
            AttentionInterface.register(FAST_ATTENTION, _decode_attention)
            AttentionMaskInterface.register(FAST_ATTENTION, sdpa_mask)
            _FAST_ATTENTION_REGISTERED = True
        for config in self.configs:
            config._attn_implementation_internal = FAST_ATTENTION
        return self

    def __exit__(self, *exc):
        for config in self.configs:
            config._attn_implementation_internal = "sdpa"
        return False
