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
    cross-validation over the train side's instances ``(game, experiment, game_id)`` picks the candidate that ranks
    the held folds' siblings best (:func:`choose_value`: pairwise accuracy, then top-1 regret, then the held-fold
    loss, the fitted loss without the ridge term; the loss alone where the held folds hold no pair to rank). The
    validity head's ridge strength is chosen over its answers' instances by held-fold AUROC of the verdicts
    (:func:`choose_validity_l2`), and in each fold the validity head is refitted without the held fold's instances.
    A choice at either end of a grid of three or more is a warning (:func:`grid_edge_marks`). The held-out states
    (validation split) and the test split never enter. The figures (the criterion, every candidate's held-fold loss,
    pairwise accuracy and regret) go to the folder's config and to metrics.json.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from clemprm import stats
from clemprm.checks.run_time import MARKS_KEY, warning_mark
from clemprm.models.loader import load_tokenizer_and_model
from clemprm.models.prm import ProbeScorer
from clemprm.models.probe import (LinearProbe, ProbeFeatures, ProbeHead, adapter_sha256,
                                  combined_logits, policy_model_config)
from clemprm.stages.prm_metrics import indices_by_state, sibling_statistics

log = logging.getLogger(__name__)

MIN_STD = 1e-6   # a feature (nearly) constant on the fitting data is centred, not scaled up
RANKING, AUROC, LOSS = "pairwise_accuracy", "auroc", "loss"   # what a choice was made by (metrics.json `criterion`)
EDGE_CONDITION = "probe_choice_at_grid_edge"   # the warning of a choice at either end of prm.probe.l2


@dataclass
class FitData:
    """Examples as tensors: features ``[n, d]``, labels, state index (siblings share it), pair weights, and each
    example's instance key and multiplicity (how many of its state's samples it is: the ranking weighs by it)."""

    features: object
    labels: object
    groups: object
    weights: object
    keys: list
    multiplicities: list

    @classmethod
    def of(cls, examples: list, features, weights: dict[int, float] | None = None) -> "FitData":
        import torch

        state = {}
        for index, group in enumerate(indices_by_state(examples)):
            state.update(dict.fromkeys(group, index))
        return cls(features, torch.tensor([e.label for e in examples], dtype=torch.float32),
                   torch.tensor([state[i] for i in range(len(examples))]),
                   torch.tensor([weights[e.row] if weights else 1.0 for e in examples], dtype=torch.float32),
                   [e.key for e in examples], [e.multiplicity for e in examples])

    def subset(self, rows: list[int]) -> "FitData":
        return FitData(self.features[rows], self.labels[rows], self.groups[rows], self.weights[rows],
                       [self.keys[i] for i in rows], [self.multiplicities[i] for i in rows])


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


def _ranking_sums(scores: list[float], data: FitData) -> tuple[float, int, float, int]:
    """Concordant sibling pairs, pairs with different labels and top-1 regret summed over the states of ``data`` with
    two or more siblings, and those states' number (:func:`sibling_statistics`, siblings weighed by multiplicity, as
    the ``prm_metrics`` stage measures them)."""
    labels, states = data.labels.tolist(), collections.defaultdict(list)
    for i, state in enumerate(data.groups.tolist()):
        states[state].append(i)
    concordant, pairs, regret, counted = 0.0, 0, 0.0, 0
    for group in [group for group in states.values() if len(group) > 1]:
        c, p, r = sibling_statistics([scores[i] for i in group], [labels[i] for i in group],
                                     [data.multiplicities[i] for i in group])
        concordant, pairs, regret, counted = concordant + c, pairs + p, regret + r, counted + 1
    return concordant, pairs, regret, counted


def _held_out_loss(objective, logits, data: FitData) -> float:
    import torch

    with torch.no_grad():
        return float(objective(logits, data.labels, data.groups, data.weights)) * len(data.labels)


def _fold_splits(data: FitData, folds: int, seed: int) -> list[tuple[FitData, FitData]]:
    """``(held, fitted)`` of each of ``folds`` folds over the instances of ``data`` (:func:`instance_folds`); none
    where its instances make a single fold."""
    fold_of = instance_folds(data.keys, folds, seed)
    if max(fold_of, default=0) < 1:
        return []
    return [(data.subset([i for i, f in enumerate(fold_of) if f == fold]),
             data.subset([i for i, f in enumerate(fold_of) if f != fold])) for fold in range(max(fold_of) + 1)]


def ranking_criterion(table: list[dict]) -> str:
    """What a value head's candidates are chosen by (:func:`choose_value`): their held-fold within-state ranking,
    or their held-fold loss where the held folds hold no sibling pair with different labels (nothing to rank)."""
    return RANKING if any(row["cv_pairs"] for row in table) else LOSS


def choose_value(table: list[dict]) -> dict:
    """The row of ``table`` (:func:`_cross_validate`) a value head is fitted with: the highest held-fold pairwise
    accuracy, ties broken by the lower top-1 regret, then by the lower loss (ties exact on the figures as recorded,
    so metrics.json shows why; then the first in the grid's order). A search ranks siblings, and the held-fold loss
    does not measure that: it is dominated by each game's base rate and punishes confident logits, so it chose the
    grid's strongest ridge on every seed of the learning benchmark (issue 63). Without held-fold pairs, the lowest
    loss (:func:`ranking_criterion`)."""
    if ranking_criterion(table) == LOSS:
        return min(table, key=lambda row: row["cv_loss"])
    return min(table, key=lambda row: (-row["cv_pairwise_accuracy"], row["cv_top1_regret"], row["cv_loss"]))


def validity_criterion(table: list[dict]) -> str:
    """What a validity head's ridge strength is chosen by (:func:`choose_validity_l2`): its held-fold AUROC of the
    game's verdicts, or its held-fold loss where no held fold holds both verdicts."""
    return AUROC if any(row["cv_auroc"] is not None for row in table) else LOSS


def choose_l2(data: FitData, l2s: list[float], objective, folds: int, seed: int,
              intercept: bool = True) -> tuple[float, list[dict]]:
    """The ridge strength of ``l2s`` of a value head on ``data`` (soft labels with siblings) by
    :func:`choose_value` over folds by instance, and every candidate's figures (its criterion:
    :func:`ranking_criterion` of them); the first candidate when there is one or the data has a single instance.
    Each fold's head is fitted as the final one will be: with a bias or, ``intercept`` false, without."""
    table = _cross_validate(data, None, None, [(l2, "value") for l2 in l2s], objective, None, seed, folds,
                            intercept)
    if not table:
        return l2s[0], []
    return choose_value(table)["l2"], [{k: v for k, v in row.items() if k not in ("candidate", "combination")}
                                       for row in table]


def choose_validity_l2(data: FitData, l2s: list[float], objective, folds: int,
                       seed: int) -> tuple[float, list[dict]]:
    """The ridge strength of ``l2s`` of the validity head on ``data`` (answers labelled by the game's verdict; no
    siblings, nothing to rank) with the highest held-fold AUROC of the verdicts (the mean over the folds that hold
    both; ties exact on the figures as recorded, broken by the lower loss), or the lowest held-fold loss where no fold
    holds both (:func:`validity_criterion`); and every candidate's figures. The first candidate when there is one
    or the data has a single instance."""
    splits = _fold_splits(data, folds, seed) if len(l2s) > 1 else []
    if not splits:
        return l2s[0], []
    table = []
    for l2 in l2s:
        loss, aurocs = 0.0, []
        for held, fitted in splits:
            logits = fit_linear(fitted, l2, objective).logits(held.features)
            loss += _held_out_loss(objective, logits, held)
            aurocs.append(stats.auroc(logits.tolist(), held.labels.tolist()))
        measured = [value for value in aurocs if value is not None]
        table.append({"l2": l2, "cv_loss": round(loss / len(data.labels), 6),
                      "cv_auroc": round(sum(measured) / len(measured), 4) if measured else None,
                      "cv_auroc_folds": len(measured)})
    if validity_criterion(table) == LOSS:
        return min(table, key=lambda row: row["cv_loss"])["l2"], table
    return min(table, key=lambda row: (-row["cv_auroc"], row["cv_loss"]))["l2"], table


def grid_edge_marks(head: str, l2: float, grid: list[float], criterion: str) -> list[dict]:
    """A warning (:func:`warning_mark`, as a dict for metrics.json) when cross-validation chose ``l2`` of the ``head``
    (which head: "the probe's value head") at either end of a ``grid`` of three or more values: the best value may lie
    beyond it, so the grid should be widened."""
    values = sorted(set(grid))
    if len(values) < 3 or l2 not in (values[0], values[-1]):
        return []
    end = "smallest" if l2 == values[0] else "largest"
    return [warning_mark("prm_adapter", f"{head} chose l2 {l2} by {criterion}, the {end} of "
                                        f"prm.probe.l2 {values}: a better one may lie beyond it (widen the grid)",
                         condition=EDGE_CONDITION, count=len(values)).as_dict()]


def fit_probe(features: ProbeFeatures, prm: dict, seed: int, train: list, verdicts: list, weights: dict[int, float],
              loss_fn) -> tuple[ProbeScorer, dict]:
    """Fit the probe's heads on ``train`` (soft-label examples of the train side, pair ``weights`` by row) and
    ``verdicts`` (answers labelled by the game's verdict; may be empty), choosing ``prm.probe``'s candidates by
    cross-validation over train instances; return the scorer and the metrics' training part (``probe``: the choices,
    their criteria and figures; :data:`MARKS_KEY`: a warning for each choice at the edge of its grid)."""
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
              "folds": settings["folds"]}
    verdict_data, report["validity"], marks = _validity_choice(features, verdicts, settings, validity_objective,
                                                               seed)
    validity_l2 = report["validity"]["l2"] if verdict_data is not None else None
    combinations = [c for c in settings["combination"] if c == "value" or verdict_data is not None] or ["value"]
    candidates = [(l2, combination) for l2 in settings["l2"] for combination in combinations]
    table = _cross_validate(data, verdict_data, validity_l2, candidates, value_objective, validity_objective, seed,
                            settings["folds"])
    chosen = choose_value(table) if table else {}
    l2, combination = chosen.get("candidate", candidates[0])
    criterion = ranking_criterion(table) if table else None
    if table:
        marks += grid_edge_marks("the probe's value head", l2, settings["l2"], criterion)
    # the validity head is kept where fitted, also when the score is the value head's alone: its verdicts are
    # measured on their own (metrics.json `acceptance`)
    head = ProbeHead(fit_linear(data, l2, value_objective),
                     fit_linear(verdict_data, validity_l2, validity_objective) if verdict_data is not None else None,
                     combination)
    with torch.no_grad():
        train_loss = float(value_objective(head.logits(data.features), data.labels, data.groups, data.weights))
    report.update(l2=l2, combination=combination, criterion=criterion,
                  cv=[{k: v for k, v in row.items() if k != "candidate"} for row in table])
    log.info("prm probe: %d features of %d train pairs in %.0f s; l2 %s, combination %s by %s (cv pairwise accuracy "
             "%s, top-1 regret %s, loss %s); train loss %.4f", report["features"], len(train), feature_seconds, l2,
             combination, criterion, chosen.get("cv_pairwise_accuracy"), chosen.get("cv_top1_regret"),
             chosen.get("cv_loss"), train_loss)
    if criterion == LOSS:
        log.warning("prm probe: the held folds hold no sibling pair with different labels: l2 and combination chosen "
                    "by held-fold loss, not by ranking")
    scorer = ProbeScorer(features, head, input=prm["input"], max_length=prm["max_length"])
    return scorer, {"status": "trained", "train_loss": round(train_loss, 6),
                    "train_seconds": round(time.perf_counter() - start, 2), "probe": report, MARKS_KEY: marks}


def _validity_choice(features: ProbeFeatures, verdicts: list, settings: dict, objective,
                     seed: int) -> tuple[FitData | None, dict | None, list[dict]]:
    """The validity head's data (None without answers of both verdicts), its report entry (None without answers)
    and the warning of a ridge strength chosen at the grid's edge."""
    if not verdicts:
        return None, None, []
    if len({e.label for e in verdicts}) < 2:
        return None, {"examples": len(verdicts), "skipped": "the answers carry one verdict only"}, []
    data = FitData.of(verdicts, features.of([e.input_ids for e in verdicts]))
    l2, table = choose_validity_l2(data, settings["l2"], objective, settings["folds"], seed)
    criterion = validity_criterion(table) if table else None
    entry = {"examples": len(verdicts), "accepted": int(data.labels.sum()), "l2": l2, "criterion": criterion,
             "cv": table}
    return data, entry, grid_edge_marks("the probe's validity head", l2, settings["l2"], criterion) if table else []


def _cross_validate(data: FitData, verdicts: FitData | None, validity_l2: float | None, candidates: list[tuple],
                    value_objective, validity_objective, seed: int, folds: int,
                    intercept: bool = True) -> list[dict]:
    """Held-fold loss, within-state pairwise accuracy and top-1 regret (:func:`_ranking_sums`) of every
    ``(l2, combination)`` candidate over folds of the train instances (none with one candidate or one instance):
    the value head fitted on the other folds, the validity head (ridge ``validity_l2``) on the verdicts of the other
    folds' and of no train side's instances."""
    splits = _fold_splits(data, folds, seed) if len(candidates) > 1 else []
    if not splits:
        return []
    sums = {candidate: [0.0, 0.0, 0, 0.0, 0] for candidate in candidates}   # loss, concordant, pairs, regret, states
    for held, fitted in splits:
        validity = None
        if verdicts is not None:
            held_keys = set(held.keys)
            validity = fit_linear(verdicts.subset([i for i, key in enumerate(verdicts.keys) if key not in held_keys]),
                                  validity_l2, validity_objective).logits(held.features)
        for l2 in sorted({l2 for l2, _ in candidates}):
            value = fit_linear(fitted, l2, value_objective, intercept).logits(held.features)
            for candidate in [c for c in candidates if c[0] == l2]:
                logits = combined_logits(value, validity, candidate[1])
                figures = (_held_out_loss(value_objective, logits, held), *_ranking_sums(logits.tolist(), held))
                sums[candidate] = [total + figure for total, figure in zip(sums[candidate], figures)]
    return [{"candidate": candidate, "l2": candidate[0], "combination": candidate[1],
             "cv_loss": round(loss / len(data.labels), 6),
             "cv_pairwise_accuracy": round(concordant / pairs, 4) if pairs else None,
             "cv_top1_regret": round(regret / states, 4) if states else None, "cv_pairs": pairs, "cv_states": states}
            for candidate, (loss, concordant, pairs, regret, states) in sums.items()]


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
