"""The decoder's KV cache, and the state of a row kept from one turn to the next.

* :func:`make_cache`: a DynamicCache whose plain attention layers are preallocated (no ``torch.cat`` of the whole
  cache each step); their ``keys``/``values`` are views of the filled part, so masks and attention see exactly what a
  DynamicLayer would give them.
* :class:`RowState`, :func:`snapshot_rows`, :func:`restore_rows`: one row's state (keys and values of an attention
  layer, conv and recurrent state of a linear-attention layer such as Gated DeltaNet) copied out of a cache, and
  rows put back into a new one, left padded.
* :class:`PrefixStore`: row states at the end of conversations, least recently used dropped beyond a byte budget
  (``model.prefix_cache_mb``), so that the next turn of a game, or a fork of it, prefills only its new tokens.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch


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


def prefix_shareable(cache) -> bool:
    """Only caches made of plain (preallocated) attention layers: recurrent layers would see the padding."""
    return _PREALLOCATED_LAYER is not None and bool(cache.layers) and \
        all(type(layer) is _PREALLOCATED_LAYER for layer in cache.layers)


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
