"""The ``prm_metrics`` stage: the trained PRM measured and judged with no model, from the predictions the
``prm_adapter`` stage wrote (``results/prm/predictions.parquet``, :data:`clemprm.records.PRM_PREDICTIONS`, its
training record in the provenance) and the soft labels -> ``results/prm/metrics.json``.

On every side, global prediction metrics, and on the ranked side the within-state ranking among siblings with
bootstrap intervals over instances (``prm.bootstrap_samples``, ``prm.ci``), next to the candidate's length, the
policy's log-probability, a random pick, the game's acceptance of the candidate (what a blind scorer gets if it
knows only the rules' validity verdict) and the lookahead rule (:func:`clemprm.play.engine.rule_score`: what a fork
shows, read with no model); the measures are :mod:`clemprm.stages.prm_metrics`. The ranked side is ``heldout``, the
branch points of validation-split instances (``branch_points.validation_instances``), which neither training nor the
choice of epoch sees; without them it is the ``validation`` slice of train instances (``prm.validation_fraction``),
which also chose the epoch. Then the quality gate (:func:`~clemprm.stages.prm_metrics.quality_gate`) and the marks:
the training's warnings, an untrained PRM and a failed gate (:mod:`clemprm.checks.run_time`).

Its own rule, so that what only changes the measuring (``prm.ci``, the gate's thresholds, a search that reads the
PRM's values as probabilities) reruns seconds of work, not the training.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from clemprm import records
from clemprm.checks.run_time import MARKS_KEY, StageFailure, fail_or_warn
from clemprm.config import deep_merge
from clemprm.play.engine import rule_score
from clemprm.stages import label_ceiling
from clemprm.stages.prm_data import SIDES, TRAINING_KEY, read_labels, row_fields
from clemprm.stages.prm_metrics import (baseline_metrics, gate_lines, gate_ranking, orientation, orientation_side,
                                        prediction_metrics, quality_gate, rank_metrics, ranking_metrics,
                                        verdict_metrics)
from clemprm.stats import OVERALL

log = logging.getLogger(__name__)


@dataclass
class Predicted:
    """One scored soft-label row as :mod:`clemprm.stages.prm_metrics` reads an example, with the PRM's prediction
    and the policy's log-probability of its candidate (None where no baseline reads it)."""

    label: float
    key: tuple[str, str, str]
    state_id: str
    row: int
    multiplicity: int
    prediction: float
    policy_logprob: float | None


def metrics_params(config: dict) -> dict:
    """What rule ``prm_metrics``'s output depends on: the seed and the measuring keys of ``prm`` (its params are
    these without :data:`clemprm.workflow.RUN_KEYS`); whether a search reads the PRM's values as probabilities is
    its own param (:func:`clemprm.modes.probability_search`)."""
    prm = config["prm"]
    return {"seed": config["seed"], "prm": {key: prm[key] for key in ("input", "ci", "bootstrap_samples", "gate")}}


def read_predictions(path: str, rows: list[dict]) -> tuple[dict[str, list[Predicted]], dict]:
    """The predictions of ``path`` by side, each with its soft-label row's label, instance and state, and the
    training record of its provenance; a row that names no soft-label row of ``rows`` is an error naming both files'
    rule."""
    training = records.read_provenance(path).get(TRAINING_KEY)
    if training is None:
        raise records.RecordFileError(f"record file {path} holds no training record (provenance "
                                      f"{TRAINING_KEY!r}){records.remake_hint(path)}")
    sides = {side: [] for side in SIDES}
    for predicted in records.read_records(path, records.PRM_PREDICTIONS):
        index = predicted["row"]
        if not 0 <= index < len(rows) or rows[index]["bp_id"] != predicted["bp_id"]:
            raise records.RecordFileError(f"record file {path}: row {index} ({predicted['bp_id']}) is no row of the "
                                          f"soft labels read beside it (made from other labels?)"
                                          f"{records.remake_hint(path)}")
        prediction = math.nan if predicted["prediction"] is None else predicted["prediction"]
        sides[predicted["side"]].append(Predicted(**row_fields(index, rows[index]), prediction=prediction,
                                                  policy_logprob=predicted["policy_logprob"]))
    return sides, training


FORK_READERS = {   # what the fork of a candidate shows, as ranking baselines (the rows' turn verdict and reply)
    "acceptance": lambda row: float(bool(row["parse_ok"])),
    "rule": lambda row: rule_score(row["reply"], row["parse_ok"]),
}


def evaluate(sides: dict[str, list[Predicted]], ranked: str, rows: list[dict], prm: dict, seed: int) -> dict:
    """Prediction metrics of the trained PRM and of the baselines, per side (None when empty); on the ``ranked``
    side (the held-out set when there is one, else the validation slice) also the candidate-aware baselines (the
    candidate's length in characters, the policy's mean token log-probability of it; each times its train-side
    :func:`orientation`), the fork's readings (:data:`FORK_READERS`: whether the game accepted the candidate, and the
    lookahead rule), the PRM's AUROC for the game's verdicts on that side (:func:`verdict_metrics`) and every
    scorer's within-prefix ranking (:func:`ranking_metrics`, with each baseline's paired difference to the PRM;
    ``constant_mean`` ties all siblings: the expected pick of a random choice); the labels' own ceiling there with
    every scorer's learned share of it (:func:`clemprm.stages.label_ceiling.ceiling`), the PRM on its train side
    (:func:`train_ranking`) and, where games too thin for an interval are left out of the gate's ranking checks,
    the ranking it judges (:func:`clemprm.stages.prm_metrics.gate_ranking`). Predictions that are not finite (a
    diverged PRM) stop the evaluation there: ``nonfinite_predictions`` counts them per side, for the gate."""
    predictions = {side: [e.prediction for e in examples] for side, examples in sides.items()}
    nonfinite = {side: sum(not math.isfinite(p) for p in values) for side, values in predictions.items()}
    if any(nonfinite.values()):
        return {"evaluation": dict.fromkeys(sides), "baselines": None, "ranking": None,
                "nonfinite_predictions": nonfinite}
    evaluation = {side: prediction_metrics(predictions[side], [e.label for e in examples])
                  for side, examples in sides.items()}
    baselines = baseline_metrics(sides["train"], sides)
    examples = sides[ranked]
    labels = [e.label for e in examples]
    readers = {"candidate_length": lambda e: float(len(rows[e.row]["candidate"])),
               "policy_logprob": lambda e: e.policy_logprob}
    oriented_on = orientation_side(sides["train"])
    orientations = {name: orientation(oriented_on, [read(e) for e in oriented_on]) for name, read in readers.items()}
    candidate_scores = {name: [orientations[name] * read(e) for e in examples] for name, read in readers.items()}
    for name, scores in candidate_scores.items():
        baselines[name] = {ranked: rank_metrics(scores, labels), "orientation": orientations[name]}
    fork_scores = {name: [read(rows[e.row]) for e in examples] for name, read in FORK_READERS.items()}
    for name, scores in fork_scores.items():
        baselines[name] = {ranked: rank_metrics(scores, labels)}
    game_means = baselines["game_mean"]["values"]
    scorers = {"prm": predictions[ranked], "constant_mean": [0.0] * len(examples),
               "game_mean": [game_means.get(e.key[0], baselines["constant_mean"]["value"]) for e in examples],
               **candidate_scores, **fork_scores}
    ranking = {"side": ranked, "orientation": orientations,
               **ranking_metrics(examples, scorers, prm["bootstrap_samples"], seed, prm["ci"])}
    judged = gate_ranking(examples, scorers, ranking, prm["bootstrap_samples"], seed, prm["ci"])
    verdicts = {"side": ranked, **verdict_metrics(predictions[ranked], fork_scores["acceptance"])}
    pairwise = {name: ((entry.get(OVERALL) or {}).get("pairwise_accuracy") or {}).get("value")
                for name, entry in ranking["scorers"].items()}
    return {"evaluation": evaluation, "baselines": baselines, "ranking": ranking, "gate_ranking": judged,
            "verdicts": verdicts,
            "ceiling": {"side": ranked, **label_ceiling.ceiling(examples, rows, pairwise, prm["ci"], seed)},
            "train_ranking": train_ranking(sides["train"], predictions["train"], rows, prm, seed)}


RANKING_CHECKS = ("pairwise_accuracy", "top1_regret")   # the gate's ranking checks: the train side's figures


def train_ranking(train: list[Predicted], predictions: list[float], rows: list[dict], prm: dict, seed: int) -> dict:
    """The PRM on the side it trained on, beside the held-out figures, so that underfitting (it does not rank even
    its train siblings) and not transferring (it ranks them, not the held-out ones) read apart: its within-state
    pairwise accuracy and top-1 regret (and in ``baselines`` those of a random pick and of the candidate's length,
    read the way round these siblings support), the spread of its predictions against the labels', its AUROC for the
    game's verdicts and the train labels' own ceiling with each scorer's learned share."""
    if not train:
        return {}
    lengths = [float(len(rows[e.row]["candidate"])) for e in train]
    direction = orientation(train, lengths)
    scorers = {"prm": predictions, "constant_mean": [0.0] * len(train),
               "candidate_length": [direction * length for length in lengths]}
    ranking = ranking_metrics(train, scorers, prm["bootstrap_samples"], seed, prm["ci"])
    overall = {name: {metric: entry[OVERALL][metric] for metric in RANKING_CHECKS}
               for name, entry in ranking["scorers"].items()}
    std_label = float(np.std([e.label for e in train]))
    pairwise = {name: entry["pairwise_accuracy"]["value"] for name, entry in overall.items()}
    return {"pairs_with_different_labels": ranking["pairs_with_different_labels"],
            **overall.pop("prm", dict.fromkeys(RANKING_CHECKS)), "baselines": overall,
            "orientation": {"candidate_length": direction},
            "spread_ratio": round(float(np.std(predictions)) / std_label, 4) if std_label else None,
            "verdicts": verdict_metrics(predictions, [FORK_READERS["acceptance"](rows[e.row]) for e in train]),
            "ceiling": label_ceiling.ceiling(train, rows, pairwise, prm["ci"], seed)}


def gate_diagnosis(gate: dict, train: dict) -> str | None:
    """Why a gate's ranking check failed, read from the train side: ``underfit`` (the PRM ranks its own train
    siblings at less than half of what their labels allow, or its interval there reaches 0.5), else ``does not
    transfer`` (it ranks them; it does not rank the held-out ones). None when no ranking check failed or the train
    side was not measured."""
    share = ((train.get("ceiling") or {}).get("learned_share") or {}).get("prm")
    low = (train.get("pairwise_accuracy") or {}).get("ci_low")
    failed = any(check["check"] in RANKING_CHECKS and not check["passed"] for check in gate["checks"])
    if not failed or share is None:
        return None
    if share < 0.5 or (low is not None and low <= 0.5):
        return (f"underfit: on its train side the PRM shows {share:.2f} of what the labels allow (train longer or "
                f"harder)")
    return f"does not transfer: it ranks its train siblings ({share:.2f} of the ceiling), not the held-out ones"


def untrained_marks(metrics: dict, on_failure: str) -> list:
    """The failure mark of a PRM whose training left its adapter as it was (every step at learning rate 0, or weights
    that did not change); raises under ``on_failure: stop``."""
    if not str(metrics.get("status", "")).startswith("untrained: ") or not metrics.get("steps"):
        return []
    return [fail_or_warn("prm_adapter", f"the PRM did not train: {metrics['status'][len('untrained: '):]}",
                         on_failure, condition="adapter_not_trained", count=metrics["steps"])]


def gate_marks(gate: dict, on_failure: str) -> list:
    """The failure mark of a failed quality gate (none when it passed); raises under ``on_failure: stop``. A gate not
    judged (too little held-out evidence) is no pass: it stops the stage under ``stop`` as well (a run that asks to
    stop on a PRM that learned nothing spends no search on a PRM nobody could judge), and under ``continue`` it is a
    warning in the log and in the summary, not a failure mark."""
    if gate["status"] == "not_judged":
        text = "the PRM's quality gate was not judged: " + "; ".join(gate["not_judged"])
        if on_failure == "stop":
            raise StageFailure(f"prm_adapter: {text} (prm.gate.on_failure: stop goes on only with a gate that passed; "
                               f"hold out more instances, or set prm.gate.on_failure: continue to go on unjudged)")
        log.warning("PRM QUALITY GATE NOT JUDGED (no evidence is no pass): %s", text)
        return []
    failed = [check for check in gate["checks"] if not check["passed"]]
    if not failed:
        return []
    return [fail_or_warn("prm_adapter", "the PRM did not pass its quality gate: "
                         + "; ".join(f"{check['check']}: {check['message']}" for check in failed), on_failure,
                         condition="prm_not_learned", count=len(failed))]


def measure_prm(settings: dict, labels_path: str, predictions_path: str, metrics_path: str, on_failure: str = "stop",
                probabilities: bool = False) -> dict:
    """Measure the PRM of ``predictions_path`` (:func:`clemprm.stages.prm.train_prm`'s output) against the soft labels
    of ``labels_path`` and write the metrics JSON: the training record, :func:`evaluate`'s metrics, the quality gate
    and the marks (the training's warnings, then an untrained PRM's and a failed gate's, :func:`gate_marks`); return
    them. ``settings``: seed and prm (:func:`metrics_params` with the run keys); ``config`` in the metrics is the
    training's with these measuring keys. A failed gate stops the stage under ``prm.gate.on_failure: stop``
    (``inherit``: ``on_failure``). ``probabilities``: a configured search multiplies the PRM's values as
    probabilities (:func:`clemprm.modes.probability_search`), so calibration decides the gate."""
    start = time.perf_counter()
    prm, seed = settings["prm"], int(settings["seed"])
    rows = read_labels(labels_path)
    sides, training = read_predictions(predictions_path, rows)
    made = records.read_provenance(predictions_path)
    ranked = "heldout" if training["examples"]["heldout"] else "validation"
    metrics = dict(training)
    if training["examples"]["train"]:
        metrics.update(evaluate(sides, ranked, rows, prm, seed))
        judged = metrics.get("gate_ranking") or metrics["ranking"]   # thin games left out, where others are enough
        metrics["gate"] = quality_gate(metrics["evaluation"][ranked], judged, prm["gate"], prm["input"],
                                       metrics.get("nonfinite_predictions"), probabilities)
        diagnosis = gate_diagnosis(metrics["gate"], metrics.get("train_ranking") or {})
        if diagnosis:
            metrics["gate"]["diagnosis"] = diagnosis
    else:   # an untrained adapter: nothing to measure, the gate cannot judge
        metrics.update(evaluation=dict.fromkeys(SIDES), baselines=None, ranking=None,
                       gate=quality_gate(None, None, prm["gate"], prm["input"]))
    log.info("%s", gate_lines(metrics["gate"]))
    gate_action = on_failure if prm["gate"]["on_failure"] == "inherit" else prm["gate"]["on_failure"]
    marks = untrained_marks(metrics, on_failure) + gate_marks(metrics["gate"], gate_action)
    metrics[MARKS_KEY] = training.get(MARKS_KEY, []) + [mark.as_dict() for mark in marks]
    metrics.update(metrics_seconds=round(time.perf_counter() - start, 2),
                   config=deep_merge(made["config"], {"seed": settings["seed"], "prm": prm}),
                   versions=made.get("versions"))
    records.write_json(metrics_path, metrics)
    ranked_metrics = metrics["evaluation"].get(ranked) or {}
    log.info("prm metrics: %s, gate %s; %s AUROC %s, Pearson %s -> %s", metrics["status"], metrics["gate"]["status"],
             ranked, ranked_metrics.get("auroc"), ranked_metrics.get("pearson"), metrics_path)
    return metrics
