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

:func:`quality_gate` decides from these whether the PRM learned anything a search can use: "better than a baseline"
means that the paired bootstrap interval of the difference clears 0.

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
    percentile bootstrap intervals over instances resampled within each game (:func:`clemprm.stats.bootstrap`).
    With a ``prm`` scorer, ``differences`` holds ``prm - <scorer>`` for every other scorer on the same draws (paired:
    what the quality gate decides on)."""
    groups = states_with_siblings(examples)
    instances = sorted({examples[g[0]].key for g in groups})
    result = {"prefixes": len(groups), "siblings": sum(map(len, groups)), "instances": len(instances),
              "pairs_with_different_labels": sum(sibling_statistics([0.0] * len(g), [examples[i].label for i in g])[1]
                                                 for g in groups),
              "best_label": {}, "scorers": {}, "differences": {}}
    if not groups:
        return result
    index = pd.MultiIndex.from_tuples(instances, names=["game", "experiment", "game_id"])
    tables = {}
    for name, scores in scorers.items():
        sums = pd.DataFrame(0.0, index=index, columns=list(SIBLING_SUMS))
        for g in groups:
            labels = [examples[i].label for i in g]
            concordant, pairs, regret = sibling_statistics([scores[i] for i in g], labels)
            sums.loc[examples[g[0]].key] += (concordant, pairs, regret, 1, max(labels))
        tables[name] = stats.split_by_game(sums)
        estimates = stats.bootstrap(tables[name], sibling_sums_statistic, samples, seed, ci)
        counts = {**{game: table.sum() for game, table in tables[name].items()}, OVERALL: sums.sum()}
        result["best_label"] = {group: entry.pop("best_label") for group, entry in estimates.items()}
        result["scorers"][name] = {group: {**entry, "pairs": int(counts[group]["pairs"]),
                                           "prefixes": int(counts[group]["states"])}
                                   for group, entry in estimates.items()}
    for name in [name for name in scorers if name != "prm" and "prm" in scorers]:
        paired = stats.bootstrap(tables["prm"], sibling_sums_statistic, samples, seed, ci, baseline=tables[name])
        result["differences"][name] = {group: {metric: entry[metric] for metric in RANKING_DIFFERENCES}
                                       for group, entry in paired.items()}
    return result


RANKING_DIFFERENCES = ("pairwise_accuracy", "top1_regret")
GATE_BASELINES = {   # the baselines a PRM must beat within states, by what it reads (prm.input)
    "candidate": ("candidate_length", "policy_logprob", "constant_mean"),
    # a PRM that reads the game's answer must also beat the rule that reads the same answer with no model
    "candidate_with_reply": ("candidate_length", "policy_logprob", "constant_mean", "rule"),
}
RIVAL_NAMES = {"constant_mean": "random pick"}   # constant_mean ties every sibling: a random pick's expectation
# Held-out sibling pairs with different labels the ranking checks need: with fewer, even a PRM right on every pair is
# not clearly better than chance (a sign test: 6 of 6 right, p 0.03 two-sided; 5 of 5, 0.06), while the bootstrap
# interval over so few states degenerates (1 pair: [1.000, 1.000], "clearly better" on no evidence)
MIN_RANKED_PAIRS = 6


def quality_gate(held_out: dict | None, ranking: dict | None, gate: dict, prm_input: str = "candidate",
                 nonfinite: dict | None = None) -> dict:
    """Whether the trained PRM learned something a search can use, from its metrics on the ranked (held-out) side:

    * ``finite``: its predictions are numbers (a PRM whose training diverged predicts NaN);
    * ``spread``: its predictions vary at least ``gate.min_spread_ratio`` as much as the labels (standard deviations);
      a PRM that collapsed to the base rate predicts nearly one value for every pair;
    * ``mean``: its mean prediction is within ``gate.max_mean_gap`` of the mean label;
    * ``pairwise_accuracy`` and ``top1_regret``: within states, it ranks siblings better than each baseline of
      :data:`GATE_BASELINES` (the candidate's length and the policy's log-probability, each read the way round its
      train side supports, a random pick, and for a PRM that reads the game's answer the rule reading the same
      answer), and pairwise better than chance (0.5). Better means that the paired bootstrap interval of the
      difference (``ranking["differences"]``, the same resampled instances for both) lies wholly on the better side
      of 0, and the PRM's own interval above 0.5: a point estimate ahead by luck does not pass (a random scorer on 40
      states of 4 siblings beat the baselines' point estimates in 6 of 60 draws). Matching a baseline that is already
      perfect is enough. Judged on at least :data:`MIN_RANKED_PAIRS` sibling pairs with different labels.

    Returns ``{"status", "checks": [{"check", "passed", "value", "threshold", "baseline", "message"}],
    "not_measured"}``, ``status`` ``failed`` when a check failed, ``passed`` when the checks made all passed, and
    ``not_measured`` when the data decided none: a check the data cannot decide (no held-out labels, no states with
    differently labelled siblings) is named in ``not_measured``; the gate fails only on evidence."""
    checks, not_measured = [], []

    def add(name: str, passed: bool, value: float, threshold: float, baseline: str | None, message: str) -> None:
        checks.append({"check": name, "passed": bool(passed), "value": round(float(value), 6),
                       "threshold": round(float(threshold), 6), "baseline": baseline, "message": message})

    if nonfinite and any(nonfinite.values()):
        count = sum(nonfinite.values())
        add("finite", False, count, 0, None, f"{count} predictions are not finite numbers "
            f"({', '.join(f'{side} {n}' for side, n in nonfinite.items() if n)}): the training diverged (lower prm.lr "
            f"or raise prm.warmup_ratio)")
        return {"status": "failed", "checks": checks, "not_measured": ["every other check: no finite predictions"]}
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

    ranking = ranking or {}
    pairs = ranking.get("pairs_with_different_labels") or 0   # siblings that share a label rank nothing
    measured = pairs >= MIN_RANKED_PAIRS
    scorers = (ranking.get("scorers") or {}) if measured else {}
    differences = (ranking.get("differences") or {}) if measured else {}

    def overall(block: dict, metric: str) -> dict:
        return ((block.get(OVERALL) or {}).get(metric)) or {}

    for metric, sign, perfect in (("pairwise_accuracy", 1, 1.0), ("top1_regret", -1, 0.0)):
        own = overall(scorers.get("prm") or {}, metric)
        rivals = {name: overall(differences[name], metric) for name in GATE_BASELINES[prm_input]
                  if overall(differences.get(name) or {}, metric).get("value") is not None}
        if own.get("value") is None or not rivals:
            not_measured.append(f"{metric}: {pairs} held-out sibling pairs with different labels; at least "
                                f"{MIN_RANKED_PAIRS} needed to judge a ranking")
            continue
        verdicts = {}
        for name, diff in rivals.items():
            rival_value = own["value"] - diff["value"]
            bound = diff["ci_low"] if sign > 0 else -diff["ci_high"]   # the worse end of the interval
            verdicts[name] = bound > 0 or (own["value"] == rival_value == perfect)
        if sign > 0:   # pairwise accuracy: chance is 0.5, a fixed value: the PRM's own interval must clear it
            verdicts["chance"] = own["ci_low"] > 0.5 or own["value"] == perfect
        lost = [name for name, beaten in verdicts.items() if not beaten]
        described = [f"{RIVAL_NAMES.get(name, name)} {own['value'] - diff['value']:.3f} (difference "
                     f"{diff['value']:+.3f} [{diff['ci_low']:+.3f}, {diff['ci_high']:+.3f}])"
                     for name, diff in rivals.items()]
        if sign > 0:
            described.append(f"chance 0.500 (PRM interval [{own['ci_low']:.3f}, {own['ci_high']:.3f}])")
        strongest = lost[0] if lost else max(rivals, key=lambda name: -sign * rivals[name]["value"])
        threshold = 0.5 if strongest == "chance" else own["value"] - rivals[strongest]["value"]
        add(metric, not lost, own["value"], threshold, RIVAL_NAMES.get(strongest, strongest),
            f"within-state {metric.replace('_', ' ')} {own['value']:.3f}; "
            + (f"not clearly better than {', '.join(RIVAL_NAMES.get(n, n) for n in lost)}" if lost
               else "clearly better than every baseline") + f" ({'; '.join(described)})")
    status = "not_measured" if not checks else "passed" if all(c["passed"] for c in checks) else "failed"
    return {"status": status, "checks": checks, "not_measured": not_measured}


def gate_lines(gate: dict) -> str:
    """The gate as log lines: its status, then one line per check, PASS or FAIL."""
    lines = [f"PRM quality gate: {gate['status']}"]
    lines += [f"{'PASS' if check['passed'] else 'FAIL'} {check['check']}: {check['message']}"
              for check in gate["checks"]]
    return "\n".join(lines + [f"not measured: {what}" for what in gate["not_measured"]])
