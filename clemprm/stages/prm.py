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
    checkpointing, paged 8-bit AdamW; CPU: fp32, ``adamw_torch``. A ``grad_accum`` larger than one epoch's batches
    is capped (:func:`effective_grad_accum`) with a warning mark the summary lists. The data:
    :mod:`clemprm.stages.prm_data`.

A probe PRM (``prm.kind: probe``)
    The same data, split, loss, evaluation, gate and metrics; instead of a LoRA classifier, linear heads on the
    frozen SFT policy's hidden states, fitted and chosen on train instances by :mod:`clemprm.stages.probe` (with
    ``prm.acceptance_examples`` > 0, a validity head on the answers records instead of the verdicts below).

The head (:mod:`clemprm.stages.prm_head`)
    With ``prm.head_init: probe`` the score head is fitted on the frozen model's features before the LoRA trains
    (linear probe, then fine-tune); ``prm.head_lr`` gives it a learning rate of its own; no optimizer step runs at
    learning rate 0 (:func:`clemprm.training.schedule_factor`). The record says how far training moved the head from
    its random start (``head``).

The game's verdicts (``prm.acceptance_examples`` > 0)
    Up to that many answers the pipeline played anyway (the answers records, :mod:`clemprm.stages.answers`: base
    rollouts, SFT-policy trajectories, siblings and label continuations, train split only), each labelled by the game's
    verdict on it (1: the game accepted the answer, 0: it counted a rule violation), as many accepted as rejected where
    the records have them, train beside the soft labels: one dataset, one optimizer, one schedule (a separate
    pre-training epoch was wiped by the soft-label stage that restarted the optimizer). The verdict is a function of
    the prompt and the answer (each game states its answer format and rules in its prompt), known for free on every
    turn, while Monte-Carlo soft labels cost K continuations each. The answers of a quarter of their instances are kept
    out and predicted after training (``acceptance.heldout``: the validity part's AUROC on its own). Held-out
    (validation-split) instances never enter.

Predictions (what rule ``prm_metrics`` measures, :mod:`clemprm.stages.prm_evaluation`)
    After training, the written model scores every example of every side (train, the ``validation`` slice of train
    instances, ``heldout``: the branch points of validation-split instances, ``branch_points.validation_instances``,
    which neither training nor the choice of epoch sees), and the policy scores the candidates its log-probability
    baseline reads; both go to ``results/prm/predictions.parquet`` (:data:`clemprm.records.PRM_PREDICTIONS`), with
    the training record (steps, losses, history, examples, tokens, the probe's settings, warnings) in its provenance.
    Everything computed from them with no model (metrics, baselines, ranking, intervals, the quality gate) is the
    cheap ``prm_metrics`` rule: changing ``prm.ci`` or a gate threshold trains nothing.
"""

from __future__ import annotations

import collections
import logging
import math
import time

from clemprm import distributed, records
from clemprm.models.generation import load_policy
from clemprm.models.loader import load_tokenizer_and_model, policy_settings, resolve_dtype, resolve_quantization
from clemprm.models.logprob import mean_logprobs
from clemprm.models.prm import PRMScorer, ProbeScorer, prm_model_config
from clemprm.models.probe import ProbeHead
from clemprm.models.scoring import logits_sharing_prefixes, pad_right, prefix_sharing_problem
from clemprm.config import provenance
from clemprm.modes import PRM_INPUT_REGIMES
from clemprm.checks.run_time import MARKS_KEY, warning_mark
from clemprm.stages import prm_head, probe
from clemprm.stages.prm_data import (TRAINING_KEY, Example, acceptance_examples, build_examples, read_labels,
                                     sample_whole_groups, sibling_groups)
from clemprm.stages.prm_metrics import orientation_side, prediction_metrics
from clemprm.model_card import write_adapter_card
from clemprm.tracking import OFF, TrackingRun, tracker_environment
from clemprm.training import (OPTIMIZER_AUTO, applied_learning_rates, changed_parameters, device_name, epoch_history,
                              finite, initial_evaluation, keep_4bit_differentiable, lora_config, peak_memory_mb,
                              progress_callback, shared_scratch_beside, split_instances, stage_trainer,
                              trainable_snapshot, trainer_arguments, untrained_reason, write_adapter)

log = logging.getLogger(__name__)

LOSSES = ("bce", "mse")
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
                     pad_id: int = 0, head_lr: float | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss = loss
            self.pairwise_weight = pairwise_weight
            self.share_prefixes = share_prefixes
            self.pad_id = pad_id
            self.head_lr = head_lr

        def create_optimizer(self, model=None):
            """The Trainer's optimizer, the score head (PEFT's ``modules_to_save``) in a group of its own at
            ``head_lr`` (``prm.head_lr``): a head that starts at random and a LoRA that starts at zero need
            different step sizes."""
            optimizer = super().create_optimizer(model)
            if self.head_lr is not None:
                split_head_group(optimizer, prm_head.head_parameters(model or self.model), self.head_lr)
            return optimizer

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


def split_head_group(optimizer, head: list, head_lr: float) -> None:
    """Move the parameters of ``head`` out of ``optimizer``'s groups into groups of their own at ``head_lr`` (before
    any step: the optimizer holds no state yet)."""
    ids = {id(param) for param in head}
    moved = []
    for group in optimizer.param_groups:
        mine = [param for param in group["params"] if id(param) in ids]
        group["params"] = [param for param in group["params"] if id(param) not in ids]
        if mine:
            moved.append({**{key: value for key, value in group.items() if key != "params"}, "params": mine,
                          "lr": head_lr})
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
    for group in moved:
        optimizer.add_param_group(group)


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
    warnings = []
    if grad_accum < prm["grad_accum"]:   # the run trains with a smaller effective batch than configured
        warnings.append(warning_mark(
            "prm_adapter", f"{train_rows} train {'states' if by_state else 'pairs'} make "
            f"{math.ceil(train_rows / prm['batch_size'])} batches of {prm['batch_size']}: gradient accumulation capped "
            f"at {grad_accum} (of prm.grad_accum {prm['grad_accum']}) so that every epoch makes an optimizer step: the "
            f"effective batch is {prm['batch_size'] * grad_accum}, not {prm['batch_size'] * prm['grad_accum']}",
            condition="grad_accum_capped", count=grad_accum))
    args = _training_args(prm, seed, output_dir, device, dtype, grad_accum, has_validation=bool(validation),
                          tracking=tracking)
    callbacks = [progress_callback("prm")]
    if validation:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=prm["early_stopping_patience"]))
    trainer = stage_trainer(_trainer_class())(
        model=model, args=args,
        train_dataset=_as_dataset(train, by_state, label_weights(train, prm["label_weighting"])),
        eval_dataset=_as_dataset(validation, by_state, label_weights(validation, "none")) if validation else None,
        data_collator=_collator(tokenizer.pad_token_id), callbacks=callbacks, loss=prm["loss"],
        pairwise_weight=prm["pairwise_weight"], share_prefixes=shares_prefixes(model, by_state),
        pad_id=tokenizer.pad_token_id, head_lr=prm["head_lr"])
    trainer.remove_callback(PrinterCallback)   # progress goes to the log through LogProgress
    before = trainable_snapshot(trainer.model)
    start = time.perf_counter()
    result = trainer.train()
    train_seconds = time.perf_counter() - start
    state = trainer.state
    rates = applied_learning_rates(trainer.lr_scheduler, state.global_step)
    untrained = untrained_reason(state.global_step, rates, changed_parameters(trainer.model, before))
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
        "train_seconds": round(train_seconds, 2), MARKS_KEY: [mark.as_dict() for mark in warnings]}


ACCEPTANCE_HELDOUT_FRACTION = 0.25
"""Share of the acceptance answers' instances left out of training to measure the PRM on (held-out verdicts)."""


def verdict_examples(tokenizer, cfg, prm: dict, seed: int, answers_path: str | None) -> tuple[list, list]:
    """The answers a PRM trains on beside the soft labels (``prm.acceptance_examples`` of them, labelled by the game's
    verdict: :func:`acceptance_examples`; the LoRA PRM in its one schedule, the probe as its validity head) and those
    of :data:`ACCEPTANCE_HELDOUT_FRACTION` of their instances
    kept out to measure it on: ``(train, heldout)``."""
    if not prm["acceptance_examples"]:
        return [], []
    if not answers_path:
        raise ValueError("prm.acceptance_examples needs the answers records (results/labels/answers.parquet, rule "
                         "gather_answers: the rule's answers input); set it to 0 to train without them")
    examples = acceptance_examples(answers_path, tokenizer, cfg.chat_template_kwargs, prm["max_length"],
                                   prm["acceptance_examples"], seed)
    heldout_keys = split_instances([e.key for e in examples], ACCEPTANCE_HELDOUT_FRACTION, seed)
    train = [e for e in examples if e.key not in heldout_keys]
    heldout = [e for e in examples if e.key in heldout_keys]
    log.info("prm: %d played answers from %s train beside the soft labels (%d accepted), %d of other instances "
             "held out to measure the verdicts on", len(train), answers_path, sum(e.label > 0 for e in train),
             len(heldout))
    return train, heldout


def verdict_record(scorer: PRMScorer, train: list, heldout: list) -> dict:
    """What the PRM learned of the game's verdicts: the answers it trained on, and its AUROC, BCE and spread on the
    held-out answers' verdicts (the validity part on its own)."""
    predictions = scorer.score_ids([e.input_ids for e in heldout]) if heldout else []
    measured = prediction_metrics(predictions, [e.label for e in heldout])
    log.info("prm: held-out verdicts of %d answers: AUROC %s", len(heldout), measured and measured["auroc"])
    return {"examples": len(train), "accepted": sum(e.label > 0 for e in train),
            "heldout": measured and {key: measured[key] for key in ("n", "auroc", "bce", "std_prediction")}}


def prediction_rows(scorer: PRMScorer, sides: dict[str, list[Example]], rows: list[dict],
                    policy_logprobs: dict[int, float]) -> list[dict]:
    """The records of :data:`clemprm.records.PRM_PREDICTIONS`: every example of every side scored by ``scorer``, in
    side order, with the policy's log-probability of its candidate where it was computed (``policy_logprobs``)."""
    predicted = []
    for side, examples in sides.items():
        # a state's siblings read their shared prompt once (the LoRA PRM and the probe alike)
        scores = scorer.score_ids([e.input_ids for e in examples], [e.state_id for e in examples]) if examples else []
        predicted += [{"row": e.row, "bp_id": rows[e.row]["bp_id"], "side": side, "prediction": float(score),
                       "policy_logprob": policy_logprobs.get(e.row)} for e, score in zip(examples, scores)]
    return predicted


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


def train_prm(settings: dict, labels_path: str, adapter_dir: str, predictions_path: str,
              cache_dir: str | None = None, sft_adapter: str | None = None, tracking: TrackingRun = OFF,
              answers_path: str | None = None) -> dict:
    """Train the PRM on the soft labels of ``labels_path``; write the adapter folder (LoRA + score head, or the
    probe's) and ``predictions_path``: the trained PRM's predictions of every side with the policy's log-probabilities
    (:func:`prediction_rows`) and, in its provenance (:data:`TRAINING_KEY`), the training record, which is returned.
    ``settings`` is the rule's settings: seed, model, prm. ``sft_adapter``: the policy whose log-probabilities are a
    baseline (None: the base policy). ``answers_path``: the answers records (:mod:`clemprm.stages.answers`) whose
    verdicts the PRM trains on (``prm.acceptance_examples``). ``tracking``: the tracker run that gets every step's
    loss (:mod:`clemprm.tracking`). Rule ``prm_metrics`` measures the predictions and judges the quality gate
    (:func:`clemprm.stages.prm_evaluation.measure_prm`)."""
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
    predicted = []

    with shared_scratch_beside(adapter_dir) as scratch, tracker_environment(tracking):
        if train and prm["kind"] == "probe":
            if prm["acceptance_examples"] and not answers_path:
                raise ValueError("prm.acceptance_examples > 0 gives the probe's validity head the answers records, "
                                 "but none were given (the rule's answers input); set it to 0 to fit without them")
            verdicts, verdicts_heldout = verdict_examples(tokenizer, cfg, prm, seed, answers_path)
            scorer, training = probe.fit_probe(features, prm, seed, train, verdicts,
                                               label_weights(train, prm["label_weighting"]), prm_loss)
            metrics.update(training)
            if scorer.head.validity is not None:   # the validity head alone, on the held-out answers' verdicts
                validity = ProbeScorer(features, ProbeHead(scorer.head.validity), input=prm["input"],
                                       max_length=prm["max_length"])
                metrics["acceptance"] = verdict_record(validity, verdicts, verdicts_heldout)
        elif train:
            verdicts, verdicts_heldout = verdict_examples(tokenizer, cfg, prm, seed, answers_path)
            mixed = train + verdicts   # one optimizer and one schedule over the soft labels and the verdicts
            random_head = prm_head.score_head(model).detach().clone()
            if prm["head_init"] == "probe":
                metrics["head_init"] = prm_head.fit_head(
                    model, mixed, label_weights(mixed, prm["label_weighting"]), prm, seed, tokenizer.pad_token_id,
                    lambda logits, labels, groups, weights: prm_loss(logits, labels, groups, prm["loss"],
                                                                     prm["pairwise_weight"], weights))
            model, training = _train(model, tokenizer, prm, seed, mixed, validation, str(scratch / "checkpoints"),
                                     device, resolve_dtype(cfg, device), tracking)
            metrics.update(training)
            metrics[MARKS_KEY] += metrics.get("head_init", {}).pop("marks", [])
            metrics["head"] = prm_head.head_movement(random_head, prm_head.score_head(model).detach(),
                                                     [param for name, param in model.named_parameters()
                                                      if "lora_B" in name and param.requires_grad])
            scorer = PRMScorer(cfg, max_length=prm["max_length"], token_budget=prm["score_batch_tokens"],
                               tokenizer=tokenizer, model=model)
            if verdicts:
                metrics["acceptance"] = verdict_record(scorer, verdicts, verdicts_heldout)
        if train:
            logprobs = policy_logprobs_of(settings["model"], sft_adapter, rows,
                                          orientation_side(sides["train"]) + sides[ranked], cache_dir)
            predicted = prediction_rows(scorer, sides, rows, logprobs)
        else:
            # no branch points: an untrained adapter (LoRA B = 0, a random score head) still lets the later
            # stages run; the metrics say so
            log.warning("prm: no training examples; writing an untrained adapter")
            metrics.update(status="untrained: no training examples", steps=0, epochs_run=0, train_loss=None,
                           eval_loss=None, history=[])
            if prm["kind"] == "probe":
                scorer = probe.untrained_probe(features, prm)
        if prm["kind"] == "probe":
            probe.write_probe(scorer, adapter_dir, metrics.get("probe"), sft_adapter)
        else:
            write_adapter(model, cfg.spec, adapter_dir)
    metrics.update(seconds=round(time.perf_counter() - start, 2), peak_memory_mb=peak_memory_mb())
    metrics.setdefault(MARKS_KEY, [])
    records.write_records(predictions_path, predicted, records.PRM_PREDICTIONS,
                          {**provenance(settings), TRAINING_KEY: metrics})
    write_adapter_card("prm_probe" if prm["kind"] == "probe" else "prm", adapter_dir,
                       {**metrics, **provenance(settings)})
    log.info("prm: %s in %.0f s; %s steps, train loss %s, eval loss %s -> %s; %d predictions in %s, adapter %s",
             metrics["status"], metrics["seconds"], metrics.get("steps"), metrics.get("train_loss"),
             metrics.get("initial_eval_loss"), metrics.get("eval_loss"), len(predicted), predictions_path,
             adapter_dir)
    return metrics
