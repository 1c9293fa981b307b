"""What the ``prm_adapter`` stage measures of a trained PRM and of its baselines, on branch points with soft labels.

Global metrics (across states): BCE, MSE, Pearson and Spearman correlation with the labels, AUROC of
``label > 0.5`` (null when one class is missing), a 10-bin calibration table; the same for two baselines that know no
candidate: the train-side mean label, and the train-side mean label of the candidate's game (a PRM that only beats
the first has learned "which game is this", not "which move"). Candidate-aware baselines (the candidate's length,
the SFT policy's mean token log-probability) are scores, not probabilities: correlations and AUROC only.

Ranking (what a search needs): among the siblings of one state (``branch_points.siblings``: candidates answering the
same state, ``state_id``), the pairwise accuracy over sibling pairs with different labels and the top-1 regret, per
game and pooled, with bootstrap intervals over instances resampled within each game (:mod:`clemprm.stats`; the same
draws for every scorer, so their intervals compare on equal terms).

:func:`quality_gate` decides from these whether the PRM learned anything a search can use.

An example here is anything with ``label`` (float), ``key`` (its instance ``(game, experiment, game_id)``) and
``state_id``.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pandas as pd

from clemprm import stats
from clemprm.stats import OVERALL

CALIBRATION_BINS = 10
EPSILON = 1e-7          # probabilities are clipped to [EPSILON, 1 - EPSILON] for the BCE of predictions


def indices_by_state(examples: list) -> list[list[int]]:
    """The indices of the examples grouped by ``state_id`` (the siblings of one state), groups in order of first
    appearance."""
    groups = collections.defaultdict(list)
    for index, example in enumerate(examples):
        groups[example.state_id].append(index)
    return list(groups.values())


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def calibration(predictions: list[float], labels: list[float], bins: int = CALIBRATION_BINS) -> list[dict]:
    """Equal-width prediction bins over [0, 1]: count, mean prediction and mean label (null when empty)."""
    members = collections.defaultdict(list)
    for prediction, label in zip(predictions, labels):
        members[min(bins - 1, int(prediction * bins))].append((prediction, label))
    return [{"bin": [round(b / bins, 6), round((b + 1) / bins, 6)], "count": len(members[b]),
             "mean_prediction": _mean(p for p, _ in members[b]), "mean_label": _mean(y for _, y in members[b])}
            for b in range(bins)]


def prediction_metrics(predictions: list[float], labels: list[float]) -> dict | None:
    """BCE, MSE, correlations, AUROC and calibration of probabilities against soft labels; None without data."""
    if not labels:
        return None
    clipped = [min(1 - EPSILON, max(EPSILON, p)) for p in predictions]
    return {
        "n": len(labels), "mean_label": _mean(labels), "mean_prediction": _mean(predictions),
        "std_label": float(np.std(labels)), "std_prediction": float(np.std(predictions)),
        "bce": _mean(-(y * math.log(p) + (1 - y) * math.log(1 - p)) for p, y in zip(clipped, labels)),
        "mse": _mean((p - y) ** 2 for p, y in zip(predictions, labels)),
        "pearson": stats.pearson(predictions, labels), "spearman": stats.spearman(predictions, labels),
        "auroc": stats.auroc(predictions, labels), "calibration": calibration(predictions, labels),
    }


def baseline_metrics(train: list, sides: dict[str, list]) -> dict:
    """The two candidate-blind baselines on every side: the train-side mean label, and the train-side mean label
    of the example's game (the overall mean for a game the train side lacks)."""
    overall = _mean(e.label for e in train)
    by_game = collections.defaultdict(list)
    for example in train:
        by_game[example.key[0]].append(example.label)
    game_means = {game: _mean(labels) for game, labels in sorted(by_game.items())}
    predict = {"constant_mean": lambda e: overall, "game_mean": lambda e: game_means.get(e.key[0], overall)}
    baselines = {}
    for name, rule in predict.items():
        baselines[name] = {side: prediction_metrics([rule(e) for e in examples], [e.label for e in examples])
                           for side, examples in sides.items()}
    baselines["constant_mean"]["value"] = overall
    baselines["game_mean"]["values"] = game_means
    return baselines


def rank_metrics(scores: list[float], labels: list[float]) -> dict | None:
    """The scale-free part of :func:`prediction_metrics`, for scores that are no probabilities (a length, a
    log-probability): correlations with the labels and AUROC of ``label > 0.5``."""
    if not labels:
        return None
    return {"n": len(labels), "pearson": stats.pearson(scores, labels), "spearman": stats.spearman(scores, labels),
            "auroc": stats.auroc(scores, labels)}


def sibling_statistics(scores: list[float], labels: list[float]) -> tuple[float, int, float]:
    """``(concordant, pairs, regret)`` of one prefix's siblings: over the sibling pairs with different labels,
    1 when the higher-labelled one scores higher, 1/2 on a score tie; and the best label minus the label of the
    pick, the top score (ties: their mean label, what a random tie-break picks on average)."""
    concordant, pairs = 0.0, 0
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            if labels[i] != labels[j]:
                pairs += 1
                agree = (scores[i] - scores[j]) * (labels[i] - labels[j])
                concordant += 1.0 if agree > 0 else 0.5 if scores[i] == scores[j] else 0.0
    top = max(scores)
    picked = [label for score, label in zip(scores, labels) if score == top]
    return concordant, pairs, max(labels) - sum(picked) / len(picked)


def states_with_siblings(examples: list) -> list[list[int]]:
    """The indices of the examples of each state with two or more siblings."""
    return [indices for indices in indices_by_state(examples) if len(indices) > 1]


def orientation(examples: list, scores: list[float]) -> int:
    """-1 where ``scores`` rank the siblings of ``examples`` (the train side) worse than chance, else 1: a
    candidate-aware baseline (length, the policy's log-probability) is read the way round its train side supports
    ("shorter is better" is a baseline too), so the PRM is measured against its stronger reading."""
    concordant = pairs = 0
    for group in states_with_siblings(examples):
        group_concordant, group_pairs, _ = sibling_statistics([scores[i] for i in group],
                                                              [examples[i].label for i in group])
        concordant, pairs = concordant + group_concordant, pairs + group_pairs
    return -1 if pairs and concordant < pairs / 2 else 1


SIBLING_SUMS = ("concordant", "pairs", "regret", "states", "best_label")   # per instance, summed over its states


def sibling_sums_statistic(tables: dict[str, pd.DataFrame], weights: dict[str, np.ndarray]) -> dict[str, dict]:
    """The ranking metrics per game and pooled over games from per-instance :data:`SIBLING_SUMS` (a
    :data:`clemprm.stats.Statistic`)."""
    totals = {game: weights[game] @ table[list(SIBLING_SUMS)].to_numpy(float) for game, table in tables.items()}
    totals[OVERALL] = sum(totals.values())
    result = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for group, total in totals.items():
            concordant, pairs, regret, states, best = total.T
            result[group] = {"pairwise_accuracy": concordant / pairs, "top1_regret": regret / states,
                             # the mean label of the sibling a scorer picks (best label minus regret)
                             "pick_label": (best - regret) / states, "best_label": best / states}
    return result


def ranking_metrics(examples: list, scorers: dict[str, list[float]], samples: int, seed: int, ci: float) -> dict:
    """What a search needs of a scorer, on the states of ``examples`` with two or more siblings: within-state
    pairwise accuracy (among siblings with different labels), top-1 regret and the mean label of the pick (next
    to ``best_label``, the mean label of the best sibling), overall (pooled over states) and per game, with
    percentile bootstrap intervals over instances resampled within each game (:func:`clemprm.stats.bootstrap`)."""
    groups = states_with_siblings(examples)
    instances = sorted({examples[g[0]].key for g in groups})
    result = {"prefixes": len(groups), "siblings": sum(map(len, groups)), "instances": len(instances),
              "pairs_with_different_labels": sum(sibling_statistics([0.0] * len(g), [examples[i].label for i in g])[1]
                                                 for g in groups),
              "best_label": {}, "scorers": {}}
    if not groups:
        return result
    index = pd.MultiIndex.from_tuples(instances, names=["game", "experiment", "game_id"])
    for name, scores in scorers.items():
        sums = pd.DataFrame(0.0, index=index, columns=list(SIBLING_SUMS))
        for g in groups:
            labels = [examples[i].label for i in g]
            concordant, pairs, regret = sibling_statistics([scores[i] for i in g], labels)
            sums.loc[examples[g[0]].key] += (concordant, pairs, regret, 1, max(labels))
        tables = stats.split_by_game(sums)
        estimates = stats.bootstrap(tables, sibling_sums_statistic, samples, seed, ci)
        counts = {**{game: table.sum() for game, table in tables.items()}, OVERALL: sums.sum()}
        result["best_label"] = {group: entry.pop("best_label") for group, entry in estimates.items()}
        result["scorers"][name] = {group: {**entry, "pairs": int(counts[group]["pairs"]),
                                           "prefixes": int(counts[group]["states"])}
                                   for group, entry in estimates.items()}
    return result


GATE_BASELINES = ("candidate_length", "policy_logprob")   # the candidate-aware baselines a PRM must beat


def quality_gate(held_out: dict | None, ranking: dict | None, gate: dict) -> dict:
    """Whether the trained PRM learned something a search can use, from its metrics on the ranked (held-out) side:

    * ``spread``: its predictions vary at least ``gate.min_spread_ratio`` as much as the labels (standard deviations);
      a PRM that collapsed to the base rate predicts nearly one value for every pair;
    * ``mean``: its mean prediction is within ``gate.max_mean_gap`` of the mean label;
    * ``pairwise_accuracy`` and ``top1_regret``: within states, it ranks siblings better than the best of the
      candidate-aware baselines (the candidate's length, the policy's log-probability, each read the way round its
      train side supports) and than chance (a random pick), strictly, unless that best is already perfect.

    Returns ``{"status", "checks": [{"check", "passed", "value", "threshold", "baseline", "message"}],
    "not_measured"}``, ``status`` ``failed`` when a check failed, ``passed`` when the checks made all passed, and
    ``not_measured`` when the data decided none: a check the data cannot decide (no held-out labels, no states with
    differently labelled siblings) is named in ``not_measured``; the gate fails only on evidence."""
    checks, not_measured = [], []

    def add(name: str, passed: bool, value: float, threshold: float, baseline: str | None, message: str) -> None:
        checks.append({"check": name, "passed": bool(passed), "value": round(float(value), 6),
                       "threshold": round(float(threshold), 6), "baseline": baseline, "message": message})

    if held_out and held_out.get("std_label"):
        ratio = held_out["std_prediction"] / held_out["std_label"]
        add("spread", ratio >= gate["min_spread_ratio"], ratio, gate["min_spread_ratio"], None,
            f"held-out prediction spread (std {held_out['std_prediction']:.4f}) is {ratio:.2f} of the labels' "
            f"(std {held_out['std_label']:.4f}); at least {gate['min_spread_ratio']} needed")
        gap = abs(held_out["mean_prediction"] - held_out["mean_label"])
        add("mean", gap <= gate["max_mean_gap"], gap, gate["max_mean_gap"], None,
            f"held-out mean prediction {held_out['mean_prediction']:.4f} vs mean label {held_out['mean_label']:.4f} "
            f"(gap {gap:.4f}; at most {gate['max_mean_gap']})")
    else:
        not_measured.append("spread and mean: no held-out labels with any spread")

    scorers = (ranking or {}).get("scorers") or {}
    if (ranking or {}).get("pairs_with_different_labels") == 0:
        scorers = {}   # siblings that all share a label rank nothing (every pick is as good): nothing to measure

    def overall(name: str, metric: str) -> float | None:
        return (((scorers.get(name) or {}).get("overall") or {}).get(metric) or {}).get("value")

    for metric, chance, better, perfect in (("pairwise_accuracy", 0.5, max, 1.0), ("top1_regret", None, min, 0.0)):
        value = overall("prm", metric)
        rivals = {name: overall(name, metric) for name in GATE_BASELINES}
        if chance is not None:
            rivals["chance"] = chance
        else:   # a random pick among siblings: constant_mean ties them all
            rivals["random pick"] = overall("constant_mean", metric)
        rivals = {name: v for name, v in rivals.items() if v is not None}
        if value is None or not rivals:
            not_measured.append(f"{metric}: no held-out states with differently labelled siblings")
            continue
        best = better(rivals, key=rivals.get)
        # beating means strictly better, except that matching a baseline that is already perfect is enough
        beats = (value > rivals[best] if better is max else value < rivals[best]) or value == rivals[best] == perfect
        add(metric, beats, value, rivals[best], best,
            f"within-state {metric.replace('_', ' ')} {value:.3f} vs {rivals[best]:.3f} of the best baseline, {best}"
            f" ({', '.join(f'{name} {v:.3f}' for name, v in rivals.items())})")
    status = "not_measured" if not checks else "passed" if all(c["passed"] for c in checks) else "failed"
    return {"status": status, "checks": checks, "not_measured": not_measured}


def gate_lines(gate: dict) -> str:
    """The gate as log lines: its status, then one line per check, PASS or FAIL."""
    lines = [f"PRM quality gate: {gate['status']}"] + [f"{'PASS' if check['passed'] else 'FAIL'} {check['check']}: {check['message']}" for check in gate["checks"]]
    return "\n".join(lines + [f"not measured: {what}" for what in gate["not_measured"]])
