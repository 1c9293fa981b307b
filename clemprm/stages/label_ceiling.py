"""What a perfect scorer could reach against these labels: the ceiling of within-state pairwise accuracy.

A soft label is the mean of k continuation scores, a noisy estimate of the candidate's true value; ranking siblings
against labels that noisy, even the true values agree with the labels' order only so often. Two estimates, no model:

* **split-half agreement**: each sibling's continuations split into halves (the first ``k // 2`` and the rest); over
  the sibling pairs of one state whose halves both differ, the share the two halves order alike. Each half has half
  the continuations, so it is a lower bound of the agreement of full labels with the truth. Unweighted: each pair of
  distinct answers counts once, whatever its multiplicity.
* **modelled ceiling**: per game, an empirical-Bayes beta-binomial: a Beta prior fitted by the method of moments
  to the labels of the game's non-terminal siblings (a label's variance is the values' variance plus the binomial
  noise of k draws), each sibling's posterior given its own continuation scores (``score / 100`` counted as a
  fractional success), then, in each simulation, true values drawn from the posteriors, k fresh continuations drawn
  from them, and the pairwise accuracy of the true values against those labels (pairs with different drawn labels,
  weighted and tie-broken as :func:`clemprm.stages.prm_metrics.sibling_statistics`). The drawn continuations are
  wins or losses (a label in steps of 1/k): for a game with partial scores they tie more often than its labels do,
  which leaves out close pairs and makes the ceiling slightly optimistic. A terminal sibling (the records'
  ``terminal``: the candidate ended the game, its one score is its own) keeps its exact label, and so does a
  sibling of a game with fewer than two non-terminal siblings (no prior to fit). The value is the simulations' mean,
  the interval their percentiles.

k is the continuations scored (``len(rollout_scores)``; the records' ``k`` also counts those the game failed on).

A scorer's **learned share** is (accuracy - 0.5) / (ceiling - 0.5): 0 for chance, 1 for the ceiling.
"""

from __future__ import annotations

import collections

import numpy as np

from clemprm.stages.prm_metrics import sibling_statistics, states_with_siblings

SIMULATIONS = 200


def _halves(scores: list[float]) -> tuple[float, float] | None:
    if len(scores) < 2:
        return None
    half = len(scores) // 2
    return float(np.mean(scores[:half])), float(np.mean(scores[half:]))


def split_half_agreement(examples: list, rows: list[dict]) -> dict:
    """The share of sibling pairs whose two halves of continuations order them alike (pairs where both halves
    differ; terminal siblings, with one exact score, count their score in both halves)."""
    agree = pairs = 0
    for group in states_with_siblings(examples):
        halves = []
        for i in group:
            row = rows[examples[i].row]
            halves.append((row["label"], row["label"]) if exact(row) else _halves(row["rollout_scores"]))
        for a in range(len(group)):
            for b in range(a + 1, len(group)):
                if halves[a] is None or halves[b] is None:
                    continue
                first, second = halves[a][0] - halves[b][0], halves[a][1] - halves[b][1]
                if first and second:
                    pairs += 1
                    agree += (first > 0) == (second > 0)
    return {"value": agree / pairs if pairs else None, "pairs": pairs}


def beta_prior(labels: list[float], k: int) -> tuple[float, float]:
    """Method-of-moments Beta(alpha, beta) of true values whose k-continuation means are ``labels``."""
    mean = float(np.clip(np.mean(labels), 1e-3, 1 - 1e-3))
    noise = mean * (1 - mean) / k
    value_var = (float(np.var(labels)) - noise) / max(1e-9, 1 - 1 / k)
    value_var = float(np.clip(value_var, 1e-4, mean * (1 - mean) - 1e-4))
    strength = mean * (1 - mean) / value_var - 1
    return mean * strength, (1 - mean) * strength


def exact(row: dict) -> bool:
    """Whether a soft-label row's label is its candidate's own final score (terminal), not an estimate."""
    return bool(row["terminal"]) or not row["rollout_scores"]


def modelled_ceiling(examples: list, rows: list[dict], ci: float, seed: int, simulations: int = SIMULATIONS) -> dict:
    """The pairwise accuracy a scorer of the true values reaches against labels drawn like these (module docstring),
    with its percentile interval at level ``ci``; None where no state's siblings carry different labels: labels
    with no pair to rank allow no ranking figure, and the simulations' rare draws of one would read as a ceiling
    of 1."""
    groups = states_with_siblings(examples)
    if not any(len({rows[examples[i].row]["label"] for i in group}) > 1 for group in groups):
        return {"value": None, "ci_low": None, "ci_high": None, "simulations": 0}
    by_game = collections.defaultdict(list)
    for group in groups:
        for i in group:
            row = rows[examples[i].row]
            if not exact(row):
                by_game[examples[i].key[0]].append((row["label"], len(row["rollout_scores"])))
    priors = {game: beta_prior([label for label, _ in values], int(np.median([k for _, k in values])))
              for game, values in by_game.items() if len(values) > 1}
    rng = np.random.default_rng(seed)
    accuracies = []
    for _ in range(simulations):
        concordant = pairs = 0.0
        for group in groups:
            truth, drawn, weights = [], [], []
            for i in group:
                row, game = rows[examples[i].row], examples[i].key[0]
                if exact(row) or game not in priors:
                    value = label = row["label"]
                else:
                    alpha, beta = priors[game]
                    k, successes = len(row["rollout_scores"]), sum(row["rollout_scores"]) / 100
                    value = rng.beta(alpha + successes, beta + k - successes)
                    label = rng.binomial(k, value) / k
                truth.append(value)
                drawn.append(label)
                weights.append(examples[i].multiplicity)
            group_concordant, group_pairs, _ = sibling_statistics(truth, drawn, weights)
            concordant, pairs = concordant + group_concordant, pairs + group_pairs
        if pairs:
            accuracies.append(concordant / pairs)
    if not accuracies:
        return {"value": None, "ci_low": None, "ci_high": None, "simulations": 0}
    tail = 100 * (1 - ci) / 2
    return {"value": round(float(np.mean(accuracies)), 4),
            "ci_low": round(float(np.percentile(accuracies, tail)), 4),
            "ci_high": round(float(np.percentile(accuracies, 100 - tail)), 4), "simulations": len(accuracies)}


def learned_share(accuracy: float | None, ceiling: float | None) -> float | None:
    """(accuracy - 0.5) / (ceiling - 0.5): the part of what these labels can teach a scorer's ranking shows."""
    if accuracy is None or ceiling is None or ceiling <= 0.5 or not np.isfinite(accuracy):
        return None
    return round((accuracy - 0.5) / (ceiling - 0.5), 4)


def ceiling(examples: list, rows: list[dict], pairwise: dict[str, float | None], ci: float, seed: int) -> dict:
    """The ceiling block of ``metrics.json`` for one side: split-half agreement, the modelled ceiling and the learned
    share of each scorer's pairwise accuracy (``pairwise``: by scorer)."""
    modelled = modelled_ceiling(examples, rows, ci, seed)
    return {"split_half": split_half_agreement(examples, rows), "modelled": modelled,
            "learned_share": {name: learned_share(value, modelled["value"]) for name, value in pairwise.items()}}
