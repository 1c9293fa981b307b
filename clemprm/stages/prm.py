"""The ``prm_adapter`` stage: train the process reward model (:mod:`clemprm.models.prm` scores with it) on soft labels.

Training
    Soft labels (``results/labels/soft_labels.parquet``, :data:`clemprm.records.SOFT_LABELS`), one example per
    branch point, read as ``prm.input`` says: the prefix and the candidate (the PRM card's input, what a blind search
    can show), or also the game's reply to the candidate (``candidate_with_reply``: for lookahead searches only).
    Training may use everything known at labelling time, inference only what its regime shows. A
    ``transformers.Trainer`` whose loss is BCE with logits on the squeezed logit (``prm.loss: mse``: squared error of
    ``sigmoid(logit)``), plus, with ``prm.pairwise_weight`` > 0, that weight times a logistic
    pairwise loss among siblings (:func:`pairwise_loss`; the siblings of a state then share a micro-batch and
    ``batch_size`` counts states), linear schedule with warmup, effective batch ``batch_size x grad_accum``,
    at most ``prm.epochs`` epochs with early stopping on a held-out slice of *instances*
    ``(game, experiment, game_id)``; the best epoch's adapter is the one written. ``prm.max_examples`` samples
    whole sibling groups, so that no state loses some of its siblings. CUDA: bf16, gradient
    checkpointing, paged 8-bit AdamW; CPU: fp32, ``adamw_torch``.

A probe PRM (``prm.kind: probe``)
    The same data, split, loss, evaluation, gate and metrics; instead of a LoRA classifier, linear heads on the
    frozen SFT policy's hidden states, fitted and chosen on train instances by :mod:`clemprm.stages.probe` (with
    ``prm.acceptance_examples`` > 0, a validity head on the answers records instead of the pre-training below).

Acceptance pre-training (``prm.acceptance_examples`` > 0)
    Before the soft labels, one epoch on up to that many answers the pipeline played anyway (the answers records,
    :mod:`clemprm.stages.answers`: base rollouts, SFT-policy trajectories, siblings and label continuations, train
    split only), each labelled by the game's verdict on it (1: the game accepted the answer, 0: it counted a rule
    violation), as many accepted as rejected where the records have them. The verdict is a function of the prompt
    and the answer (each game states its answer format and rules in its prompt), known for free on every turn,
    while Monte-Carlo soft labels cost K continuations each: a blind PRM learns the rules' validity from far more
    examples than the labelled pairs, then what wins from the soft labels.
    Held-out (validation-split) instances never enter it.

Metrics
    On every side, from the written model through the scorer, with the baselines (:mod:`clemprm.stages.prm_metrics`):
    global prediction metrics, and on the ranked side the within-state ranking among siblings with bootstrap
    intervals over instances (``prm.bootstrap_samples``, ``prm.ci``), next to the candidate's length, the policy's
    log-probability, a random pick, the game's acceptance of the candidate (what a blind scorer gets if it knows only
    the rules' validity verdict) and the lookahead rule (:func:`clemprm.play.engine.rule_score`: what a fork shows,
    read with no model). The ranked side is
    ``heldout``, the branch points of validation-split instances (``branch_points.validation_instances``), which
    neither training nor the choice of epoch sees; without them it is the ``validation`` slice of train instances
    (``prm.validation_fraction``), which also chose the epoch.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from clemprm import distributed, records
from clemprm.models.generation import load_policy
from clemprm.models.loader import load_tokenizer_and_model, policy_settings, resolve_dtype, resolve_quantization
from clemprm.models.logprob import mean_logprobs
from clemprm.models.prm import PRMScorer, encode_pair, prm_model_config
from clemprm.models.scoring import logits_sharing_prefixes, pad_right, prefix_sharing_problem
from clemprm.modes import PRM_INPUT_REGIMES
from clemprm.play.engine import rule_score
from clemprm.checks.run_time import StageFailure, fail_or_warn, marks_metadata
from clemprm.stages import probe
from clemprm.stages.prm_metrics import (baseline_metrics, gate_lines, indices_by_state, orientation, prediction_metrics,
                                        quality_gate, rank_metrics, ranking_metrics, states_with_siblings,
                                        verdict_metrics)
from clemprm.model_card import write_adapter_card
from clemprm.tracking import OFF, TrackingRun, tracker_environment
from clemprm.training import (OPTIMIZER_AUTO, applied_learning_rates, changed_parameters, device_name, epoch_history,
                              finish_metrics, finite, initial_evaluation, keep_4bit_differentiable, lora_config,
                              progress_callback, shared_scratch_beside, split_instances, step_grouped,
                              trainable_snapshot, trainer_arguments, untrained_reason, write_adapter)

log = logging.getLogger(__name__)

LOSSES = ("bce", "mse")
# ---------------------------------------------------------------------------------------------- data


@dataclass
class Example:
    """One branch point: the encoded pair, its soft label and its instance ``(game, experiment, game_id)``."""

    input_ids: list[int]
    truncated: bool
    label: float
    key: tuple[str, str, str]
    state_id: str = ""       # the state the candidate answers (its row's prefix_id): siblings share it
    row: int = -1            # index of its soft-label row
    multiplicity: int = 1    # how many of its state's sampled answers it is (the ranking metrics weigh by it)


def read_labels(path: str | Path) -> list[dict]:
    """The soft-label rows; an unreadable file, a label outside [0, 1] or a multiplicity below 1 is an error naming
    the file."""
    rows = records.read_records(path, records.SOFT_LABELS)
    for i, row in enumerate(rows):
        label = row["label"]
        if label is None or not 0.0 <= label <= 1.0:   # NaN fails both comparisons
            raise records.RecordFileError(f"record file {path}, row {i} ({row['bp_id']}): label {label!r} is not "
                                          f"in [0, 1]")
        if row["multiplicity"] is None or row["multiplicity"] < 1:
            raise records.RecordFileError(f"record file {path}, row {i} ({row['bp_id']}): multiplicity "
                                          f"{row['multiplicity']!r} is not a count of at least 1")
    return rows


def sibling_groups(examples: list[Example]) -> list[list[Example]]:
    """The examples grouped by ``state_id`` (siblings), groups in order of first appearance."""
    return [[examples[i] for i in group] for group in indices_by_state(examples)]


def sample_whole_groups(examples: list[Example], limit: int | None, seed: int) -> list[Example]:
    """At most ``limit`` examples (all when None) made of whole sibling groups: the groups in an order drawn by
    ``seed``, each taken while it fits (a pair-wise draw would split states and lose the pairs the ranking metrics
    and the pairwise loss compare)."""
    if limit is None or len(examples) <= limit:
        return examples
    groups = sibling_groups(examples)
    chosen, total = [], 0
    for group in random.Random(seed).sample(groups, len(groups)):
        if total + len(group) <= limit:
            chosen.extend(group)
            total += len(group)
    return chosen


def build_examples(rows: list[dict], tokenizer, chat_template_kwargs: dict, max_length: int,
                   prm_input: str = "candidate") -> list[Example]:
    """One example per soft-label row, its text as ``prm_input`` reads it (the game's reply only for
    ``candidate_with_reply``)."""
    reads_reply = prm_input == "candidate_with_reply"
    return [Example(*encode_pair(tokenizer, row["prefix"], row["candidate"], row["reply"] if reads_reply else "",
                                 chat_template_kwargs, max_length),
                    label=float(row["label"]),
                    key=records.instance_key(row["game"], row["experiment"], row["game_id"]),
                    state_id=row.get("prefix_id") or row["bp_id"],
                    row=index, multiplicity=row["multiplicity"]) for index, row in enumerate(rows)]


def acceptance_examples(answers_path: str, tokenizer, chat_template_kwargs: dict, max_length: int, limit: int,
                        seed: int) -> list[Example]:
    """Up to ``limit`` answers of the answers records (:data:`records.ANSWERS`, train split only: one row per
    distinct answer played in the run) as examples labelled by the game's verdict (``parse_ok``: 1 accepted,
    0 rejected), drawn by ``seed`` with as many of each verdict as the records allow; read as a PRM that reads the
    candidate alone reads them."""
    answers = records.read_records(answers_path, records.ANSWERS, splits=records.TRAIN_SPLITS)
    by_verdict = {verdict: [row for row in answers if row["parse_ok"] == verdict] for verdict in (True, False)}
    rng = random.Random(seed)
    for group in by_verdict.values():
        rng.shuffle(group)
    half = limit // 2
    rejected = by_verdict[False][:max(half, limit - len(by_verdict[True]))]
    chosen = by_verdict[True][:limit - len(rejected)] + rejected
    return [Example(*encode_pair(tokenizer, row["messages"], row["response"], "", chat_template_kwargs, max_length),
                    label=float(row["parse_ok"]), key=records.instance_key(row["game"], row["experiment"],
                                                                           row["game_id"]),
                    state_id=f"acceptance/{index}", row=-1 - index)
            for index, row in enumerate(chosen)]


# ------------------------------------------------------------------------------------------ training


def effective_grad_accum(batch_size: int, grad_accum: int, n_train: int) -> int:
    """``grad_accum``, capped at the batches of one epoch so that every epoch makes at least one optimizer step (a
    multiple of the job's processes, which share the accumulation: :func:`clemprm.training.trainer_arguments`). A
    ``grad_accum`` that is no multiple of the processes is refused, as SFT refuses it: raising it silently would
    change the effective batch."""
    distributed.accumulation_steps(grad_accum, "prm.grad_accum")   # raises, naming the key
    processes = distributed.world_size()
    capped = min(grad_accum, math.ceil(n_train / batch_size))
    return max(processes, capped - capped % processes)


def _training_args(prm: dict, seed: int, output_dir: str, device: str, dtype, grad_accum: int,
                   has_validation: bool, tracking: TrackingRun):
    from transformers import TrainingArguments

    return TrainingArguments(
        **trainer_arguments(prm, key="prm", seed=seed, output_dir=output_dir, device=device, dtype=dtype,
                            grad_accum=grad_accum, has_validation=has_validation, optimizer=OPTIMIZER_AUTO[device],
                            gradient_checkpointing=device == "cuda", weight_decay=0.0, tracking=tracking),
        label_names=["labels"], remove_unused_columns=False)


def pairwise_loss(logits, labels, groups):
    """The logistic pairwise loss among siblings: over every pair of one group (``groups``: a state's index per
    row) whose labels differ, ``softplus(-(logit_higher - logit_lower))`` weighted by the label gap (a pair that
    differs by one continuation of K counts 1/K of a win-against-loss pair), averaged over those pairs; 0 when
    the batch has none. Only the ordering of siblings enters, not the level of a state, which BCE fits."""
    import torch.nn.functional as F

    gap = labels.unsqueeze(1) - labels.unsqueeze(0)
    pairs = (groups.unsqueeze(1) == groups.unsqueeze(0)) & (gap > 0)
    if not pairs.any():
        return logits.sum() * 0.0
    margins = logits.unsqueeze(1) - logits.unsqueeze(0)
    return (gap[pairs] * F.softplus(-margins[pairs])).mean()


def prm_loss(logits, labels, groups, loss: str, pairwise_weight: float, weights=None):
    """The training loss of a micro-batch: BCE with logits against the soft labels (``mse``: squared error of the
    sigmoid), a weighted mean when ``weights`` (one per pair, :func:`label_weights`) are given, plus
    ``pairwise_weight`` x :func:`pairwise_loss` among the siblings of ``groups``."""
    import torch
    import torch.nn.functional as F

    labels = labels.float()
    if loss == "mse":
        per_pair = F.mse_loss(logits.sigmoid(), labels, reduction="none")
    else:
        per_pair = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    weights = torch.ones_like(per_pair) if weights is None else weights.float()
    pointwise = (weights * per_pair).sum() / weights.sum()
    if not pairwise_weight:
        return pointwise
    return pointwise + pairwise_weight * pairwise_loss(logits, labels, groups)


def _trainer_class():
    from transformers import Trainer

    class PRMTrainer(Trainer):
        """A Trainer whose loss is :func:`prm_loss` of the one logit. The loss is a micro-batch mean: the Trainer
        divides it by the accumulation steps."""

        loss_is_scaled_for_ga = False

        def __init__(self, *args, loss: str = "bce", pairwise_weight: float = 0.0, share_prefixes: bool = False,
                     pad_id: int = 0, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss = loss
            self.pairwise_weight = pairwise_weight
            self.share_prefixes = share_prefixes
            self.pad_id = pad_id

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels, groups, weights = inputs.pop("labels"), inputs.pop("groups"), inputs.pop("weights")
            if self.share_prefixes:   # a state's siblings (one group) compute their perspective once
                logits = logits_sharing_prefixes(model, inputs["input_ids"], inputs["attention_mask"],
                                                 groups.tolist(), self.pad_id)
                outputs = {"logits": logits}
            else:
                outputs = model(**inputs)
                logits = outputs.logits
            loss = prm_loss(logits.squeeze(-1).float(), labels, groups, self.loss, self.pairwise_weight, weights)
            return (loss, outputs) if return_outputs else loss

    return PRMTrainer


def _collator(pad_id: int):
    """Batches of dataset rows (:func:`_as_dataset`), each one sibling group or one pair, flattened into pairs;
    ``groups`` holds each pair's row in the batch."""
    import torch

    def collate(batch: list[dict]) -> dict:
        sequences = [ids for row in batch for ids in row["input_ids"]]
        input_ids, attention_mask = pad_right(sequences, pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "labels": torch.tensor([label for row in batch for label in row["labels"]], dtype=torch.float32),
                "weights": torch.tensor([weight for row in batch for weight in row["weights"]], dtype=torch.float32),
                "groups": torch.tensor([i for i, row in enumerate(batch) for _ in row["labels"]])}

    return collate


def label_weights(examples: list[Example], weighting: str) -> dict[int, float]:
    """Each example's weight in the pointwise loss, by row: 1 (``none``), or (``balanced``) such that the pairs
    labelled 0 (no continuation won) and the pairs with any win weigh half of the loss each: on skewed labels (most 0)
    a PRM that predicts the base rate everywhere no longer minimises the loss. The weights average to 1."""
    if weighting == "none":
        return {e.row: 1.0 for e in examples}
    positive = sum(e.label > 0 for e in examples)
    counts = {True: positive, False: len(examples) - positive}
    if not all(counts.values()):   # one class only: nothing to balance
        return {e.row: 1.0 for e in examples}
    return {e.row: len(examples) / (2 * counts[e.label > 0]) for e in examples}


def _as_dataset(examples: list[Example], by_state: bool, weights: dict[int, float]):
    """One row per pair, or (``by_state``: the pairwise loss needs a state's siblings in one micro-batch) one row
    per sibling group; ``length`` (its tokens) lets the Trainer group rows of similar lengths."""
    from datasets import Dataset

    groups = sibling_groups(examples) if by_state else [[e] for e in examples]
    return Dataset.from_dict({"input_ids": [[e.input_ids for e in group] for group in groups],
                              "labels": [[e.label for e in group] for group in groups],
                              "weights": [[weights[e.row] for e in group] for group in groups],
                              "length": [sum(len(e.input_ids) for e in group) for group in groups]})


def shares_prefixes(model, by_state: bool) -> bool:
    """Whether training computes a state's perspective once for its siblings: with the siblings in one micro-batch
    (``by_state``), a model whose cache allows it, in one process (DistributedDataParallel takes one forward per
    backward; the shared forward makes two)."""
    if not by_state:
        problem = "no sibling groups"
    elif distributed.world_size() > 1:
        problem = f"{distributed.world_size()} processes"
    else:
        problem = prefix_sharing_problem(model)
    log.info("prm training: %s", f"each pair in full ({problem})" if problem
             else "a state's siblings compute their shared prefix once")
    return problem is None


def _train(model, tokenizer, prm: dict, seed: int, train: list[Example], validation: list[Example], output_dir: str,
           device: str, dtype, tracking: TrackingRun) -> tuple[object, dict]:
    """Train the PEFT model, its curves to the ``tracking`` run (inside :func:`~clemprm.tracking.tracker_environment`);
    return it (the best epoch's weights when there is a validation side) and the training part of the metrics."""
    from transformers import EarlyStoppingCallback, PrinterCallback

    by_state = prm["pairwise_weight"] > 0
    train_rows = len(sibling_groups(train)) if by_state else len(train)
    grad_accum = effective_grad_accum(prm["batch_size"], prm["grad_accum"], train_rows)
    if grad_accum < prm["grad_accum"]:   # a warning: the run trains with a smaller effective batch than configured
        log.warning("prm: %d train %s make %d batches of %d: gradient accumulation capped at %d (of prm.grad_accum "
                    "%d) so that every epoch makes an optimizer step: the effective batch is %d, not %d",
                    train_rows, "states" if by_state else "pairs", math.ceil(train_rows / prm["batch_size"]),
                    prm["batch_size"], grad_accum, prm["grad_accum"], prm["batch_size"] * grad_accum,
                    prm["batch_size"] * prm["grad_accum"])
    args = _training_args(prm, seed, output_dir, device, dtype, grad_accum, has_validation=bool(validation),
                          tracking=tracking)
    callbacks = [progress_callback("prm")]
    if validation:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=prm["early_stopping_patience"]))
    trainer = step_grouped(_trainer_class())(
        model=model, args=args,
        train_dataset=_as_dataset(train, by_state, label_weights(train, prm["label_weighting"])),
        eval_dataset=_as_dataset(validation, by_state, label_weights(validation, "none")) if validation else None,
        data_collator=_collator(tokenizer.pad_token_id), callbacks=callbacks, loss=prm["loss"],
        pairwise_weight=prm["pairwise_weight"], share_prefixes=shares_prefixes(model, by_state),
        pad_id=tokenizer.pad_token_id)
    trainer.remove_callback(PrinterCallback)   # progress goes to the log through LogProgress
    before = trainable_snapshot(trainer.model)
    start = time.perf_counter()
    result = trainer.train()
    train_seconds = time.perf_counter() - start
    state = trainer.state
    rates = applied_learning_rates(trainer.lr_scheduler, state.global_step)
    untrained = untrained_reason(prm, state.global_step, rates, changed_parameters(trainer.model, before), key="prm")
    initial, log_history = initial_evaluation(state.log_history)
    history = [{k: v for k, v in row.items() if "token_accuracy" not in k}
               for row in epoch_history(log_history, initial)]
    evals = [row for row in history if row.get("eval_loss") is not None and row["epoch"] > 0]
    best = min(evals, key=lambda row: row["eval_loss"]) if evals else (history[-1] if history else {})
    return trainer.model, {
        "status": f"untrained: {untrained}" if untrained else "trained", "steps": state.global_step,
        "learning_rates": {"min": min(rates), "max": max(rates)} if rates else None,
        "epochs_run": round(state.epoch or 0.0, 4),
        "max_epochs": prm["epochs"], "stopped_early": bool(validation) and (state.epoch or 0) < prm["epochs"] - 1e-6,
        "best_epoch": best.get("epoch"), "batch_size": prm["batch_size"], "grad_accum": grad_accum,
        "effective_batch": prm["batch_size"] * grad_accum, "optimizer": OPTIMIZER_AUTO[device], "bf16": args.bf16,
        "gradient_checkpointing": args.gradient_checkpointing, "shared_prefixes": trainer.share_prefixes,
        "train_loss": finite(result.training_loss),
        "final_train_loss": history[-1].get("train_loss") if history else None, "eval_loss": best.get("eval_loss"),
        "initial_eval_loss": finite(initial["eval_loss"]) if initial else None, "history": history,
        "train_seconds": round(train_seconds, 2)}


ACCEPTANCE_HELDOUT_FRACTION = 0.25
"""Share of the acceptance answers' instances the pre-training leaves out to measure itself on (held-out verdicts)."""


def _pretrain_on_acceptance(model, tokenizer, cfg, prm: dict, seed: int, answers_path: str | None, output_dir: str,
                            device: str, tracking: TrackingRun) -> tuple[object, dict]:
    """One epoch of BCE on :func:`acceptance_examples` (no pairwise term, no validation side), on the model the soft
    labels then train; returns it and what the step did, with its predictions of the verdicts of answers of
    instances it did not train on (``heldout``: :data:`ACCEPTANCE_HELDOUT_FRACTION` of them). Its train loss alone
    says little: one epoch's mean from a fresh head whose logits stay small sits near ln 2 even where the head
    already ranks the held-out verdicts (docs/benchmarks.md)."""
    if not answers_path:
        raise ValueError("prm.acceptance_examples needs the answers records (results/labels/answers.parquet, rule "
                         "gather_answers: the rule's answers input); set it to 0 to train without them")
    examples = acceptance_examples(answers_path, tokenizer, cfg.chat_template_kwargs, prm["max_length"],
                                   prm["acceptance_examples"], seed)
    accepted = sum(e.label > 0 for e in examples)
    log.info("prm: acceptance pre-training: %d played answers drawn from %s (%d accepted, %d rejected), those of "
             "%.0f%% of their instances held out", len(examples), answers_path, accepted, len(examples) - accepted,
             100 * ACCEPTANCE_HELDOUT_FRACTION)
    if not examples:
        return model, {"examples": 0}
    heldout_keys = split_instances([e.key for e in examples], ACCEPTANCE_HELDOUT_FRACTION, seed)
    train = [e for e in examples if e.key not in heldout_keys]
    heldout = [e for e in examples if e.key in heldout_keys]
    section = {**prm, "epochs": 1, "pairwise_weight": 0.0, "label_weighting": "none"}
    model, training = _train(model, tokenizer, section, seed, train, [], output_dir, device,
                             resolve_dtype(cfg, device), tracking)
    scorer = PRMScorer(cfg, max_length=prm["max_length"], token_budget=prm["score_batch_tokens"], tokenizer=tokenizer,
                       model=model)
    predictions = scorer.score_ids([e.input_ids for e in heldout]) if heldout else []
    measured = prediction_metrics(predictions, [e.label for e in heldout])
    log.info("prm: acceptance pre-training: %d steps, train loss %s; held-out verdicts of %d answers: AUROC %s",
             training["steps"], training["train_loss"], len(heldout), measured and measured["auroc"])
    return model, {"examples": len(train), "accepted": sum(e.label > 0 for e in train), "status": training["status"],
                   "steps": training["steps"], "train_loss": training["train_loss"],
                   "train_seconds": training["train_seconds"],
                   "heldout": measured and {key: measured[key] for key in ("n", "auroc", "bce", "std_prediction")}}


def orientation_side(train: list[Example]) -> list[Example]:
    """The examples the candidate-aware baselines are oriented on: the train side when it has siblings, else none
    (nothing to orient on; every baseline is then read as is)."""
    return train if states_with_siblings(train) else []


FORK_READERS = {   # what the fork of a candidate shows, as ranking baselines (the rows' turn verdict and reply)
    "acceptance": lambda row: float(bool(row["parse_ok"])),
    "rule": lambda row: rule_score(row["reply"], row["parse_ok"]),
}


def _evaluate(scorer: PRMScorer, sides: dict[str, list[Example]], ranked: str, rows: list[dict],
              policy_logprobs: dict[int, float], prm: dict, seed: int) -> dict:
    """Prediction metrics of the trained PRM and of the baselines, per side (None when empty); on the ``ranked``
    side (the held-out set when there is one, else the validation slice) also the candidate-aware baselines (the
    candidate's length in characters, the policy's mean token log-probability of it, ``policy_logprobs`` by row;
    each times its train-side :func:`orientation`), the fork's readings (:data:`FORK_READERS`: whether the game
    accepted the candidate, and the lookahead rule), the PRM's AUROC for the game's verdicts on that side
    (:func:`verdict_metrics`) and every scorer's within-prefix ranking
    (:func:`ranking_metrics`, with each baseline's paired difference to the PRM; ``constant_mean`` ties all
    siblings: the expected pick of a random choice). Predictions that are not finite (a diverged PRM) stop the
    evaluation there: ``nonfinite_predictions`` counts them per side, for the gate."""
    evaluation, predictions = {}, {}
    for side, examples in sides.items():
        predictions[side] = scorer.score_ids([e.input_ids for e in examples]) if examples else []
    nonfinite = {side: sum(not math.isfinite(p) for p in values) for side, values in predictions.items()}
    if any(nonfinite.values()):
        return {"evaluation": dict.fromkeys(sides), "baselines": None, "ranking": None,
                "nonfinite_predictions": nonfinite}
    for side, examples in sides.items():
        evaluation[side] = prediction_metrics(predictions[side], [e.label for e in examples])
    baselines = baseline_metrics(sides["train"], sides)
    examples = sides[ranked]
    labels = [e.label for e in examples]
    readers = {"candidate_length": lambda e: float(len(rows[e.row]["candidate"])),
               "policy_logprob": lambda e: policy_logprobs[e.row]}
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
    verdicts = {"side": ranked, **verdict_metrics(predictions[ranked], fork_scores["acceptance"])}
    return {"evaluation": evaluation, "baselines": baselines, "ranking": ranking, "verdicts": verdicts}


def policy_logprobs_of(model_settings: dict, sft_adapter: str | None, rows: list[dict], examples: list[Example],
                       cache_dir: str | None) -> dict[int, float]:
    """The SFT policy's (the base policy's without ``sft_adapter``) mean token log-probability of each example's
    candidate after its prefix, by row (:func:`clemprm.models.logprob.mean_logprobs`); the policy is released
    after."""
    if not examples:
        return {}
    policy = load_policy(policy_settings(model_settings, sft_adapter), cache_dir)
    start = time.perf_counter()
    scores = mean_logprobs(policy, [(rows[e.row]["prefix"], rows[e.row]["candidate"]) for e in examples])
    log.info("prm: policy log-probabilities of %d candidates in %.0f s", len(examples),
             time.perf_counter() - start)
    del policy
    return {e.row: score for e, score in zip(examples, scores)}


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


def train_prm(settings: dict, labels_path: str, adapter_dir: str, metrics_path: str,
              cache_dir: str | None = None, sft_adapter: str | None = None, on_failure: str = "stop",
              tracking: TrackingRun = OFF, answers_path: str | None = None, probabilities: bool = False) -> dict:
    """Train the PRM on the soft labels of ``labels_path``; write the adapter folder (LoRA + score head) and the
    metrics JSON; return the metrics. ``settings`` is the rule's params: seed, model, prm. ``sft_adapter``: the
    policy whose log-probabilities are a baseline (None: the base policy). ``answers_path``: the answers records
    (:mod:`clemprm.stages.answers`) the acceptance pre-training reads (``prm.acceptance_examples``). ``tracking``:
    the tracker run that gets every step's loss (:mod:`clemprm.tracking`). A PRM that fails its quality gate
    (:func:`~clemprm.stages.prm_metrics.quality_gate`, the metrics' ``gate``) is written with a failure mark
    (:mod:`clemprm.checks.run_time`) that the summary reports, or, with ``prm.gate.on_failure: stop`` (``inherit``:
    the run's ``on_failure``), stops the stage naming the metric and the baseline (:func:`gate_marks`).
    ``probabilities``: a configured search multiplies the PRM's values as probabilities
    (:func:`clemprm.modes.probability_search`), so calibration decides the gate."""
    import transformers
    from peft import get_peft_model

    import datasets
    datasets.disable_progress_bars()   # the rule log gets LogProgress lines instead

    start = time.perf_counter()
    prm, seed = settings["prm"], int(settings["seed"])
    if prm["loss"] not in LOSSES:
        raise ValueError(f"prm.loss must be one of {', '.join(LOSSES)}, got {prm['loss']!r}")
    rows = read_labels(labels_path)
    device = device_name()
    transformers.set_seed(seed)   # the new score head and the LoRA weights are initialised from it
    if prm["kind"] == "probe":   # the frozen policy's features (clemprm.stages.probe), no model of its own
        features = probe.policy_features(settings["model"], prm, sft_adapter, cache_dir)
        cfg, tokenizer = features.cfg, features.tokenizer
    else:
        cfg = prm_model_config(settings["model"], prm, cache_dir=cache_dir)
        tokenizer, model = load_tokenizer_and_model(cfg, for_training=True, task="seq-cls")
        if device == "cpu":
            keep_4bit_differentiable(model)
        model = get_peft_model(model, lora_config(prm["lora"], "SEQ_CLS"))

    examples = build_examples(rows, tokenizer, cfg.chat_template_kwargs, prm["max_length"], prm["input"])
    heldout = [e for e in examples if rows[e.row]["split"] != "train"]   # branch_points.validation_instances
    train_side = [e for e in examples if rows[e.row]["split"] == "train"]
    validation_keys = split_instances([e.key for e in train_side], prm["validation_fraction"], seed)
    train = sample_whole_groups([e for e in train_side if e.key not in validation_keys], prm["max_examples"], seed)
    validation = sample_whole_groups([e for e in train_side if e.key in validation_keys], prm["max_examples"],
                                     seed + 1)
    heldout_keys = {e.key for e in heldout}
    log.info("prm data: %d branch points from %s (%d truncated to %d tokens); train %d pairs on %d instances, "
             "validation %d pairs on %d instances, held out %d pairs on %d validation-split instances", len(examples),
             labels_path, sum(e.truncated for e in examples), prm["max_length"], len(train),
             len({e.key for e in train}), len(validation), len(validation_keys), len(heldout), len(heldout_keys))
    metrics = {
        "model": {"spec": cfg.spec, "device": device, "quantization": resolve_quantization(cfg, device),
                  "dtype": str(resolve_dtype(cfg, device)), "pad_token": tokenizer.pad_token,
                  "eos_token": tokenizer.eos_token},
        "input": prm["input"], "regime": PRM_INPUT_REGIMES[prm["input"]],
        "loss": prm["loss"], "pairwise_weight": prm["pairwise_weight"], "label_weighting": prm["label_weighting"],
        "examples": {
            "rows": len(rows), "train": len(train), "validation": len(validation), "heldout": len(heldout),
            "train_available": sum(e.key not in validation_keys for e in train_side),
            "train_instances": len({e.key for e in train}), "validation_instances": len(validation_keys),
            "heldout_instances": len(heldout_keys),
            "validation_instance_keys": ["/".join(key) for key in sorted(validation_keys)],
            "train_by_game": dict(sorted(collections.Counter(e.key[0] for e in train).items())),
            "truncated": sum(e.truncated for e in examples)},
        "tokens": {"train": sum(len(e.input_ids) for e in train),
                   "validation": sum(len(e.input_ids) for e in validation),
                   "heldout": sum(len(e.input_ids) for e in heldout),
                   "max_sequence": max((len(e.input_ids) for e in examples), default=0)},
    }
    sides = {"train": train, "validation": validation, "heldout": heldout}
    ranked = "heldout" if heldout else "validation"

    with shared_scratch_beside(adapter_dir) as scratch, tracker_environment(tracking):
        if train and prm["kind"] == "probe":
            if prm["acceptance_examples"] and not answers_path:
                raise ValueError("prm.acceptance_examples > 0 gives the probe's validity head the answers records, "
                                 "but none were given (the rule's answers input); set it to 0 to fit without them")
            verdicts = acceptance_examples(answers_path, tokenizer, cfg.chat_template_kwargs, prm["max_length"],
                                           prm["acceptance_examples"], seed) if prm["acceptance_examples"] else []
            scorer, training = probe.fit_probe(features, prm, seed, train, verdicts,
                                               label_weights(train, prm["label_weighting"]), prm_loss)
            metrics.update(training)
        elif train:
            if prm["acceptance_examples"]:
                model, metrics["acceptance_pretraining"] = _pretrain_on_acceptance(
                    model, tokenizer, cfg, prm, seed, answers_path, str(scratch / "acceptance"), device, tracking)
            model, training = _train(model, tokenizer, prm, seed, train, validation, str(scratch / "checkpoints"),
                                     device, resolve_dtype(cfg, device), tracking)
            metrics.update(training)
            scorer = PRMScorer(cfg, max_length=prm["max_length"], token_budget=prm["score_batch_tokens"],
                               tokenizer=tokenizer, model=model)
        if train:
            logprobs = policy_logprobs_of(settings["model"], sft_adapter, rows,
                                          orientation_side(sides["train"]) + sides[ranked], cache_dir)
            metrics.update(_evaluate(scorer, sides, ranked, rows, logprobs, prm, seed))
            metrics["gate"] = quality_gate(metrics["evaluation"][ranked], metrics["ranking"], prm["gate"],
                                           prm["input"], metrics.get("nonfinite_predictions"), probabilities)
        else:
            # no branch points: an untrained adapter (LoRA B = 0, a random score head) still lets the later
            # stages run; the metrics say so
            log.warning("prm: no training examples; writing an untrained adapter")
            metrics.update(status="untrained: no training examples", steps=0, epochs_run=0, train_loss=None,
                           eval_loss=None, history=[], evaluation=dict.fromkeys(sides),
                           baselines=None, ranking=None, gate=quality_gate(None, None, prm["gate"], prm["input"]))
            if prm["kind"] == "probe":
                scorer = probe.untrained_probe(features, prm)
        log.info("%s", gate_lines(metrics["gate"]))
        gate_action = on_failure if prm["gate"]["on_failure"] == "inherit" else prm["gate"]["on_failure"]
        metrics.update(marks_metadata(untrained_marks(metrics, on_failure) + gate_marks(metrics["gate"], gate_action)))
        if prm["kind"] == "probe":
            probe.write_probe(scorer, adapter_dir, metrics.get("probe"), sft_adapter)
        else:
            write_adapter(model, cfg.spec, adapter_dir)
    finish_metrics(metrics, start, settings, metrics_path)
    # after finish_metrics: the final metrics
    write_adapter_card("prm_probe" if prm["kind"] == "probe" else "prm", adapter_dir, metrics)
    ranked_metrics = (metrics["evaluation"] or {}).get(ranked) or {}
    log.info("prm: %s in %.0f s; %s steps, train loss %s, eval loss %s -> %s, %s AUROC %s, Pearson %s; "
             "adapter %s", metrics["status"], metrics["seconds"], metrics.get("steps"), metrics.get("train_loss"),
             metrics.get("initial_eval_loss"), metrics.get("eval_loss"), ranked, ranked_metrics.get("auroc"),
             ranked_metrics.get("pearson"), adapter_dir)
    return metrics
