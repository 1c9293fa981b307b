"""Fitting a probe PRM (``prm.kind: probe``, :mod:`clemprm.models.probe`) in the ``prm_adapter`` stage
(:func:`clemprm.stages.prm.train_prm` reads the data, calls :func:`fit_probe`, scores every side with the scorer it
returns as with a LoRA PRM, for rule ``prm_metrics`` to measure, and writes the folder with :func:`write_probe`).

Heads
    Linear, on features standardised by the data each head is fitted on, fitted full-batch (L-BFGS) on the LoRA
    PRM's loss (:func:`clemprm.stages.prm.prm_loss`, passed in: that module imports this one) plus
    ``l2 x |weight|^2``: the value head on the soft labels of the train side (BCE or MSE, the pairwise term among
    siblings with ``prm.pairwise_weight``, the pair weights of ``prm.label_weighting``), the validity head (with
    ``prm.acceptance_examples`` > 0) on answers of the played train episodes labelled by the game's verdict (BCE).

Choices, on train instances only
    ``prm.probe.l2`` and ``prm.probe.combination`` list candidates; with more than one, ``prm.probe.folds``-fold
    cross-validation over the train side's instances ``(game, experiment, game_id)`` picks the candidate with the
    lowest held-fold loss (the fitted loss without the ridge term); the validity head's ridge strength is chosen the
    same way over its answers' instances, and in each fold the validity head is refitted without the held fold's
    instances. The held-out states (validation split) and the test split never enter. The figures (every
    candidate's held-fold loss and within-state pairwise accuracy) go to the folder's config and to metrics.json.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from clemprm.models.loader import load_tokenizer_and_model
from clemprm.models.prm import ProbeScorer
from clemprm.models.probe import (LinearProbe, ProbeFeatures, ProbeHead, adapter_sha256,
                                  combined_logits, policy_model_config)
from clemprm.stages.prm_metrics import indices_by_state, sibling_statistics

log = logging.getLogger(__name__)

MIN_STD = 1e-6   # a feature (nearly) constant on the fitting data is centred, not scaled up


@dataclass
class FitData:
    """Examples as tensors: features ``[n, d]``, labels, state index (siblings share it), pair weights, and each
    example's instance key."""

    features: object
    labels: object
    groups: object
    weights: object
    keys: list

    @classmethod
    def of(cls, examples: list, features, weights: dict[int, float] | None = None) -> "FitData":
        import torch

        state = {}
        for index, group in enumerate(indices_by_state(examples)):
            state.update(dict.fromkeys(group, index))
        return cls(features, torch.tensor([e.label for e in examples], dtype=torch.float32),
                   torch.tensor([state[i] for i in range(len(examples))]),
                   torch.tensor([weights[e.row] if weights else 1.0 for e in examples], dtype=torch.float32),
                   [e.key for e in examples])

    def subset(self, rows: list[int]) -> "FitData":
        return FitData(self.features[rows], self.labels[rows], self.groups[rows], self.weights[rows],
                       [self.keys[i] for i in rows])


def policy_features(model_settings: dict, prm: dict, sft_adapter: str | None, cache_dir: str | None) -> ProbeFeatures:
    """The frozen policy (``model.spec`` + ``sft_adapter``) as the probe's feature reader, remembering features."""
    cfg = policy_model_config(model_settings, prm, sft_adapter, cache_dir)
    tokenizer, model = load_tokenizer_and_model(cfg, for_training=False)
    return ProbeFeatures(cfg, tokenizer, model, prm["probe"]["layers"], prm["probe"]["window"],
                         prm["score_batch_tokens"], cache=True)


def instance_folds(keys: list, folds: int, seed: int) -> list[int]:
    """The fold of each key: the distinct instances in an order drawn by ``seed``, dealt to ``min(folds, instances)``
    folds in turn (siblings and every turn of an instance stay in one fold)."""
    instances = sorted(set(keys))
    random.Random(seed).shuffle(instances)
    fold = {key: i % max(1, min(folds, len(instances))) for i, key in enumerate(instances)}
    return [fold[key] for key in keys]


def fit_linear(data: FitData, l2: float, objective, intercept: bool = True) -> LinearProbe:
    """A :class:`LinearProbe` minimising ``objective(logits, labels, groups, weights) + l2 x |weight|^2`` on ``data``
    (features standardised by their own mean and standard deviation), full batch, L-BFGS from zero. Without
    ``intercept`` the features are scaled, not centred, and the bias stays 0: a head with no bias term (the LoRA
    PRM's score head) holds the probe exactly."""
    import torch

    std = data.features.std(0, unbiased=False)
    std = torch.where(std > MIN_STD, std, torch.ones_like(std))
    mean = data.features.mean(0) if intercept else torch.zeros_like(std)
    standardised = (data.features - mean) / std
    weight = torch.zeros(standardised.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=intercept)
    optimizer = torch.optim.LBFGS([weight, bias] if intercept else [weight], lr=1.0, max_iter=500,
                                  tolerance_grad=1e-7, tolerance_change=1e-10, history_size=20,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = objective(standardised @ weight + bias, data.labels, data.groups, data.weights) \
            + l2 * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return LinearProbe(mean, std, weight.detach(), bias.detach())


def _pairwise(scores: list[float], data: FitData) -> tuple[float, int]:
    """Concordant sibling pairs and pairs with different labels of ``data`` (:func:`sibling_statistics`)."""
    concordant, pairs = 0.0, 0
    labels, states = data.labels.tolist(), collections.defaultdict(list)
    for i, state in enumerate(data.groups.tolist()):
        states[state].append(i)
    for group in states.values():
        if len(group) > 1:
            c, p, _ = sibling_statistics([scores[i] for i in group], [labels[i] for i in group])
            concordant, pairs = concordant + c, pairs + p
    return concordant, pairs


def _held_out_loss(objective, logits, data: FitData) -> float:
    import torch

    with torch.no_grad():
        return float(objective(logits, data.labels, data.groups, data.weights)) * len(data.labels)


def choose_l2(data: FitData, l2s: list[float], objective, folds: int, seed: int) -> tuple[float, list[dict]]:
    """The ridge strength of ``l2s`` with the lowest cross-validated loss on ``data`` (folds by instance), and every
    candidate's figures; the first candidate when there is one or the data has a single instance."""
    fold_of = instance_folds(data.keys, folds, seed)
    n_folds = max(fold_of, default=0) + 1
    if len(l2s) == 1 or n_folds < 2:
        return l2s[0], []
    table = []
    for l2 in l2s:
        loss = 0.0
        for fold in range(n_folds):
            held = data.subset([i for i, f in enumerate(fold_of) if f == fold])
            head = fit_linear(data.subset([i for i, f in enumerate(fold_of) if f != fold]), l2, objective)
            loss += _held_out_loss(objective, head.logits(held.features), held)
        table.append({"l2": l2, "cv_loss": round(loss / len(fold_of), 6)})
    return min(table, key=lambda row: row["cv_loss"])["l2"], table


def fit_probe(features: ProbeFeatures, prm: dict, seed: int, train: list, verdicts: list, weights: dict[int, float],
              loss_fn) -> tuple[ProbeScorer, dict]:
    """Fit the probe's heads on ``train`` (soft-label examples of the train side, pair ``weights`` by row) and
    ``verdicts`` (answers labelled by the game's verdict; may be empty), choosing ``prm.probe``'s candidates by
    cross-validation over train instances; return the scorer and the metrics' training part (``probe``: the choices
    and their figures)."""
    import torch

    start = time.perf_counter()
    settings = prm["probe"]

    def value_objective(logits, labels, groups, pair_weights):
        return loss_fn(logits, labels, groups, prm["loss"], prm["pairwise_weight"], pair_weights)

    def validity_objective(logits, labels, groups, pair_weights):
        return loss_fn(logits, labels, groups, "bce", 0.0, None)

    data = FitData.of(train, features.of([e.input_ids for e in train], [e.state_id for e in train]), weights)
    feature_seconds = time.perf_counter() - start
    report = {"kind": "probe", "layers": features.layers, "window": features.window,
              "features": int(data.features.shape[1]), "feature_seconds": round(feature_seconds, 2),
              "folds": settings["folds"], "validity": None}
    verdict_data = None
    if verdicts and len({e.label for e in verdicts}) == 2:
        verdict_data = FitData.of(verdicts, features.of([e.input_ids for e in verdicts]))
        l2_valid, table = choose_l2(verdict_data, settings["l2"], validity_objective, settings["folds"], seed)
        report["validity"] = {"examples": len(verdicts), "accepted": int(verdict_data.labels.sum()),
                              "l2": l2_valid, "cv": table}
    elif verdicts:
        report["validity"] = {"examples": len(verdicts), "skipped": "the answers carry one verdict only"}
    combinations = [c for c in settings["combination"] if c == "value" or verdict_data is not None] or ["value"]
    candidates = [(l2, combination) for l2 in settings["l2"] for combination in combinations]
    table = _cross_validate(data, verdict_data, report, candidates, value_objective, validity_objective, seed,
                            settings["folds"])
    l2, combination = (min(table, key=lambda row: row["cv_loss"])["candidate"] if table else candidates[0])
    head = ProbeHead(fit_linear(data, l2, value_objective),
                     fit_linear(verdict_data, report["validity"]["l2"], validity_objective)
                     if combination == "product" else None, combination)
    with torch.no_grad():
        train_loss = float(value_objective(head.logits(data.features), data.labels, data.groups, data.weights))
    report.update(l2=l2, combination=combination, cv=[{k: v for k, v in row.items() if k != "candidate"}
                                                      for row in table])
    chosen = next((row for row in table if row["candidate"] == (l2, combination)), {})
    log.info("prm probe: %d features of %d train pairs in %.0f s; l2 %s, combination %s (cv loss %s, pairwise "
             "accuracy %s); train loss %.4f", report["features"], len(train), feature_seconds, l2, combination,
             chosen.get("cv_loss"), chosen.get("cv_pairwise_accuracy"), train_loss)
    scorer = ProbeScorer(features, head, input=prm["input"], max_length=prm["max_length"])
    return scorer, {"status": "trained", "train_loss": round(train_loss, 6),
                    "train_seconds": round(time.perf_counter() - start, 2), "probe": report}


def _cross_validate(data: FitData, verdicts: FitData | None, report: dict, candidates: list[tuple], value_objective,
                    validity_objective, seed: int, folds: int) -> list[dict]:
    """Held-fold loss and within-state pairwise accuracy of every ``(l2, combination)`` candidate over folds of the
    train instances (none with one candidate or one instance): the value head fitted on the other folds, the
    validity head on the verdicts of the other folds' and of no train side's instances."""
    fold_of = instance_folds(data.keys, folds, seed)
    n_folds = max(fold_of, default=0) + 1
    if len(candidates) == 1 or n_folds < 2:
        return []
    sums = {candidate: [0.0, 0.0, 0] for candidate in candidates}   # loss, concordant, pairs
    for fold in range(n_folds):
        held = data.subset([i for i, f in enumerate(fold_of) if f == fold])
        fitted = data.subset([i for i, f in enumerate(fold_of) if f != fold])
        validity = None
        if verdicts is not None:
            held_keys = set(held.keys)
            validity = fit_linear(verdicts.subset([i for i, key in enumerate(verdicts.keys) if key not in held_keys]),
                                  report["validity"]["l2"], validity_objective).logits(held.features)
        for l2 in sorted({l2 for l2, _ in candidates}):
            value = fit_linear(fitted, l2, value_objective).logits(held.features)
            for candidate in [c for c in candidates if c[0] == l2]:
                logits = combined_logits(value, validity, candidate[1])
                concordant, pairs = _pairwise(logits.tolist(), held)
                entry = sums[candidate]
                entry[0] += _held_out_loss(value_objective, logits, held)
                entry[1] += concordant
                entry[2] += pairs
    return [{"candidate": candidate, "l2": candidate[0], "combination": candidate[1],
             "cv_loss": round(loss / len(fold_of), 6),
             "cv_pairwise_accuracy": round(concordant / pairs, 4) if pairs else None, "cv_pairs": pairs}
            for candidate, (loss, concordant, pairs) in sums.items()]


def untrained_probe(features: ProbeFeatures, prm: dict) -> ProbeScorer:
    """A probe whose value head is zero (every score 0.5): what a stage with no training examples writes, so that the
    later stages still run (the metrics say so)."""
    import torch

    hidden = features.model.config.get_text_config().hidden_size
    width = 2 * len(features.layers) * hidden
    head = ProbeHead(LinearProbe(torch.zeros(width), torch.ones(width), torch.zeros(width), torch.zeros(1)))
    return ProbeScorer(features, head, input=prm["input"], max_length=prm["max_length"])


def write_probe(scorer: ProbeScorer, adapter_dir: str | Path, report: dict | None, sft_adapter: str | None) -> None:
    """The probe folder (:mod:`clemprm.models.probe`): the heads, and a config naming the policy they read (with the
    SFT adapter's SHA-256), the text's input and length, and ``report`` (the choices and their figures)."""
    features = scorer.features
    config = {**(report or {}), "kind": "probe", "layers": features.layers, "window": features.window,
              "input": scorer.input, "max_length": scorer.max_length,
              "policy": {"spec": features.cfg.spec, "sft_adapter": sft_adapter,
                         "sft_adapter_sha256": adapter_sha256(sft_adapter)}}
    scorer.head.save(adapter_dir, config)
