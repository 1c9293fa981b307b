"""The ``logprob`` scorer: the policy's own mean token log-probability of a candidate, a PRM-free baseline.

A search that picks the candidate the policy itself finds likeliest costs one teacher-forced forward pass per
candidate and needs no PRM; a PRM is worth its training only where it beats this pick (and the random pick of
``random_of_n``). The same function gives the PRM evaluation's ``policy_logprob`` baseline on branch points.
"""

from __future__ import annotations

import math
import time

from clemprm.models.scoring import (MIN_SHARED_TOKENS, ScorerStats, forward_on_shared_prefixes, group_batches,
                                    micro_batches, pad_left, prefix_sharing_problem, selective_log_softmax,
                                    shared_prefix_groups)
from clemprm.play.chat import end_token_ids
from clemprm.play.contract import Pair, Scorer


def mean_logprobs(policy, pairs: list[tuple[list[dict], str]], stats: ScorerStats | None = None) -> list[float]:
    """Mean log-probability (temperature 1) per token of each candidate after its prompt, as ``policy``
    (:class:`clemprm.models.generation.PolicyModel`) samples it: the prompt as the policy renders it (generation prompt
    included), then the candidate's tokens and the end token (stopping there is part of the answer; an empty
    answer is its end token alone). A sequence over ``model.max_context_tokens`` keeps its end; a prompt that
    cannot be rendered scores -inf.

    The candidates of one prompt (a search's N candidates, a branch point's siblings) pass their prompt once: it
    fills a cache that their answers continue (:func:`clemprm.models.scoring.forward_on_shared_prefixes`, as the PRM
    scores its pairs, where the model's cache allows it); other pairs pass alone. ``stats``, if given, counts the
    tokens and the prefix tokens passed once for several pairs. Micro-batches of at most ``model.token_budget``
    padded tokens. A policy on the vllm backend holds no weights here: its server scores the same token sequences
    (:meth:`clemprm.models.vllm_backend.VLLMDecoder.sequence_logprobs`; its prefix cache shares the prompts)."""
    import torch

    tokenizer, model, cfg = policy.tokenizer, policy.model, policy.cfg
    prompts = {}
    for prefix, _ in pairs:
        key = _prompt_key(prefix)
        if key not in prompts:
            try:
                prompts[key] = tokenizer(policy.render(prefix), add_special_tokens=False)["input_ids"]
            except Exception:  # a template that rejects the messages
                prompts[key] = None
    end = end_token_ids(tokenizer)[:1]
    answers = [ids + end for ids in
               tokenizer([candidate for _, candidate in pairs], add_special_tokens=False)["input_ids"]]
    scored, sequences, answer_lengths, keys = [], [], [], []
    for i, ((prefix, _), answer) in enumerate(zip(pairs, answers)):
        key = _prompt_key(prefix)
        if prompts[key] is not None and answer:
            ids = (prompts[key] + answer)[-cfg.max_context_tokens:]
            scored.append(i)
            sequences.append(ids)
            answer_lengths.append(min(len(answer), len(ids) - 1))
            keys.append(key)
    scores = [-math.inf] * len(pairs)
    if model is None:   # the vllm backend
        if stats is not None:
            stats.tokens += sum(len(ids) for ids in sequences)
        for r, token_logprobs in enumerate(policy.decoder.sequence_logprobs(sequences, answer_lengths)):
            if token_logprobs is not None:   # else a sequence the server refused: -inf, as an unrenderable prompt
                scores[scored[r]] = sum(token_logprobs) / len(token_logprobs)
        return scores
    # a shared prefix ends before each row's last prompt token, whose logit predicts the answer's first token
    groups, alone = shared_prefix_groups(sequences, None if prefix_sharing_problem(model) else keys)
    for group in groups:
        group.shared = min([group.shared] + [len(sequences[r]) - answer_lengths[r] - 1 for r in group.rows])
    alone = sorted(alone + [r for group in groups if group.shared < MIN_SHARED_TOKENS for r in group.rows])
    groups = [group for group in groups if group.shared >= MIN_SHARED_TOKENS]
    if stats is not None:
        stats.tokens += sum(len(ids) for ids in sequences)
        stats.shared_tokens += sum(group.shared * (len(group.rows) - 1) for group in groups)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    with torch.inference_mode():
        for batch in micro_batches([len(sequences[r]) for r in alone], cfg.token_budget):
            rows = [alone[b] for b in batch]
            input_ids, attention_mask = pad_left([sequences[r] for r in rows], pad)
            keep = max(answer_lengths[r] for r in rows) + 1
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                           position_ids=(attention_mask.cumsum(-1) - 1).clamp_min(0).to(device),
                           logits_to_keep=keep).logits
            # logits[:, t] predicts token (width - keep + t + 1); the last position predicts nothing
            token_logprobs = selective_log_softmax(logits[:, :-1],
                                                   input_ids[:, input_ids.shape[1] - keep + 1:].to(device))
            for row, r in enumerate(rows):
                scores[scored[r]] = token_logprobs[row, token_logprobs.shape[1] - answer_lengths[r]:].mean().item()
        for batch in group_batches(groups, cfg.token_budget):
            shared = forward_on_shared_prefixes(model, sequences, batch, pad, prefix_kwargs={"logits_to_keep": 1})
            token_logprobs = selective_log_softmax(shared.suffix.logits[:, :-1], shared.suffix_ids[:, 1:].to(device))
            for row, (r, group) in enumerate((r, group) for group in batch for r in group.rows):
                last = len(sequences[r]) - group.shared - 1   # logit j predicts suffix token j + 1; the answer ends it
                scores[scored[r]] = token_logprobs[row, last - answer_lengths[r]:last].mean().item()
    return scores


def _prompt_key(prefix: list[dict]) -> tuple:
    return tuple((m["role"], m["content"]) for m in prefix)


class LogprobScorer(Scorer):
    """A scorer for :mod:`clemprm.search` that ranks candidates by :func:`mean_logprobs`
    of ``policy``: the ``best_of_n_logprob`` and ``beam_search_logprob`` eval modes."""

    log_scale = True   # scores are log-probabilities: beam search's ``prod`` adds them (clemprm.search.beam_search)

    def __init__(self, policy):
        self.policy = policy
        self.stats = ScorerStats()

    def score(self, pairs: list[Pair]) -> list[float]:
        """The policy's mean log-probability of each candidate after its perspective (:class:`Pair`;
        what a fork shows plays no part)."""
        start = time.perf_counter()
        scores = mean_logprobs(self.policy, [(pair.perspective, pair.candidate) for pair in pairs], self.stats)
        self.stats.calls += 1
        self.stats.pairs += len(pairs)
        self.stats.seconds += time.perf_counter() - start
        return scores
