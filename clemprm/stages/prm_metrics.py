"""What the ``prm_metrics`` stage measures of a trained PRM and of its baselines, on branch points with soft labels.

Global metrics (across states): BCE, MSE, Pearson and Spearman correlation with the labels, AUROC of
``label > 0.5`` (null when one class is missing), a 10-bin calibration table; the same for two baselines that know no
candidate: the train-side mean label, and the train-side mean label of the candidate's game (a PRM that only beats
the first has learned "which game is this", not "which move"). Candidate-aware baselines (the candidate's length,
the SFT policy's mean token log-probability) are scores, not probabilities: correlations and AUROC only.

Ranking (what a search needs): among the siblings of one state (``branch_points.siblings``: candidates answering the
same state, ``state_id``), the pairwise accuracy over sibling pairs with different labels and the top-1 regret, per
game and pooled, with bootstrap intervals over instances resampled within each game (:mod:`clemprm.stats`; the same
draws for every scorer, so their intervals compare on equal terms).

:func:`quality_gate` decides from these whether the PRM learned anything a search can use (passed, failed, or not
judged where the held-out evidence is too thin: no evidence is no pass): "better than a baseline" means that the
paired bootstrap interval of the difference clears 0.

An example here is anything with ``label`` (float), ``key`` (its instance ``(game, experiment, game_id)``),
``state_id`` and ``multiplicity`` (how many of its state's sampled answers it is; the ranking weighs each sibling by
it, so that a random pick is one of the N samples at random, :func:`sibling_statistics`).
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


def sibling_statistics(scores: list[float], labels: list[float],
                       multiplicities: list[int] | None = None) -> tuple[float, int, float]:
    """``(concordant, pairs, regret)`` of one prefix's siblings: over the sibling pairs with different labels,
    1 when the higher-labelled one scores higher, 1/2 on a score tie; and the best label minus the label of the
    pick, the top score (ties: their mean label, what a random tie-break picks on average). With ``multiplicities``
    (how many of the state's samples each sibling is, the records' ``multiplicity``) the siblings count as the
    samples they are: a pair weighs ``m_a * m_b`` (the pairs of samples), and a tie at the top is broken by a random
    sample (the tied labels' mean weighted by multiplicity), so a scorer that ties every sibling picks what a random
    one of the N samples has: the multiplicity-weighted mean label. Without them, each sibling counts once."""
    weights = multiplicities or [1] * len(labels)
    concordant, pairs = 0.0, 0
    for i in range(len(labels)):
        for j in range(i + 1, len(labels)):
            if labels[i] != labels[j]:
                pairs += weights[i] * weights[j]
                agree = (scores[i] - scores[j]) * (labels[i] - labels[j])
                concordant += weights[i] * weights[j] * (1.0 if agree > 0 else 0.5 if scores[i] == scores[j] else 0.0)
    top = max(scores)
    picked = [(label, weight) for score, label, weight in zip(scores, labels, weights) if score == top]
    return concordant, pairs, max(labels) - sum(label * weight for label, weight in picked) / sum(w for _, w in picked)


def verdict_metrics(predictions: list[float], accepted: list[float]) -> dict:
    """How well a PRM's predictions tell the candidates the game accepted (1) from those it counted a rule violation
    (0): their number and the AUROC (null where the game gave one verdict only). On the held-out siblings it is the
    same figure for a PRM of either kind, whatever it trained on."""
    return {"n": len(accepted), "accepted": int(sum(accepted)), "auroc": stats.auroc(predictions, accepted)}


def states_with_siblings(examples: list) -> list[list[int]]:
    """The indices of the examples of each state with two or more siblings."""
    return [indices for indices in indices_by_state(examples) if len(indices) > 1]


def orientation_side(train: list) -> list:
    """The examples the candidate-aware baselines are oriented on: the train side when it has siblings, else none
    (nothing to orient on; every baseline is then read as is)."""
    return train if states_with_siblings(train) else []


def orientation(examples: list, scores: list[float]) -> int:
    """-1 where ``scores`` rank the siblings of ``examples`` (the train side) worse than chance, else 1: a
    candidate-aware baseline (length, the policy's log-probability) is read the way round its train side supports
    ("shorter is better" is a baseline too), so the PRM is measured against its stronger reading."""
    concordant = pairs = 0
    for group in states_with_siblings(examples):
        group_concordant, group_pairs, _ = sibling_statistics([scores[i] for i in group],
                                                              [examples[i].label for i in group],
                                                              [examples[i].multiplicity for i in group])
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
    what the quality gate decides on). The metrics weigh each sibling by its multiplicity (:func:`sibling_statistics`;
    a scorer's ``pairs``: the pairs of samples they cover); ``pairs_with_different_labels`` counts distinct answer
    pairs, the evidence (a repeated answer is one answer labelled once), and ``ranked_instances`` per game the
    instances holding such a pair (:func:`ranking_evidence`); ``ci`` is the intervals' level."""
    groups = states_with_siblings(examples)
    instances = sorted({examples[g[0]].key for g in groups})
    ranked = {examples[g[0]].key for g in groups if len({examples[i].label for i in g}) > 1}
    result = {"prefixes": len(groups), "siblings": sum(map(len, groups)), "instances": len(instances),
              "pairs_with_different_labels": sum(sibling_statistics([0.0] * len(g), [examples[i].label for i in g])[1]
                                                 for g in groups),
              # per game, the instances with a differently labelled sibling pair (the gate's evidence)
              "ranked_instances": dict(sorted(collections.Counter(key[0] for key in ranked).items())), "ci": ci,
              "best_label": {}, "scorers": {}, "differences": {}}
    if not groups:
        return result
    index = pd.MultiIndex.from_tuples(instances, names=["game", "experiment", "game_id"])
    tables = {}
    for name, scores in scorers.items():
        sums = pd.DataFrame(0.0, index=index, columns=list(SIBLING_SUMS))
        for g in groups:
            labels = [examples[i].label for i in g]
            concordant, pairs, regret = sibling_statistics([scores[i] for i in g], labels,
                                                           [examples[i].multiplicity for i in g])
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
# The least evidence the ranking checks are judged on. Sibling pairs with different labels: with fewer, even a PRM
# right on every pair is not clearly better than chance (a sign test: 6 of 6 right, p 0.03 two-sided; 5 of 5, 0.06).
# Ranked instances (with such a pair) in every game that has any: the bootstrap resamples instances within each game,
# so a game of one instance never varies, and with one per game the interval has no width at all ("clearly better" on
# a point estimate: a random PRM on random labels passed 21 of 100 such draws). With at least this many per game it
# passed at most 5 % of simulated draws (tests/test_prm.py, the random-PRM simulation).
# A game below it is left out of the ranking checks when other games reach it (:func:`gate_ranking`): it is the
# thin game's own interval that has no width, and it no longer keeps the others from being judged.
MIN_RANKED_PAIRS = 6
MIN_RANKED_INSTANCES = 3


def gate_ranking(examples: list, scorers: dict[str, list[float]], ranking: dict, samples: int, seed: int,
                 ci: float) -> dict | None:
    """The ranking the quality gate judges where it is not ``ranking`` (:func:`ranking_metrics` of ``examples``
    under ``scorers``): when some games hold their differently labelled pairs in fewer than
    :data:`MIN_RANKED_INSTANCES` instances and others in enough, the same metrics on the other games' states alone
    (overall figures only), with ``left_out``: each thin game's count of such instances. None when no game is left
    out: every game has enough, or none has (then nothing is judged: :func:`ranking_evidence`)."""
    counts = ranking.get("ranked_instances") or {}
    thin = {game: n for game, n in counts.items() if n < MIN_RANKED_INSTANCES}
    if not thin or len(thin) == len(counts):
        return None
    kept = [i for i, example in enumerate(examples) if example.key[0] not in thin]
    judged = ranking_metrics([examples[i] for i in kept], {name: [scores[i] for i in kept]
                                                           for name, scores in scorers.items()}, samples, seed, ci)
    return {"left_out": thin, "pairs_with_different_labels": judged["pairs_with_different_labels"],
            "ranked_instances": judged["ranked_instances"],
            **{key: {name: {OVERALL: entry[OVERALL]} for name, entry in judged[key].items()}
               for key in ("scorers", "differences")}}


def ranking_evidence(ranking: dict) -> str | None:
    """Why ``ranking`` (of :func:`ranking_metrics`) is too little evidence to judge a ranking on, None when it is
    enough: at least :data:`MIN_RANKED_PAIRS` differently labelled sibling pairs, and in every game with such pairs at
    least :data:`MIN_RANKED_INSTANCES` instances holding them."""
    pairs = ranking.get("pairs_with_different_labels") or 0   # siblings that share a label rank nothing
    if pairs < MIN_RANKED_PAIRS:
        return (f"{pairs} held-out sibling pairs with different labels; at least {MIN_RANKED_PAIRS} needed to judge a "
                f"ranking")
    sparse = {game: n for game, n in (ranking.get("ranked_instances") or {}).items() if n < MIN_RANKED_INSTANCES}
    if sparse:
        counts = ", ".join(f"{game} {n}" for game, n in sparse.items())
        return (f"held-out instances with differently labelled siblings: {counts}; at least {MIN_RANKED_INSTANCES} "
                f"per game needed for an interval over instances (hold out more instances of those games: "
                f"branch_points.validation_instances)")
    return None


def quality_gate(held_out: dict | None, ranking: dict | None, gate: dict, prm_input: str = "candidate",
                 nonfinite: dict | None = None, probabilities: bool = False) -> dict:
    """Whether the trained PRM learned something a search can use, from its metrics on the ranked (held-out) side:

    * ``finite``: its predictions are numbers (a PRM whose training diverged predicts NaN);
    * ``spread``: its predictions vary at least ``gate.min_spread_ratio`` as much as the labels (standard deviations);
      a PRM that collapsed to the base rate predicts nearly one value for every pair;
    * ``mean`` (calibration): its mean prediction is within ``gate.max_mean_gap`` of the mean label. It decides only
      with ``probabilities`` (a configured search multiplies the PRM's values as probabilities:
      :func:`clemprm.modes.probability_search`); a search that takes the argmax among the siblings of one state, or
      compares beams by their last or worst score, reads only the PRM's order, which no offset changes: there it is
      reported (``reported``) and decides nothing;
    * ``pairwise_accuracy`` and ``top1_regret``: within states, it ranks siblings better than each baseline of
      :data:`GATE_BASELINES` (the candidate's length and the policy's log-probability, each read the way round its
      train side supports, a random pick, and for a PRM that reads the game's answer the rule reading the same
      answer), and pairwise better than chance (0.5). Better means that the paired bootstrap interval of the
      difference (``ranking["differences"]``, the same resampled instances for both, at level ``prm.ci``) lies
      wholly on the better side of 0, and the PRM's own interval above 0.5: a point estimate ahead by luck does not
      pass. Matching a baseline that is already perfect is enough. Judged only on enough evidence
      (:func:`ranking_evidence`).

    Returns ``{"status", "checks": [{"check", "passed", "value", "threshold", "baseline", "message"}], "reported",
    "not_judged"}``, ``status`` ``failed`` when a check failed, ``not_judged`` when
    none failed but the data could not decide one (named in ``not_judged``: no held-out labels with spread, too
    little ranking evidence): no evidence is no pass; ``passed`` when every check was judged and passed."""
    checks, reported, not_judged = [], [], []

    def add(name: str, passed: bool, value: float, threshold: float, baseline: str | None, message: str,
            into: list = checks) -> None:
        into.append({"check": name, "passed": bool(passed), "value": round(float(value), 6),
                     "threshold": round(float(threshold), 6), "baseline": baseline, "message": message})

    if nonfinite and any(nonfinite.values()):
        count = sum(nonfinite.values())
        add("finite", False, count, 0, None, f"{count} predictions are not finite numbers "
            f"({', '.join(f'{side} {n}' for side, n in nonfinite.items() if n)}): the training diverged (lower prm.lr "
            f"or raise prm.warmup_ratio)")
        return {"status": "failed", "checks": checks, "reported": reported,
                "not_judged": ["every other check: no finite predictions"]}
    if held_out and held_out.get("std_label"):
        ratio = held_out["std_prediction"] / held_out["std_label"]
        add("spread", ratio >= gate["min_spread_ratio"], ratio, gate["min_spread_ratio"], None,
            f"held-out prediction spread (std {held_out['std_prediction']:.4f}) is {ratio:.2f} of the labels' "
            f"(std {held_out['std_label']:.4f}); at least {gate['min_spread_ratio']} needed")
        gap = abs(held_out["mean_prediction"] - held_out["mean_label"])
        add("mean", gap <= gate["max_mean_gap"], gap, gate["max_mean_gap"], None,
            f"held-out mean prediction {held_out['mean_prediction']:.4f} vs mean label {held_out['mean_label']:.4f} "
            f"(gap {gap:.4f}; at most {gate['max_mean_gap']})" + ("" if probabilities else
            "; reported, not decisive: no configured search multiplies the PRM's values as probabilities"),
            into=checks if probabilities else reported)
    else:
        not_judged.append("spread and mean: no held-out labels with any spread")

    ranking = ranking or {}
    too_little = ranking_evidence(ranking)
    scorers = (ranking.get("scorers") or {}) if too_little is None else {}
    differences = (ranking.get("differences") or {}) if too_little is None else {}

    def overall(block: dict, metric: str) -> dict:
        return ((block.get(OVERALL) or {}).get(metric)) or {}

    for metric, sign, perfect in (("pairwise_accuracy", 1, 1.0), ("top1_regret", -1, 0.0)):
        own = overall(scorers.get("prm") or {}, metric)
        rivals = {name: overall(differences[name], metric) for name in GATE_BASELINES[prm_input]
                  if overall(differences.get(name) or {}, metric).get("value") is not None}
        if own.get("value") is None or not rivals:
            not_judged.append(f"{metric}: {too_little or 'no baseline to compare with'}")
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
    status = ("failed" if not all(c["passed"] for c in checks) else "not_judged" if not_judged or not checks
              else "passed")
    left_out = {"left_out": ranking["left_out"]} if ranking.get("left_out") else {}
    return {"status": status, "checks": checks, "reported": reported, "not_judged": not_judged, **left_out}


def left_out_text(left_out: dict[str, int]) -> str:
    """The games :func:`gate_ranking` left out, in words."""
    return (", ".join(f"{game} ({n} held-out instance{'s' if n != 1 else ''} with differently labelled siblings)"
                      for game, n in left_out.items())
            + f": fewer than {MIN_RANKED_INSTANCES} give no interval over instances; judged on the other games")


def gate_lines(gate: dict) -> str:
    """The gate as log lines: its status, then one line per check, PASS or FAIL, the reported ones, and what it
    could not judge."""
    lines = [f"PRM quality gate: {gate['status']}"]
    lines += [f"{'PASS' if check['passed'] else 'FAIL'} {check['check']}: {check['message']}"
              for check in gate["checks"]]
    lines += [f"REPORTED {check['check']}: {check['message']}" for check in gate["reported"]]
    lines += [f"DIAGNOSIS {gate['diagnosis']}"] if gate.get("diagnosis") else []
    lines += [f"LEFT OUT of the ranking checks: {left_out_text(gate['left_out'])}"] if gate.get("left_out") else []
    return "\n".join(lines + [f"NOT JUDGED {what}" for what in gate["not_judged"]])
