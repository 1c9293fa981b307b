"""The policy update's loss: every trained turn forwarded and backpropagated on its own into the policy adapter's
gradients, and the update's statistics.

Every trained turn (a non-zero advantage or a KL term) is one forward with the adapter on (gradients) and one with
the adapters off (the reference, no gradients), then its own backward: peak memory is one turn's graph. Per token
``-A_t * exp(logp_t - sg(logp_t)) + kl_beta * K3_t`` (the ratio is 1 on policy; its gradient is
``-A_t * grad logp_t``), ``K3 = exp(d) - d - 1``, ``d = logp_ref - logp``.

``rl.loss: importance_sampling`` (the Hanabi card's loss) replaces the ratio by ``exp(logp_t - q_t)``: ``q_t`` is
the *sampler's* log-probability of the token, recomputed right after the rollouts (:func:`record_sampler_logprobs`:
no gradients, eval mode) with the weights exactly as they generated (the adapter merged into the fp32 base, or
active on a 4-bit one), at temperature 1 (the model's own distribution, as vLLM's default logprobs); ``logp_t`` is
the trainer's (train mode: LoRA dropout; the unmerged adapter; bf16 autocast on CUDA). So the ratio is the
trainer-vs-sampler mismatch the loss corrects for, not the gap to the truncated sampling distribution (temperature,
top-k, top-p: the card samples at temperature 1). Where trainer and sampler compute the same distribution the
ratio is 1 and the gradient equals the policy gradient's.

Normalised by ``rl.length_normalisation`` (:func:`step_normaliser`): ``tokens`` divides the step's sum by all
answer tokens of the step, ``constant`` by ``max_new_tokens`` x the step's policy turns (a length-independent
weight per token). Turns without a gradient are skipped, but counted in the normaliser, so skipping changes
nothing.
"""

from __future__ import annotations

import torch

from clemprm.rl.grpo import summary
from clemprm.rl.logprobs import answer_logprobs, reference_logprobs, using_adapter
from clemprm.rl.policy_adapter import POLICY_ADAPTER
from clemprm.rl.rollouts import Group, Turn

LOSSES = ("policy_gradient", "importance_sampling")


def turn_loss(logp: torch.Tensor, reference: torch.Tensor, advantages: torch.Tensor, kl_beta: float,
              normaliser: float, sampler: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, K3 per token)`` of one turn (see the module docstring); ``sampler``: the sampler's log-probs of
    the answer tokens (the importance-sampling loss), else the ratio is to the trainer's own (on-policy) values."""
    ratio = torch.exp(logp - (logp.detach() if sampler is None else sampler))
    d = reference - logp
    k3 = torch.exp(d) - d - 1
    loss = (-(advantages * ratio) + kl_beta * k3).sum() / normaliser
    return loss, k3.detach()


def step_normaliser(turns: list[Turn], length_normalisation: str, max_new_tokens: int) -> float:
    """What a step's summed token losses are divided by (module docstring), from all its policy turns."""
    if length_normalisation == "tokens":
        return float(max(1, sum(len(turn.completion_ids) for turn in turns)))
    if length_normalisation == "constant":
        return float(max(1, max_new_tokens * len(turns)))
    raise ValueError(f"rl.length_normalisation: unknown value {length_normalisation!r} (tokens, constant)")


def accumulate_policy_gradients(model, turns: list[Turn], *, kl_beta: float, normaliser: float,
                                compute_dtype=None, loss: str = "policy_gradient") -> list[dict]:
    """Forward and backward every trained turn on its own into the policy adapter's ``.grad``; per trained turn its
    loss, summed K3, tokens and (``loss: importance_sampling``, which takes the ratio to each turn's
    ``sampler_logprobs``) its tokens' log(trainer / sampler)."""
    if loss not in LOSSES:
        raise ValueError(f"rl.loss: unknown loss {loss!r} (known: {', '.join(LOSSES)})")
    results = []
    with using_adapter(model, POLICY_ADAPTER):
        for turn in turns:
            if not turn.trained:
                continue
            beta = kl_beta if turn.kl_beta is None else turn.kl_beta
            reference = reference_logprobs(model, turn.prompt_ids, turn.completion_ids, compute_dtype)
            logp = answer_logprobs(model, turn.prompt_ids, turn.completion_ids, compute_dtype)
            advantages = torch.tensor(turn.advantages, dtype=logp.dtype, device=logp.device)
            sampler, log_ratios = None, None
            if loss == "importance_sampling":
                if turn.sampler_logprobs is None:
                    raise ValueError("rl.loss importance_sampling: a trained turn has no sampler log-probs")
                sampler = torch.tensor(turn.sampler_logprobs, dtype=logp.dtype, device=logp.device)
                log_ratios = (logp.detach() - sampler).tolist()
            turn_value, k3 = turn_loss(logp, reference, advantages, beta, normaliser, sampler)
            turn_value.backward()
            results.append({"loss": float(turn_value.detach()), "kl_sum": float(k3.sum()),
                            "tokens": len(turn.completion_ids), "log_ratios": log_ratios})
    return results


def update_statistics(trained: list[Turn], per_turn: list[dict], loss: str) -> dict:
    """The update's statistics from every trained turn's results (:func:`accumulate_policy_gradients`); each turn
    keeps its summed K3 (``kl_sum``: SCoRe reports it per attempt)."""
    for turn, result in zip(trained, per_turn):
        turn.kl_sum = result["kl_sum"]
    tokens = sum(result["tokens"] for result in per_turn)
    stats = {"loss": sum(result["loss"] for result in per_turn),
             "kl": sum(result["kl_sum"] for result in per_turn) / tokens if tokens else None,
             "trained_turns": len(per_turn), "trained_tokens": tokens}
    if loss == "importance_sampling":   # log(trainer / sampler) per trained token: how far off-policy the step is
        stats["is_log_ratio"] = summary([value for result in per_turn for value in result["log_ratios"]])
    return stats


def record_sampler_logprobs(model, groups: list[Group], compute_dtype=None) -> None:
    """Every played turn's ``sampler_logprobs`` the sampler did not return (the vllm backend does): its tokens'
    log-probabilities under ``model`` as it is now (the weights that sampled them, eval mode, no gradients): the
    importance-sampling loss's denominator."""
    with torch.no_grad():
        for group in groups:
            for sequence in group.sequences:
                for turn in sequence.turns:
                    if turn.sampler_logprobs is None:
                        turn.sampler_logprobs = answer_logprobs(model, turn.prompt_ids, turn.completion_ids,
                                                                compute_dtype).tolist()
