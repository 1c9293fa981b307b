"""Fast batched decoding of token-id prompts with one causal LM: :class:`Decoder`, the engine under the policy.

What it samples is what HF ``model.generate`` samples (:mod:`clemprm.models.sampling`). It is faster because it does
less around the same forward passes:

* a KV cache whose attention layers are preallocated (:mod:`clemprm.models.kv_cache`),
* prefill once per micro-batch, logits of the last position only, identical prompts prefilled once, and
  for plain-attention models (SmolLM2, Llama, Qwen3) a prefix common to the micro-batch prefilled once,
* the state after each conversation (a prompt without its generation prompt) kept in a
  :class:`~clemprm.models.kv_cache.PrefixStore`, so that the next turn of a game, or a fork of it, prefills only its
  new tokens (``model.prefix_cache_mb``),
* one-token decode attention on CPU as two small matmuls (:mod:`clemprm.models.decode_attention`),
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
from typing import Any

import torch

from clemprm.models import gated_delta
from clemprm.models.decode_attention import fast_decode_attention
from clemprm.models.kv_cache import (PrefixStore, RowState, make_cache, prefix_shareable, restore_rows, snapshot_rows,
                                     snapshottable)
from clemprm.models.sampling import SamplingParams, sample_tokens
from clemprm.models.scoring import common_prefix_length

MIN_SHARED_PREFIX = 8       # prompts of a micro-batch sharing this many first tokens prefill them once


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
        with fast_decode_attention(self.model):
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
        if shared < MIN_SHARED_PREFIX or not prefix_shareable(cache):
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
