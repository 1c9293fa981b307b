"""PRIME for games: GRPO's outcome advantage plus process advantages from an implicit PRM trained online.

The implicit PRM (:class:`ImplicitPRM`)
    A second LoRA adapter (``prm``) on the policy's base model, initialised from the SFT adapter like the policy
    (PRIME-RL/PRIME initialise both from the SFT model); its reference is a frozen copy of those initial weights
    (adapter ``prm_ref``). One model in memory holds the policy, the PRM and its reference. Per answer token the
    log-ratio ``q_t = log pi_phi(y_t | y<t) - log pi_ref(y_t | y<t)`` (response tokens only); token reward
    ``r_t = beta * q_t``. It is trained online on every step's sequences with
    ``BCE(sigmoid(beta * sum_t q_t), success)``, each turn's graph backpropagated on its own (the loss needs the
    whole sequence's sum: each sequence's gradient of ``sum_t q_t`` is accumulated turn by turn, then weighted by
    ``dBCE/ds``). A step's token rewards come from that same forward pass, i.e. from the PRM as it was before this
    step's update (so its BCE and accuracy in the metrics are measured on sequences it has not yet seen).

Process advantages (:func:`process_advantages`), per cohort: the sequences of one player in one group
    1. normalise: every token reward divided by the batch's largest absolute reverse cumulative sum (PRIME's
       ``batch_norm``), so a sequence's process return lies in [-1, 1];
    2. leave-one-out baseline (PRIME's ``masked_rloo``): ``r'_t = r_t * n / (n - 1) - sum_j mean_j / (n - 1)``,
       ``mean_j`` the mean normalised token reward of sequence j of the cohort (n sequences);
    3. the process advantage of token t: ``sum_{s >= t} r'_s`` over the sequence's later tokens (gamma 1), across
       its turns;
    4. the *process advantage std threshold*, which no reference code defines: when the standard deviation of
       the cohort's process returns (each sequence's sum of token rewards ``beta * sum_t q_t``, i.e. the implicit
       PRM's own logit, before step 1's normalisation) is below ``rl.prime.process_std_threshold`` (1e-2), the
       implicit PRM does not tell the cohort's sequences apart and its advantages are zero for the whole cohort.
       The threshold is absolute on purpose: measured after the normalisation it would be scale-free, and a PRM
       still at chance (returns of about 1e-3 after its first update) would get process advantages as large as the
       outcome advantages (std 0.33 measured on the embedded default), i.e. noise.
    Combined: ``A_t = A_outcome + A_process_t`` (the issue's formula; no final whitening).

Group-accuracy filter (PRIME-RL/PRIME's prompt filter, ``rl.prime.accuracy_filter``, ``[0.2, 0.8]``; null: off)
    A group whose accuracy (the share of its episodes that succeeded) lies outside ``[low, high]`` is left out of the
    step: neither the implicit PRM nor the policy is updated on it (its turns get no advantages, so they are not in
    the policy loss's normaliser either). All-lost and all-won groups teach neither: their outcome advantage is 0.
    The step's metrics count the groups filtered out; a step without a kept group updates nothing.
"""

from __future__ import annotations

import math

import torch

from clemprm import distributed
from clemprm.rl.grpo import episode_advantages, summary
from clemprm.rl.logprobs import answer_logprobs, frozen, using_adapter
from clemprm.rl.rollouts import Group, Sequence, Turn

PRM_ADAPTER = "prm"
REFERENCE_ADAPTER = "prm_ref"
NORM_EPSILON = 1e-6


class ImplicitPRM:
    """``beta * log(pi_phi / pi_ref)`` on the adapters ``adapter`` (trained) and ``reference`` (frozen) of ``model``."""

    def __init__(self, model, beta: float, *, adapter: str = PRM_ADAPTER, reference: str = REFERENCE_ADAPTER,
                 compute_dtype=None):
        self.model, self.beta = model, float(beta)
        self.adapter, self.reference = adapter, reference
        self.compute_dtype = compute_dtype

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters of the PRM adapter."""
        marker = f".{self.adapter}."
        return [param for name, param in self.model.named_parameters() if marker in name and param.requires_grad]

    def reference_logprobs(self, turn: Turn) -> torch.Tensor:
        with frozen(self.model), using_adapter(self.model, self.reference):
            return answer_logprobs(self.model, turn.prompt_ids, turn.completion_ids, self.compute_dtype)

    def log_ratios(self, turn: Turn) -> torch.Tensor:
        """``q_t`` of every answer token of ``turn``, with gradients (through the PRM adapter) if enabled."""
        reference = self.reference_logprobs(turn)
        with using_adapter(self.model, self.adapter):
            return answer_logprobs(self.model, turn.prompt_ids, turn.completion_ids, self.compute_dtype) - reference

    def score(self, turn: Turn) -> float:
        """The turn score of a candidate: ``beta * sum_t q_t`` over its tokens."""
        with torch.no_grad():
            return self.beta * float(self.log_ratios(turn).sum())

    def accumulate_gradients(self, sequences: list[Sequence]) -> tuple[dict, dict[int, torch.Tensor]]:
        """Gradients of the mean ``BCE(sigmoid(beta * sum_t q_t), success)`` over ``sequences`` into the PRM's
        ``.grad``, one turn's graph at a time (several processes: each its share of the sequences, the gradients
        summed). Returns the loss statistics (before any update) and ``q`` of every turn (detached, on the CPU, by
        ``id(turn)``)."""
        params = self.parameters()
        scored = [sequence for sequence in sequences if sequence.turns]
        totals = [torch.zeros_like(param) for param in params]

        def backward(share: list[Sequence]) -> list[dict]:
            results = []
            for sequence in share:
                for param in params:
                    param.grad = None
                log_ratios, total = [], 0.0
                for turn in sequence.turns:
                    q = self.log_ratios(turn)
                    q.sum().backward()
                    log_ratios.append(q.detach().cpu())
                    total += float(q.detach().sum())
                logit, label = self.beta * total, float(sequence.success)
                probability = 0.5 * (1 + math.tanh(logit / 2))   # sigmoid, without overflow
                weight = self.beta * (probability - label) / len(scored)   # dBCE/d(sum q), averaged over sequences
                for param, accumulated in zip(params, totals):
                    if param.grad is not None:
                        accumulated.add_(param.grad, alpha=weight)
                results.append({"log_ratios": log_ratios, "loss": bce_with_logit(logit, label),
                                "correct": (probability > 0.5) == bool(label)})
            return results

        per_sequence = distributed.map_split(scored, backward)
        for param, accumulated in zip(params, totals):
            param.grad = accumulated
        distributed.sum_gradients(params)
        log_ratios = {id(turn): q for sequence, result in zip(scored, per_sequence)
                      for turn, q in zip(sequence.turns, result["log_ratios"])}
        losses = [result["loss"] for result in per_sequence]
        stats = {"bce": sum(losses) / len(losses) if losses else None,
                 "accuracy": sum(result["correct"] for result in per_sequence) / len(scored) if scored else None,
                 "sequences": len(scored)}
        return stats, log_ratios


def bce_with_logit(logit: float, label: float) -> float:
    """``BCE(sigmoid(logit), label)``, computed stably."""
    return max(logit, 0.0) - logit * label + math.log1p(math.exp(-abs(logit)))


def process_advantages(groups: list[Group], token_rewards: dict[int, torch.Tensor],
                       std_threshold: float) -> tuple[dict[int, list[float]], dict]:
    """Per turn (by ``id(turn)``) the process advantage of each answer token (module docstring, steps 1-4), and
    the step's statistics (cohorts zeroed by the threshold, the normaliser)."""
    def flat(sequence: Sequence) -> torch.Tensor:
        parts = [token_rewards[id(turn)] for turn in sequence.turns]
        return torch.cat(parts) if parts else torch.zeros(0)

    sequences = [sequence for group in groups for sequence in group.sequences if sequence.turns]
    largest = max((float(reverse_cumsum(flat(s)).abs().max()) for s in sequences if s.tokens), default=0.0)
    scale = 1.0 / (largest + NORM_EPSILON)
    advantages: dict[int, list[float]] = {}
    cohorts = zeroed = 0
    for group in groups:
        for cohort in group.by_player().values():
            cohort = [sequence for sequence in cohort if sequence.tokens]
            if not cohort:
                continue
            cohorts += 1
            raw = [flat(sequence) for sequence in cohort]
            returns = [float(r.sum()) for r in raw]
            n = len(cohort)
            spread = math.sqrt(sum((x - sum(returns) / n) ** 2 for x in returns) / n)
            if n < 2 or spread < std_threshold:
                zeroed += 1
                for sequence in cohort:
                    for turn in sequence.turns:
                        advantages[id(turn)] = [0.0] * len(turn.completion_ids)
                continue
            rewards = [r * scale for r in raw]
            baseline = sum(float(r.mean()) for r in rewards) / (n - 1)
            for sequence, r in zip(cohort, rewards):
                per_token = reverse_cumsum(r * n / (n - 1) - baseline).tolist()
                start = 0
                for turn in sequence.turns:
                    advantages[id(turn)] = per_token[start:start + len(turn.completion_ids)]
                    start += len(turn.completion_ids)
    return advantages, {"cohorts": cohorts, "zeroed_cohorts": zeroed, "largest_return": largest}


def reverse_cumsum(values: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_{s >= t} values[s]``."""
    return values.flip(0).cumsum(0).flip(0)


class PRIME:
    """Outcome advantage (GRPO) + implicit-PRM process advantages; the implicit PRM is updated every step."""

    name = "prime"

    def __init__(self, prm: ImplicitPRM, optimizer, scheduler, *, std_threshold: float, max_grad_norm: float,
                 accuracy_filter: list[float] | None = None):
        self.prm, self.optimizer, self.scheduler = prm, optimizer, scheduler
        self.std_threshold, self.max_grad_norm = float(std_threshold), float(max_grad_norm)
        if accuracy_filter is not None and not 0 <= accuracy_filter[0] <= accuracy_filter[1] <= 1:
            raise ValueError(f"rl.prime.accuracy_filter: {accuracy_filter} is no range [low, high] within [0, 1]")
        self.accuracy_filter = accuracy_filter

    def keeps(self, group: Group) -> bool:
        """Whether ``group``'s accuracy lies in the accuracy filter's range (always, with the filter off)."""
        if self.accuracy_filter is None:
            return True
        low, high = self.accuracy_filter
        return low <= group_accuracy(group) <= high

    def assign(self, trainer, groups: list[Group]) -> dict:
        kept = [group for group in groups if self.keeps(group)]
        for group in groups:   # a filtered group's turns are out of the step (advantages None)
            for sequence in group.sequences:
                for turn in sequence.turns:
                    turn.advantages = None
        sequences = [sequence for group in kept for sequence in group.sequences]
        if sequences:
            stats, log_ratios = self.prm.accumulate_gradients(sequences)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.prm.parameters(), self.max_grad_norm))
        else:   # nothing kept: no PRM gradient (the optimizer step leaves parameters without one alone)
            stats, log_ratios, grad_norm = {"bce": None, "accuracy": None, "sequences": 0}, {}, 0.0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        token_rewards = {key: self.prm.beta * q for key, q in log_ratios.items()}
        process, process_stats = process_advantages(kept, token_rewards, self.std_threshold)
        outcome, combined, process_values, zero_groups = [], [], [], 0
        for group in kept:
            advantages = episode_advantages(group)
            outcome += list(advantages.values())
            zero_groups += not any(advantages.values())
            for sequence in group.sequences:
                for turn in sequence.turns:
                    turn.advantages = [advantages[sequence.episode_id] + a for a in process[id(turn)]]
                    combined += turn.advantages
                    process_values += process[id(turn)]
        return {"outcome_advantage": summary(outcome), "process_advantage": summary(process_values),
                "advantage": summary(combined), "implicit_prm": {**stats, "grad_norm": grad_norm, **process_stats},
                "token_reward": summary([float(v) for q in token_rewards.values() for v in q.tolist()]),
                "zero_advantage_groups": zero_groups,
                "filtered_groups": len(groups) - len(kept), "group_accuracy": [group_accuracy(g) for g in groups]}


def group_accuracy(group: Group) -> float:
    """The share of ``group``'s episodes that succeeded (PRIME's accuracy: the success reward)."""
    return sum(bool(row["success"]) for row in group.rows) / max(1, len(group.rows))
