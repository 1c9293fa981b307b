"""Fast batched text generation for the policy: :class:`PolicyModel` (a clemcore model) and its decode loop.

What is sampled is what HF ``model.generate`` samples: the model's ``generation_config.sequence_bias``
(single-token entries), then temperature, top-k (HF's default: the generation config's ``top_k``, else 50;
0 turns it off) and top-p with HF's semantics (drop the tokens whose ascending cumulative probability is
<= 1 - top_p, always keep the best). Greedy (temperature 0) picks the same tokens as HF greedy ``generate``.
It is faster because it does less around the same forward passes:

* a KV cache whose attention layers are preallocated (no ``torch.cat`` of the whole cache each step),
* prefill once per micro-batch, logits of the last position only, identical prompts prefilled once, and
  for plain-attention models (SmolLM2, Llama, Qwen3) a prefix common to the micro-batch prefilled once,
* the state after each conversation (a prompt without its generation prompt) kept in a :class:`PrefixStore`,
  so that the next turn of a game, or a fork of it, prefills only its new tokens (``model.prefix_cache_mb``),
* one-token decode attention on CPU as two small matmuls (the SDPA kernel's overhead dominates there),
* sampling on the top-k candidates only (no full-vocabulary sort or multinomial per step),
* finished rows dropped from the batch (when enough of them are done to pay for compacting the cache),
* micro-batches sorted by prompt length under a token budget, left padding with an attention mask.
Greedy answers equal HF's token for token in the tests and the benchmark; in principle a different summation
order (batch shapes, shared prefixes, the decode attention) can flip a near-tie, as HF's own batching can.

Each row has its own random stream: uniforms drawn from ``torch.Generator().manual_seed(seed)`` turn into
tokens by inverse-CDF sampling, so a row's answer depends only on its prompt, its seed and the sampling
settings, not on the other rows of the batch nor their order (up to float rounding of batched matmuls).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from clemprm.models import gated_delta
from clemprm.models.loader import (AUTO_CONTEXT, ModelConfig, load_tokenizer_and_generation_config,
                                   load_tokenizer_and_model, with_context_length)
from clemprm.models.scoring import Counters, common_prefix_length
from clemprm.play.chat import end_token_ids, render_prompt
from clemprm.play.clemcore_setup import import_clemcore_backends
from clemprm.play.engine import Generation

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 50          # HF generate's default when the generation config sets none
NUCLEUS_CANDIDATES = 1024   # top-p without top-k: candidates looked at before a full sort is needed
MIN_SHARED_PREFIX = 8       # prompts of a micro-batch sharing this many first tokens prefill them once
FAST_DECODE_ATTENTION = True  # one-token attention steps on CPU without the SDPA kernel (see _decode_attention)


# ------------------------------------------------------------------------------------------ results


@dataclass
class GenerationStats(Counters):
    """Running counters of a :class:`PolicyModel`."""

    calls: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    errors: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_thinking(text: str, *, inside_think: bool = False) -> str:
    """Drop ``<think>...</think>`` blocks and a dangling unclosed ``<think>...``, then ``.strip()``.

    ``inside_think``: the prompt ended inside an open ``<think>`` (Qwen3.5 with thinking on), so the answer
    starts with reasoning: everything up to the first ``</think>`` goes too (all of it if none comes)."""
    if inside_think:
        text = "<think>" + text
    text = _THINK_BLOCK.sub("", text)
    start = text.find("<think>")
    if start >= 0:
        text = text[:start]
    return text.replace("</think>", "").strip()


def prompt_opens_think(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


# ---------------------------------------------------------------------------------- the KV cache


def _cache_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A DynamicLayer that writes into a preallocated buffer instead of concatenating the whole cache
        every step; ``keys``/``values`` are views of the filled part, so masks and attention see exactly
        what a DynamicLayer would give them."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = max(1, capacity)
            self.length = 0
            self._k = self._v = None

        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            batch, heads, _, k_dim = key_states.shape
            self._k = key_states.new_zeros((batch, heads, self.capacity, k_dim))
            self._v = value_states.new_zeros((batch, value_states.shape[1], self.capacity, value_states.shape[-1]))
            self.is_initialized = True

        def _grow(self, needed: int):
            new_capacity = max(needed, 2 * self.capacity)
            k = self._k.new_zeros((*self._k.shape[:2], new_capacity, self._k.shape[-1]))
            v = self._v.new_zeros((*self._v.shape[:2], new_capacity, self._v.shape[-1]))
            k[:, :, :self.length] = self._k[:, :, :self.length]
            v[:, :, :self.length] = self._v[:, :, :self.length]
            self._k, self._v, self.capacity = k, v, new_capacity

        def _refresh(self):
            self.keys = self._k[:, :, :self.length]
            self.values = self._v[:, :, :self.length]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if self.length + n > self.capacity:
                self._grow(self.length + n)
            self._k[:, :, self.length:self.length + n] = key_states
            self._v[:, :, self.length:self.length + n] = value_states
            self.length += n
            self._refresh()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_select_indices(self, indices):
            if self.is_initialized:
                self._k = self._k.index_select(0, indices.to(self._k.device))
                self._v = self._v.index_select(0, indices.to(self._v.device))
                self._refresh()

        def reorder_cache(self, beam_idx):
            self.batch_select_indices(beam_idx)

        def batch_repeat_interleave(self, repeats: int):
            if self.is_initialized:
                self._k = self._k.repeat_interleave(repeats, dim=0)
                self._v = self._v.repeat_interleave(repeats, dim=0)
                self._refresh()

        def crop(self, tokens_to_remove: int):
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative number of tokens to remove")
            self.length = max(0, self.length + tokens_to_remove)
            if self.is_initialized:
                self._refresh()

        def reset(self):
            self.length = 0
            self._k = self._v = self.keys = self.values = None
            self.is_initialized = False

    return PreallocatedLayer


_PREALLOCATED_LAYER = None


def make_cache(model, capacity: int):
    """A DynamicCache for ``model`` whose plain attention layers are preallocated for ``capacity`` tokens."""
    global _PREALLOCATED_LAYER
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if _PREALLOCATED_LAYER is None:
        _PREALLOCATED_LAYER = _cache_layer_class()
    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # a config the layer-type dispatch does not know: a plain cache still works
        return DynamicCache()
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = _PREALLOCATED_LAYER(capacity)
    return cache


# ---------------------------------------------------------------------- row states across turns


def _linear_attention_layer_class():
    try:
        from transformers.cache_utils import LinearAttentionLayer
    except ImportError:  # a transformers without recurrent-layer caches
        return None
    return LinearAttentionLayer


def snapshottable(cache) -> bool:
    """Whether the rows of ``cache`` can be saved and restored: plain (preallocated) attention layers and
    linear-attention (e.g. Gated-DeltaNet) layers only."""
    linear = _linear_attention_layer_class()
    return bool(cache.layers) and all(type(layer) in (_PREALLOCATED_LAYER, linear) for layer in cache.layers)


@dataclass
class RowState:
    """One row's model state after ``length`` tokens: per layer, (keys, values) of its real positions for an
    attention layer, (conv state, recurrent state) for a linear-attention layer."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)


def snapshot_rows(cache, attention: torch.Tensor, captured=None) -> list[RowState]:
    """Copies of every row's state (``attention``: the 2D mask over the cache, 1 at a row's real positions). With
    ``captured`` (:class:`clemprm.models.gated_delta.CapturedStates` of the pass that filled the cache), the state
    before the pass's last ``captured.last`` tokens."""
    linear = _linear_attention_layer_class()
    if captured is not None:
        attention = attention[:, :-captured.last]
        linear_states = list(zip(captured.conv, captured.recurrent))
    else:
        linear_states = [(layer.conv_states[0], layer.recurrent_states[0])
                         for layer in cache.layers if type(layer) is linear]
    width = attention.shape[1]
    rows = []
    for b in range(attention.shape[0]):
        real = attention[b].bool()
        layers, linear_layers = [], iter(linear_states)
        for layer in cache.layers:
            if type(layer) is linear:
                conv, recurrent = next(linear_layers)
                layers.append((conv[b].clone(), recurrent[b].clone()))
            else:
                layers.append((layer.keys[b][:, :width][:, real].clone(), layer.values[b][:, :width][:, real].clone()))
        rows.append(RowState(int(real.sum()), layers))
    return rows


def restore_rows(model, rows: list[RowState], capacity: int):
    """A cache holding ``rows`` (attention keys left padded to the longest); returns (cache, attention mask,
    lengths)."""
    cache = make_cache(model, capacity)
    linear = _linear_attention_layer_class()
    width = max(row.length for row in rows)
    device = rows[0].layers[0][0].device
    attention = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        attention[b, width - row.length:] = 1
    for i, layer in enumerate(cache.layers):
        first, second = (torch.stack([row.layers[i][j] for row in rows]) if type(layer) is linear else None
                         for j in (0, 1))
        if type(layer) is linear:
            layer.lazy_initialization(conv_states=first, recurrent_states=second, conv_kernel_size=first.shape[-1])
            layer.conv_states[0].copy_(first)
            layer.recurrent_states[0].copy_(second)
            layer.has_previous_state[0] = True
            continue
        keys, values = rows[0].layers[i]
        padded_keys = keys.new_zeros((len(rows), keys.shape[0], width, keys.shape[-1]))
        padded_values = values.new_zeros((len(rows), values.shape[0], width, values.shape[-1]))
        for b, row in enumerate(rows):
            padded_keys[b, :, width - row.length:] = row.layers[i][0]
            padded_values[b, :, width - row.length:] = row.layers[i][1]
        layer.update(padded_keys, padded_values)
    return cache, attention, torch.tensor([row.length for row in rows], device=device)


class PrefixStore:
    """Row states at the end of prompt prefixes, least recently used dropped beyond ``max_bytes``.

    What it is for: a game's next turn, and every fork of a game state, starts with the conversation so far, so
    the prompt's prefix up to the generation prompt was already prefilled for an earlier turn (or a sibling)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._states: OrderedDict[tuple, RowState] = OrderedDict()
        self._lengths: Counter = Counter()
        self.hits = self.misses = 0

    def longest(self, tokens: list[int], limit: int) -> RowState | None:
        """The state of the longest stored prefix of ``tokens`` of at most ``limit`` tokens."""
        for length in sorted((n for n in self._lengths if n <= limit), reverse=True):
            key = tuple(tokens[:length])
            if key in self._states:
                self._states.move_to_end(key)
                self.hits += 1
                return self._states[key]
        self.misses += 1
        return None

    def clear(self) -> None:
        self._states.clear()
        self._lengths.clear()
        self.nbytes = 0

    def put(self, tokens: list[int], state: RowState) -> None:
        key = tuple(tokens)
        if key in self._states or state.nbytes > self.max_bytes:
            return
        self._states[key] = state
        self._lengths[len(key)] += 1
        self.nbytes += state.nbytes
        while self.nbytes > self.max_bytes:
            old_key, old = self._states.popitem(last=False)
            self.nbytes -= old.nbytes
            self._lengths[len(old_key)] -= 1
            if not self._lengths[len(old_key)]:
                del self._lengths[len(old_key)]


# ------------------------------------------------------------------------------- decode attention

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


class _fast_decode_attention:
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


def _prefix_shareable(cache) -> bool:
    """Only caches made of plain (preallocated) attention layers: recurrent layers would see the padding."""
    return _PREALLOCATED_LAYER is not None and bool(cache.layers) and \
        all(type(layer) is _PREALLOCATED_LAYER for layer in cache.layers)


# -------------------------------------------------------------------------------------- sampling


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


# ----------------------------------------------------------------------------------- decode loop


class Decoder:
    """Batched decoding of token-id prompts with one causal LM (no tokenizer, no chat template)."""

    def __init__(self, model, *, eos_token_ids, pad_token_id: int, sequence_bias: dict[int, float] | None = None,
                 generation_prompt: list[int] | None = None, prefix_store_bytes: int = 0):
        """``generation_prompt``: the tokens a chat template appends to open the model's turn. For prompts that end
        with them, the state after the conversation (the prompt without them) is kept in a :class:`PrefixStore` of
        ``prefix_store_bytes`` (0: off): the next turn of that conversation (which starts with it) or a fork of it
        prefills only its new tokens (see :meth:`_prefill`)."""
        self.model = model
        self.eos = sorted(set(int(i) for i in eos_token_ids))
        if not self.eos:
            raise ValueError("the model has no end-of-turn token (generation_config.eos_token_id)")
        self.pad = int(pad_token_id)
        self.sequence_bias = dict(sequence_bias or {})
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(type(base).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._bias = None
        self.generation_prompt = list(generation_prompt or [])
        text_config = getattr(model.config, "text_config", model.config)
        recurrent = "linear_attention" in (getattr(text_config, "layer_types", None) or [])
        # continuing rows are padded in the middle and conversation states are taken inside a pass: plain for
        # attention layers, done by clemprm.models.gated_delta (CPU only) for Gated-DeltaNet layers
        reusable = (bool(prefix_store_bytes and self.generation_prompt) and snapshottable(make_cache(model, 1))
                    and (not recurrent or self.device.type == "cpu"))
        self.prefix_store = PrefixStore(prefix_store_bytes) if reusable else None
        # a padded continuation needs this many new tokens per row (see gated_delta.continuing_with_leading_pads)
        self._min_continuation = max(1, int(getattr(text_config, "linear_conv_kernel_dim", 1) or 1) - 1)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def forget_conversations(self) -> None:
        """Empty the prefix store (benchmarks start each timed run cold, as a pipeline stage does)."""
        if self.prefix_store is not None:
            self.prefix_store.clear()

    def _forward(self, input_ids, attention_mask, position_ids, cache, last_only: bool):
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if last_only and self._keep_kw:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return out.logits[:, -1, :].float()

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        if self.sequence_bias:
            if self._bias is None or self._bias.shape[-1] != logits.shape[-1]:
                self._bias = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
                for token, value in self.sequence_bias.items():
                    if 0 <= token < logits.shape[-1]:
                        self._bias[token] += value
            logits = logits + self._bias
        return logits

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], *,
                 token_budget: int = 16384) -> list[tuple[list[int], str]]:
        """``(new token ids incl. a final end token, "stop"|"length")`` per prompt, in input order."""
        results: list[Any] = [None] * len(prompts)
        if params.max_new_tokens <= 0:
            return [([], "length") for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        batch: list[int] = []
        for i in order:  # ascending length: a batch's padded length is its last (longest) prompt
            if batch and (len(batch) + 1) * len(prompts[i]) > token_budget:
                self._run(prompts, batch, params, seeds, results)
                batch = []
            batch.append(i)
        if batch:
            self._run(prompts, batch, params, seeds, results)
        return results

    @torch.inference_mode()
    def _run(self, prompts, rows: list[int], params: SamplingParams, seeds, results) -> None:
        device = self.device
        n_new = params.max_new_tokens
        uniforms = None
        if not params.greedy:  # one private stream per row: U[0,1) per step
            uniforms = torch.stack([
                torch.rand(n_new, generator=torch.Generator().manual_seed(int(seeds[i]) & 0xFFFF_FFFF_FFFF_FFFF),
                           dtype=torch.float64) for i in rows]).to(device)
        with _fast_decode_attention(self.model):
            self._decode(prompts, rows, params, uniforms, results)

    def _prefill(self, unique_prompts: list[tuple], n_new: int):
        """Prefill ``unique_prompts``; returns (cache, last logits, attention mask, next positions).

        With a prefix store, for prompts that end with the generation prompt: a prompt whose conversation (the
        prompt without it) is stored prefills the generation prompt only; one whose earlier part is stored (the
        last turn) prefills the rest; others are prefilled in full. Each group is one forward pass that also takes
        the state at the end of its conversations for the store. Groups are joined into one cache to decode."""
        generation_prompt = self.generation_prompt
        tail = len(generation_prompt)
        if self.prefix_store is None or not all(len(p) > tail and list(p[-tail:]) == generation_prompt
                                                for p in unique_prompts):
            return self._prefill_fresh(unique_prompts, n_new)
        capacity = max(len(p) for p in unique_prompts) + n_new
        conversations = [list(p[:-tail]) for p in unique_prompts]
        stored = [self.prefix_store.longest(c, len(c)) for c in conversations]
        known = [i for i, (c, state) in enumerate(zip(conversations, stored)) if state and state.length == len(c)]
        continuing = [i for i, (c, state) in enumerate(zip(conversations, stored))
                      if state and self._min_continuation <= len(c) - state.length]
        fresh = [i for i in range(len(unique_prompts)) if i not in known and i not in continuing]
        groups = []  # (rows, cache, logits, attention, next positions)
        if fresh:
            with gated_delta.capturing_states_before_last(tail) as captured:
                cache, logits, attention, next_pos = self._prefill_fresh([unique_prompts[i] for i in fresh], n_new)
            self._keep(fresh, conversations, snapshot_rows(cache, attention, captured))
            groups.append((fresh, cache, logits, attention, next_pos))
        if continuing:
            cache, attention, lengths = restore_rows(self.model, [stored[i] for i in continuing], capacity)
            with gated_delta.capturing_states_before_last(tail) as captured:
                logits, attention, next_pos = self._continue(
                    cache, attention, lengths, [list(unique_prompts[i][stored[i].length:]) for i in continuing])
            self._keep(continuing, conversations, snapshot_rows(cache, attention, captured))
            groups.append((continuing, cache, logits, attention, next_pos))
        if known:
            cache, attention, lengths = restore_rows(self.model, [stored[i] for i in known], capacity)
            logits, attention, next_pos = self._continue(cache, attention, lengths, [generation_prompt] * len(known))
            groups.append((known, cache, logits, attention, next_pos))
        return self._join(groups, capacity)

    def _keep(self, rows: list[int], conversations: list[list[int]], states: list[RowState]) -> None:
        for i, state in zip(rows, states):
            self.prefix_store.put(conversations[i], state)

    def _join(self, groups: list[tuple], capacity: int):
        """One (cache, logits, attention mask, next positions) for the groups' rows, in row order."""
        if len(groups) == 1:
            return groups[0][1:]
        rows = [i for group in groups for i in group[0]]
        order = sorted(range(len(rows)), key=rows.__getitem__)
        states = [state for _, cache, _, attention, _ in groups for state in snapshot_rows(cache, attention)]
        cache, attention, next_pos = restore_rows(self.model, [states[j] for j in order], capacity)
        logits = torch.cat([group[2] for group in groups])[torch.tensor(order, device=self.device)]
        return cache, logits, attention, next_pos

    def _continue(self, cache, attention, lengths, new_tokens: list[list[int]]):
        """Prefill each row's ``new_tokens`` after its cached state (left padded: padding in the middle of a row is
        masked for attention and made a no-op for Gated-DeltaNet layers); returns (last logits, attention mask,
        next positions)."""
        device = self.device
        width = max(len(t) for t in new_tokens)
        input_ids = torch.full((len(new_tokens), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(new_tokens), width), dtype=torch.long)
        for r, tokens in enumerate(new_tokens):
            input_ids[r, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[r, width - len(tokens):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = lengths.unsqueeze(1) + (mask.cumsum(-1) - 1).clamp_min(0)
        attention = torch.cat([attention, mask], dim=-1)
        pads = width - mask.sum(-1)
        padded = gated_delta.continuing_with_leading_pads(pads, width) if bool(pads.any()) else contextlib.nullcontext()
        with padded:
            logits = self._forward(input_ids, attention, positions, cache, last_only=True)
        return logits, attention, positions[:, -1] + 1

    def _prefill_fresh(self, unique_prompts: list, n_new: int):
        """Prefill ``unique_prompts`` (left padded); returns (cache, last logits, attention mask, next positions).

        Plain-attention models prefill a prefix common to all prompts once (batch 1) and only the rest per
        row, the suffixes left padded after the shared prefix: the padding mask keeps attention exact.
        Models with recurrent layers (e.g. Qwen3.5's Gated DeltaNet) prefill every row in full."""
        device = self.device
        count = len(unique_prompts)
        shared = common_prefix_length(unique_prompts) if count > 1 else 0
        suffixes = [p[shared:] for p in unique_prompts]
        width = max(len(p) for p in suffixes)
        cache = make_cache(self.model, shared + width + n_new)
        if shared < MIN_SHARED_PREFIX or not _prefix_shareable(cache):
            shared, suffixes, width = 0, list(unique_prompts), max(len(p) for p in unique_prompts)
        input_ids = torch.full((count, width), self.pad, dtype=torch.long)
        suffix_mask = torch.zeros((count, width), dtype=torch.long)
        for r, p in enumerate(suffixes):
            input_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            suffix_mask[r, width - len(p):] = 1
        positions = (suffix_mask.cumsum(-1) - 1).clamp_min(0) + shared
        attention = torch.cat([torch.ones((count, shared), dtype=torch.long), suffix_mask], dim=-1)
        input_ids, attention, positions = input_ids.to(device), attention.to(device), positions.to(device)
        if shared:
            prefix = torch.tensor([unique_prompts[0][:shared]], dtype=torch.long, device=device)
            self._forward(prefix, torch.ones_like(prefix), torch.arange(shared, device=device).unsqueeze(0),
                          cache, last_only=True)
            cache.batch_repeat_interleave(count)
        logits = self._forward(input_ids, attention, positions, cache, last_only=True)
        return cache, logits, attention, positions[:, -1] + 1

    def _decode(self, prompts, rows: list[int], params: SamplingParams, uniforms, results) -> None:
        device = self.device
        n_new = params.max_new_tokens
        # identical prompts are prefilled once; greedy answers depend on the prompt only, so they are also decoded
        # once, while sampled rows (each with its own draws) get a copy of their prompt's cache row
        unique: dict[tuple, int] = {}
        inverse = [unique.setdefault(tuple(prompts[i]), len(unique)) for i in rows]
        cache, logits, attention, next_pos = self._prefill(list(unique), n_new)
        sequence_of = inverse if params.greedy else list(range(len(rows)))  # row -> decoded sequence
        if not params.greedy and len(unique) < len(rows):
            expand = torch.tensor(inverse, dtype=torch.long, device=device)
            cache.reorder_cache(expand)
            logits, attention, next_pos = logits[expand], attention[expand], next_pos[expand]
        n_sequences = logits.shape[0]

        eos = torch.tensor(self.eos, dtype=torch.long, device=device)
        active = torch.arange(n_sequences, device=device)     # batch slot -> decoded sequence
        alive = torch.ones(n_sequences, dtype=torch.bool, device=device)  # per slot
        generated = torch.full((n_sequences, n_new), -1, dtype=torch.long)
        lengths = [0] * n_sequences
        finish = ["length"] * n_sequences
        for step in range(n_new):
            step_uniforms = uniforms[active, step] if uniforms is not None else None
            logits = self._biased(logits)
            if step < params.min_new_tokens:
                logits[:, eos] = float("-inf")
            tokens = sample_tokens(logits, params, step_uniforms)
            tokens_cpu = tokens.cpu()
            active_cpu = active.cpu().tolist()
            alive_cpu = alive.cpu().tolist()
            for slot, sequence in enumerate(active_cpu):
                if alive_cpu[slot]:
                    generated[sequence, step] = tokens_cpu[slot]
                    lengths[sequence] = step + 1
            ended = torch.isin(tokens, eos) & alive
            for slot in ended.nonzero().squeeze(-1).tolist():
                finish[active_cpu[slot]] = "stop"
            alive = alive & ~ended
            n_alive = int(alive.sum())
            if n_alive == 0 or step == n_new - 1:
                break
            if (len(active_cpu) - n_alive) * 4 >= len(active_cpu):  # compact: drop finished rows
                keep = alive.nonzero().squeeze(-1)
                cache.reorder_cache(keep)
                active, tokens, attention, next_pos = active[keep], tokens[keep], attention[keep], next_pos[keep]
                alive = alive[keep]
            else:  # finished rows keep running until the next compaction; feed them a harmless token
                tokens = torch.where(alive, tokens, eos[0])
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            logits = self._forward(tokens.unsqueeze(-1), attention, next_pos.unsqueeze(-1), cache, last_only=False)
            next_pos = next_pos + 1
        for i, sequence in zip(rows, sequence_of):
            results[i] = (generated[sequence, :lengths[sequence]].tolist(), finish[sequence])


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


# ------------------------------------------------------------------------------------ the clemcore model


import_clemcore_backends()
import clemcore.backends as _backends  # noqa: E402
from clemcore.backends.model_registry import ModelSpec  # noqa: E402
from clemcore.backends.utils import augment_response_object  # noqa: E402


class PolicyModel(_backends.BatchGenerativeModel):
    """The policy LM as a clemcore model: batched, seeded generation with per-item errors.

    ``name`` (clemcore groups batches by it) defaults to the spec's short name plus the adapter folder name,
    e.g. ``smollm2-135m-instruct`` or ``smollm2-135m-instruct+sft``: give two adapters of one base two names.
    ``top_k`` None means what HF generate does: the model's ``generation_config.top_k``, else 50; 0 = off.
    """

    def __init__(self, cfg: ModelConfig, *, name: str | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, top_k: int | None = None, tokenizer=None, model=None):
        super().__init__(ModelSpec(model_name=name or cfg.short_name, model_id=cfg.spec, backend="clemprm",
                                   adapter=cfg.adapter))
        if cfg.backend == "vllm" and tokenizer is None:   # the server holds the weights: the tokenizer alone here
            tokenizer, generation_config = load_tokenizer_and_generation_config(cfg)
        else:
            if model is None or tokenizer is None:
                tokenizer, model = load_tokenizer_and_model(cfg, for_training=False, task="causal-lm")
            generation_config = getattr(model, "generation_config", None)
        self.tokenizer, self.model = tokenizer, model
        self.context_is_auto = cfg.max_context_tokens == AUTO_CONTEXT
        self.cfg = with_context_length(cfg, tokenizer)   # model.max_context_tokens a number
        self.temperature_default = float(temperature)
        self.top_p_default = float(top_p)
        self.max_new_tokens_default = int(max_new_tokens)
        self.top_k_default = int(top_k if top_k is not None else
                                 (getattr(generation_config, "top_k", None) or DEFAULT_TOP_K))
        self.set_gen_args(temperature=self.temperature_default, max_tokens=self.max_new_tokens_default,
                          top_p=self.top_p_default, top_k=self.top_k_default)
        ignored = unsupported_generation_settings(generation_config) if generation_config is not None else {}
        if ignored:
            log.warning("%s: generation config settings not applied by clemprm's decoder: %s", self.name, ignored)
        eos_ids = end_token_ids(tokenizer, generation_config)
        if cfg.backend == "vllm":
            from clemprm.models.vllm_backend import vllm_decoder

            self.decoder = vllm_decoder(self.cfg, eos_ids, sequence_bias=sequence_bias_of(generation_config),
                                        tokenizer=tokenizer)
        else:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
            self.decoder = Decoder(model, eos_token_ids=eos_ids, pad_token_id=pad,
                                   sequence_bias=sequence_bias_of(generation_config),
                                   generation_prompt=self._generation_prompt_ids(),
                                   prefix_store_bytes=cfg.prefix_cache_mb << 20)
        self.stats = GenerationStats()

    # clemcore's Model reads these through gen_args
    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def reset(self):
        pass

    def _generation_prompt_ids(self) -> list[int]:
        """The tokens the chat template appends to open the assistant's turn ([] when the template does not
        simply append them, e.g. it rewrites earlier turns)."""
        probe = [{"role": "user", "content": "Hello."}]
        try:
            opened = self.render(probe)
            conversation = self.tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False,
                                                              **self.cfg.chat_template_kwargs)
        except Exception:  # a template that cannot render the probe: no reuse
            return []
        if not opened.startswith(conversation) or opened == conversation:
            return []
        opened_ids, conversation_ids = self.tokenizer([opened, conversation], add_special_tokens=False)["input_ids"]
        if opened_ids[:len(conversation_ids)] != conversation_ids:
            return []
        return opened_ids[len(conversation_ids):]

    def render(self, messages: list[dict]) -> str:
        """The prompt text (:func:`clemprm.play.chat.render_prompt`)."""
        return render_prompt(self.tokenizer, messages, self.cfg.chat_template_kwargs)

    def generate(self, perspectives: list[list[dict]], *, seeds: list[int] | None = None,
                 temperature: float | None = None, top_p: float | None = None, max_new_tokens: int | None = None,
                 top_k: int | None = None) -> list[Generation]:
        """One :class:`Generation` per message list, in order. ``seeds[i]`` fixes row i's sample (default: i)."""
        return self._generate(perspectives, seeds=seeds, temperature=temperature, top_p=top_p,
                              max_new_tokens=max_new_tokens, top_k=top_k)[0]

    def _generate(self, perspectives, *, seeds=None, temperature=None, top_p=None, max_new_tokens=None,
                  top_k=None) -> tuple[list[Generation], dict[int, str]]:
        start = time.perf_counter()
        n = len(perspectives)
        if seeds is None:
            seeds = list(range(n))
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} prompts")
        params = SamplingParams(
            temperature=float(self.temperature_default if temperature is None else temperature),
            top_p=float(self.top_p_default if top_p is None else top_p),
            top_k=int(self.top_k_default if top_k is None else top_k),
            max_new_tokens=int(self.max_new_tokens_default if max_new_tokens is None else max_new_tokens))
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")

        out: list[Generation | None] = [None] * n
        prompts, texts, todo = {}, {}, []
        encoded = self._encode(perspectives)
        for i, text_ids in enumerate(encoded):
            if isinstance(text_ids, Exception):  # e.g. a template that rejects the messages
                out[i] = Generation("", "", 0, 0, error=f"{type(text_ids).__name__}: {text_ids}", finish_reason="error")
                continue
            text, ids = text_ids
            if len(ids) > self.cfg.max_context_tokens:
                out[i] = Generation("", "", len(ids), 0, finish_reason="error",
                                    error=context_too_long(len(ids), self.cfg.max_context_tokens, self.context_is_auto))
            elif not ids:
                out[i] = Generation("", "", 0, 0, error="empty prompt", finish_reason="error")
            else:
                prompts[i], texts[i] = ids, text
                todo.append(i)

        if todo:
            decoded = self.decoder.generate([prompts[i] for i in todo], params, [seeds[i] for i in todo],
                                            token_budget=self.cfg.token_budget)
            # (new ids, finish reason), and with the vllm backend the sampled tokens' log-probs
            for i, (new_ids, reason, *logprobs) in zip(todo, decoded):
                if new_ids is None:   # a request the vLLM server refused: ``reason`` says why
                    out[i] = Generation("", "", len(prompts[i]), 0, error=reason, finish_reason="error")
                    continue
                raw = self.tokenizer.decode(new_ids, skip_special_tokens=True)
                out[i] = Generation(text=strip_thinking(raw, inside_think=prompt_opens_think(texts[i])),
                                    raw_text=raw, prompt_tokens=len(prompts[i]), new_tokens=len(new_ids),
                                    finish_reason=reason, prompt_ids=prompts[i], token_ids=new_ids,
                                    logprobs=logprobs[0] if logprobs else None)
        self.stats.calls += 1
        self.stats.prompts += n
        self.stats.prompt_tokens += sum(len(p) for p in prompts.values())
        self.stats.new_tokens += sum(g.new_tokens for g in out)
        self.stats.errors += sum(g.error is not None for g in out)
        self.stats.seconds += time.perf_counter() - start
        return out, texts

    def _encode(self, perspectives: list[list[dict]]) -> list:
        """``(prompt text, token ids)`` per message list, or the exception its rendering raised. Identical message
        lists (N candidates of one turn, K forks of one state) are rendered once; all are tokenised in one call."""
        keys = [tuple((m["role"], m["content"]) for m in messages) for messages in perspectives]
        rendered: dict[tuple, object] = {}
        for key, messages in zip(keys, perspectives):
            if key not in rendered:
                try:
                    rendered[key] = self.render(messages)
                except Exception as error:
                    rendered[key] = error
        texts = [(key, text) for key, text in rendered.items() if isinstance(text, str)]
        ids = self._tokenize([text for _, text in texts]) if texts else []
        by_key = {key: (text, row_ids) for (key, text), row_ids in zip(texts, ids)}
        return [by_key.get(key, rendered[key]) for key in keys]

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` (no special tokens added): a fast tokenizer's Rust ``encode_batch_fast`` (ids
        only, no offsets: ~30% faster than the tokenizer's ``__call__``, the same ids), else ``__call__``. The
        backend keeps the padding and truncation of the last ``__call__`` that asked for them (e.g. a user's
        ``tokenizer(texts, padding=True)``); then ``__call__`` is used, which resets them."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if (hasattr(backend, "encode_batch_fast") and getattr(backend, "padding", None) is None
                and getattr(backend, "truncation", None) is None):
            return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    @augment_response_object
    def generate_batch_response(self, batch_messages: list[list[dict]]) -> list[tuple[Any, Any, str]]:
        """clemcore's batch interface: ``(prompt object, response object, text)`` per item; an item error raises."""
        generations, texts = self._generate(batch_messages)
        results = []
        for i, generation in enumerate(generations):
            if generation.error:
                raise RuntimeError(f"{self.name}: {generation.error}")
            prompt = {"inputs": texts[i], "max_new_tokens": self.max_new_tokens_default,
                      "temperature": self.temperature_default, "top_p": self.top_p_default}
            response = {"response": generation.raw_text, "prompt_tokens": generation.prompt_tokens,
                        "new_tokens": generation.new_tokens, "finish_reason": generation.finish_reason}
            results.append((prompt, response, generation.text))
        return results

    def generate_response(self, messages: list[dict]) -> tuple[Any, Any, str]:
        return self.generate_batch_response([messages])[0]




def context_too_long(prompt_tokens: int, limit: int, auto: bool) -> str:
    """The error of a prompt over ``model.max_context_tokens``: the key that set the limit, and what it can be."""
    own = "auto: the model's own context length"
    return (f"context too long: {prompt_tokens} > {limit} tokens (model.max_context_tokens; "
            f"{own if auto else 'raise it, or set it to ' + own})")


def load_policy(model_settings: dict, cache_dir: str | None = None) -> PolicyModel:
    """The policy of a config's ``model`` section as a clemcore model, through the one model loader."""
    return PolicyModel(ModelConfig.from_dict({**model_settings, "cache_dir": cache_dir}))
