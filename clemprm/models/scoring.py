"""Scoring many sequences with one model: padding, micro-batches under a token budget, and the one shared-prefix
forward.

The searches and the evaluation score N candidates of one prompt (siblings share their prefix). Pairs with the same
key (e.g. the same prefix messages) form a :class:`PrefixGroup` when their token sequences share at least
:data:`MIN_SHARED_TOKENS` first tokens (the longest common token prefix: robust to template and tokenizer boundaries;
a left-truncated sequence starts elsewhere and then shares little or nothing). :func:`forward_on_shared_prefixes`
runs the prefixes once, left padded, into a cache, copies each cache row to its group's pairs and runs only their
suffixes, padded on the right, attending to prefix + suffix. Left padding is exact for plain attention (masked)
and for Qwen3.5's Gated DeltaNet layers (padded positions are zeroed before they reach the conv and recurrent
states, which therefore stay zero until the first real token). :func:`prefix_sharing_problem` says when a model's
cache holds anything else; such a model scores every pair in full. The PRM (:mod:`clemprm.models.prm`) and the
policy's log-probability scorer (:mod:`clemprm.models.logprob`) both score through here, and the PRM's training
forward (:func:`logits_sharing_prefixes`: a state's siblings compute their perspective once).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

MIN_SHARED_TOKENS = 16  # a shorter common prefix is not worth a forward pass of its own


def _pad(sequences: list[list[int]], pad_id: int, left: bool):
    import torch

    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        columns = slice(width - len(ids), width) if left else slice(0, len(ids))
        input_ids[row, columns] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, columns] = 1
    return input_ids, attention_mask


def pad_right(sequences: list[list[int]], pad_id: int):
    """``(input_ids, attention_mask)`` tensors, padded on the right."""
    return _pad(sequences, pad_id, left=False)


def pad_left(sequences: list[list[int]], pad_id: int):
    """``(input_ids, attention_mask)`` tensors, padded on the left: shared prefixes of different lengths all end in
    the last column, which their pairs' suffixes continue."""
    return _pad(sequences, pad_id, left=True)


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices grouped longest first into batches of at most ``token_budget`` padded tokens (a longer row alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


@dataclass
class PrefixGroup:
    """Pairs (``rows``) whose sequences share their first ``shared`` tokens; ``longest``: their longest sequence."""

    shared: int
    rows: list[int]
    longest: int


def common_prefix_length(sequences: list[list[int]]) -> int:
    """How many first tokens all ``sequences`` share, at most the shortest length minus one: every pair keeps a
    token of its own, at which its score is pooled."""
    limit = min(len(ids) for ids in sequences) - 1
    first = sequences[0]
    n = 0
    while n < limit and all(ids[n] == first[n] for ids in sequences[1:]):
        n += 1
    return n


def shared_prefix_groups(sequences: list[list[int]], keys: list | None) -> tuple[list[PrefixGroup], list[int]]:
    """``(groups, alone)``: the pairs of one key (e.g. the same prefix messages) that share at least
    :data:`MIN_SHARED_TOKENS` first tokens form a group; every other pair (no keys, its key's only pair, a group
    whose left truncation shifted a start) is scored alone."""
    if keys is None:
        return [], list(range(len(sequences)))
    by_key = collections.defaultdict(list)
    for i, key in enumerate(keys):
        by_key[key].append(i)
    groups, alone = [], []
    for rows in by_key.values():
        shared = common_prefix_length([sequences[i] for i in rows]) if len(rows) > 1 else 0
        if shared >= MIN_SHARED_TOKENS:
            groups.append(PrefixGroup(shared, rows, max(len(sequences[i]) for i in rows)))
        else:
            alone.extend(rows)
    return groups, sorted(alone)


def _padded_tokens(groups: list[PrefixGroup]) -> int:
    """Padded tokens of the larger of a micro-batch's two passes: the prefixes and the suffixes."""
    prefixes = len(groups) * max(group.shared for group in groups)
    suffixes = sum(len(group.rows) for group in groups) * max(group.longest - group.shared for group in groups)
    return max(prefixes, suffixes)


def group_batches(groups: list[PrefixGroup], token_budget: int) -> list[list[PrefixGroup]]:
    """Groups, longest shared prefix first, in micro-batches whose passes stay within ``token_budget`` padded tokens
    (a larger group alone)."""
    batches, current = [], []
    for group in sorted(groups, key=lambda g: -g.shared):
        if current and _padded_tokens(current + [group]) > token_budget:
            batches.append(current)
            current = []
        current.append(group)
    return batches + [current] if current else batches


class SharedForward(NamedTuple):
    """What :func:`forward_on_shared_prefixes` computed: the prefix pass's output (one row per group, left padded:
    each prefix ends in the last column), the suffix pass's (one row per pair, in group order) and the suffix ids."""

    prefix: Any
    suffix: Any
    suffix_ids: Any


def forward_on_shared_prefixes(model, sequences: list[list[int]], groups: list[PrefixGroup], pad_id: int,
                               prefix_kwargs: dict | None = None, suffix_kwargs: dict | None = None) -> SharedForward:
    """The model's output for the groups' rows (in group order) computed on their shared prefixes: the prefixes
    in one left-padded pass that fills a cache, its rows copied to their groups' pairs, then the suffixes (padded
    on the right) on top of it. ``prefix_kwargs`` go to the prefix pass (e.g. ``logits_to_keep=1`` where its logits
    are not used), ``suffix_kwargs`` to the suffix pass (e.g. ``output_hidden_states=True``)."""
    import torch
    from transformers.cache_utils import DynamicCache

    device = next(model.parameters()).device
    prefix_ids, prefix_mask = pad_left([sequences[group.rows[0]][:group.shared] for group in groups], pad_id)
    cache = DynamicCache(config=model.config)
    with_cache = {cache_keyword(model): cache, "use_cache": True}
    prefix = model(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device),
                   position_ids=(prefix_mask.cumsum(-1) - 1).clamp_min(0).to(device), **with_cache,
                   **(prefix_kwargs or {}))
    owner = torch.tensor([k for k, group in enumerate(groups) for _ in group.rows])
    cache.reorder_cache(owner.to(device))
    suffix_ids, suffix_mask = pad_right([sequences[i][group.shared:] for group in groups for i in group.rows], pad_id)
    start = torch.tensor([group.shared for group in groups for _ in group.rows])
    positions = start.unsqueeze(-1) + torch.arange(suffix_ids.shape[1])
    attention_mask = torch.cat([prefix_mask[owner], suffix_mask], dim=-1)
    suffix = model(input_ids=suffix_ids.to(device), attention_mask=attention_mask.to(device),
                   position_ids=positions.to(device), **with_cache, **(suffix_kwargs or {}))
    return SharedForward(prefix, suffix, suffix_ids)


def logits_sharing_prefixes(model, input_ids, attention_mask, keys: list, pad_id: int):
    """The model's ``logits`` for each row of a right-padded batch (in row order), the rows of one key (e.g. a
    state's siblings) computing their common token prefix once (:func:`forward_on_shared_prefixes`); the other rows
    in one padded pass. Differentiable: in training the prefix's gradient gathers the gradients of every row on it.
    Equal to ``model(input_ids, attention_mask).logits`` up to float rounding."""
    import torch

    device = next(model.parameters()).device
    sequences = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    groups, alone = shared_prefix_groups(sequences, keys)
    parts, order = [], []
    if alone:
        ids, mask = pad_right([sequences[i] for i in alone], pad_id)
        parts.append(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits)
        order += alone
    if groups:
        parts.append(forward_on_shared_prefixes(model, sequences, groups, pad_id).suffix.logits)
        order += [i for group in groups for i in group.rows]
    return torch.cat(parts)[torch.argsort(torch.tensor(order, device=device))]


def cache_keyword(model) -> str | None:
    """The name under which the model's forward takes a cache (``cache`` in transformers 5, else
    ``past_key_values``); None if it takes none."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(type(base).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def prefix_sharing_problem(model) -> str | None:
    """Why ``model`` cannot score suffixes on the cache of a left-padded shared prefix; None when it can: its
    cache is made of plain attention layers and linear-attention (conv + recurrent state) layers only. Sliding
    windows, static, quantized or other layers keep full scoring."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

    if cache_keyword(model) is None:
        return "its forward takes no cache"
    try:
        cache = DynamicCache(config=model.config)
    except Exception as error:  # a config the layer-type dispatch does not know
        return f"no cache for its config ({type(error).__name__}: {error})"
    unsupported = sorted({type(layer).__name__ for layer in cache.layers
                          if type(layer) not in (DynamicLayer, LinearAttentionLayer)})
    if not cache.layers or unsupported:
        return f"cache layers {', '.join(unsupported) or 'unknown'}"
    return None


class Counters:
    """Running counters of a model (a dataclass), readable as ``counters["name"]`` and as a dict."""

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ScorerStats(Counters):
    """Running counters of a scorer (the PRM, the policy's log-probabilities)."""

    calls: int = 0
    pairs: int = 0
    tokens: int = 0
    truncated: int = 0
    shared_tokens: int = 0      # prefix tokens computed once for several pairs instead of once per pair
    seconds: float = 0.0


def selective_log_softmax(logits, tokens):
    """``log softmax(logits)[..., tokens]`` without materialising the log-softmax: ``[T, V], [T] -> [T]`` in fp32."""
    import torch

    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
