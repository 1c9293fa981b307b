"""The ``logprob`` scorer: the policy's own mean token log-probability of a candidate, a PRM-free baseline.

A search that picks the candidate the policy itself finds likeliest costs one teacher-forced forward pass per
candidate and needs no PRM; a PRM is worth its training only where it beats this pick (and the random pick of
``random_of_n``). The same function gives the PRM evaluation's ``policy_logprob`` baseline on branch points.
"""

from __future__ import annotations

import math
import time

from clemprm.stages.prm import PRMStats, micro_batches, pad_left


def mean_logprobs(policy, pairs: list[tuple[list[dict], str]]) -> list[float]:
    """Mean log-probability (temperature 1) per token of each candidate after its prompt, as ``policy``
    (:class:`clemprm.models.generation.PolicyModel`) samples it: the prompt as the policy renders it (generation prompt
    included), then the candidate's tokens and the end token (stopping there is part of the answer; an empty
    answer is its end token alone). A sequence over ``model.max_context_tokens`` keeps its end; a prompt that
    cannot be rendered scores -inf. Micro-batches of at most ``model.token_budget``
    padded tokens, padded on the left so that only the candidates' positions need logits."""
    import torch

    tokenizer, model, cfg = policy.tokenizer, policy.model, policy.cfg
    prompts = {}
    for prefix, _ in pairs:
        key = tuple((m["role"], m["content"]) for m in prefix)
        if key not in prompts:
            try:
                prompts[key] = tokenizer(policy.render(prefix), add_special_tokens=False)["input_ids"]
            except Exception:  # a template that rejects the messages
                prompts[key] = None
    end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    answers = [ids + end for ids in
               tokenizer([candidate for _, candidate in pairs], add_special_tokens=False)["input_ids"]]
    sequences, answer_lengths, scores = {}, {}, [-math.inf] * len(pairs)
    for i, ((prefix, _), answer) in enumerate(zip(pairs, answers)):
        prompt = prompts[tuple((m["role"], m["content"]) for m in prefix)]
        if prompt is not None and answer:
            sequences[i] = (prompt + answer)[-cfg.max_context_tokens:]
            answer_lengths[i] = min(len(answer), len(sequences[i]) - 1)
    order = sorted(sequences)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        for batch in micro_batches([len(sequences[i]) for i in order], cfg.token_budget):
            rows = [order[b] for b in batch]
            input_ids, attention_mask = pad_left([sequences[i] for i in rows], pad)
            keep = max(answer_lengths[i] for i in rows) + 1
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                           position_ids=(attention_mask.cumsum(-1) - 1).clamp_min(0).to(device),
                           logits_to_keep=keep).logits.float()
            # logits[:, t] predicts token (width - keep + t + 1); the last position predicts nothing
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
            targets = input_ids[:, input_ids.shape[1] - keep + 1:].to(device)
            token_logprobs = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            for row, i in enumerate(rows):
                scores[i] = token_logprobs[row, token_logprobs.shape[1] - answer_lengths[i]:].mean().item()
    return scores


class LogprobScorer:
    """A scorer for :mod:`clemprm.search` (``score(pairs)``) that ranks candidates by :func:`mean_logprobs`
    of ``policy``: the ``best_of_n_logprob`` and ``beam_search_logprob`` eval modes."""

    def __init__(self, policy):
        self.policy = policy
        self.stats = PRMStats()

    def score(self, pairs: list[tuple[list[dict], str]]) -> list[float]:
        start = time.perf_counter()
        scores = mean_logprobs(self.policy, pairs)
        self.stats.calls += 1
        self.stats.pairs += len(pairs)
        self.stats.seconds += time.perf_counter() - start
        return scores
