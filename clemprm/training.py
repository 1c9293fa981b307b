"""What every training stage shares: the device, LoRA, the Trainer's settings, progress lines, the one adapter
writer and the metrics file.

SFT (:mod:`clemprm.stages.sft`), the PRM (:mod:`clemprm.stages.prm`) and the RL trainer (:mod:`clemprm.rl.trainer`)
train PEFT LoRA adapters. On CUDA: bf16, gradient checkpointing, paged 8-bit AdamW; on CPU: fp32, ``adamw_torch``.
An adapter is written beside its final folder and moved into place, so a killed job never leaves half an adapter.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

from clemprm import distributed, records
from clemprm.config import provenance
from clemprm.tracking import TrackingRun, trainer_settings

OPTIMIZER_AUTO = {"cuda": "paged_adamw_8bit", "cpu": "adamw_torch"}


def split_instances(keys, fraction: float, seed: int) -> set:
    """The validation instances: a ``fraction`` of the distinct instance keys (at least one when there are two
    or more, never all), chosen by a seeded hash and spread over games round-robin."""
    keys = sorted(set(keys))
    if fraction <= 0 or len(keys) < 2:
        return set()
    n_validation = min(len(keys) - 1, max(1, round(fraction * len(keys))))
    by_game = collections.defaultdict(list)
    for key in keys:
        by_game[key[0]].append(key)
    for game_keys in by_game.values():
        game_keys.sort(key=lambda k: hashlib.sha256(f"{seed}/{'/'.join(k)}".encode()).hexdigest())
    order = [key for group in _zip_longest(*(by_game[g] for g in sorted(by_game))) for key in group]
    return set(order[:n_validation])


def _zip_longest(*lists):
    from itertools import zip_longest
    return [[item for item in group if item is not None] for group in zip_longest(*lists)]


def device_name() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def lora_config(lora: dict, task_type: str):
    """The PEFT LoRA config of a stage's ``lora`` section (``CAUSAL_LM`` for SFT, ``SEQ_CLS`` for the PRM)."""
    from peft import LoraConfig

    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], bias="none",
                      target_modules=lora["target_modules"], task_type=task_type)


def sample_at_most(examples: list, limit: int | None, seed: int) -> list:
    """At most ``limit`` of ``examples`` (all when ``limit`` is None), drawn by ``seed``."""
    return random.Random(seed).sample(examples, limit) if limit is not None and len(examples) > limit else examples


def progress_callback(stage: str = "sft"):
    """A Trainer callback that logs ``<stage> step i/n (epoch, seconds per step): losses`` lines to the logger
    ``clemprm.<stage>``."""
    from transformers import TrainerCallback

    logger = logging.getLogger(f"clemprm.{stage}")

    class LogProgress(TrainerCallback):
        """Training progress as log lines in the rule log (the progress bars are off)."""

        start = first_step = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.first_step = time.perf_counter(), state.global_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            shown = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in (logs or {}).items()
                     if k in ("loss", "mean_token_accuracy", "learning_rate", "grad_norm", "eval_loss",
                              "eval_mean_token_accuracy", "train_runtime", "num_tokens")}
            steps = state.global_step - (self.first_step or 0)
            rate = (time.perf_counter() - self.start) / steps if self.start is not None and steps else math.nan
            logger.info("%s step %d/%d (epoch %.2f, %.2f s/step): %s", stage, state.global_step, state.max_steps,
                        state.epoch or 0.0, rate, shown)

    return LogProgress()


def keep_4bit_differentiable(model) -> int:
    """bitsandbytes 0.50 repacks a CPU 4-bit layer for its AVX512-BF16 kernel at the first no-grad forward in
    eval mode (our per-epoch evaluation) and then computes it with ``gemv_4bit`` for good, which has no
    autograd kernel: training after an evaluation would silently lose the gradients through every frozen
    4-bit layer. Training keeps those layers on the generic, differentiable path. Returns layers changed."""
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def finite(value):
    """``value`` if it is a finite number, else None (JSON has no NaN)."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def initial_evaluation(log_history: list[dict]) -> tuple[dict | None, list[dict]]:
    """The evaluation before the first optimizer step (``eval_on_start``: logged at step 0), or None, and the rest of
    the Trainer's log."""
    initial = next((entry for entry in log_history if "eval_loss" in entry and entry.get("step") == 0), None)
    return initial, [entry for entry in log_history if entry is not initial]


def epoch_history(log_history: list[dict], initial: dict | None) -> list[dict]:
    """Per epoch: mean train loss and token accuracy of its steps, eval loss and token accuracy at its end."""
    epochs = []
    if initial:
        epochs.append({"epoch": 0, "eval_loss": finite(initial.get("eval_loss")),
                       "eval_token_accuracy": finite(initial.get("eval_mean_token_accuracy"))})
    steps = collections.defaultdict(list)
    evals = {}
    for entry in log_history:
        epoch = entry.get("epoch")
        if epoch is None:
            continue
        index = max(1, math.ceil(round(epoch, 6)))
        if "loss" in entry:
            steps[index].append(entry)
        elif "eval_loss" in entry:
            evals[index] = entry
    for index in sorted(set(steps) | set(evals)):
        logged = steps.get(index, [])
        row = {"epoch": index, "steps": len(logged),
               "train_loss": finite(sum(e["loss"] for e in logged) / len(logged)) if logged else None,
               "train_token_accuracy": finite(sum(e.get("mean_token_accuracy", math.nan) for e in logged)
                                               / len(logged)) if logged else None}
        if index in evals:
            row["eval_loss"] = finite(evals[index]["eval_loss"])
            row["eval_token_accuracy"] = finite(evals[index].get("eval_mean_token_accuracy"))
        epochs.append(row)
    return epochs


def peak_memory_mb() -> dict:
    import torch
    peak = {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}   # Linux: KiB
    if torch.cuda.is_available():
        peak["cuda_allocated"] = torch.cuda.max_memory_allocated() / 2**20
    return {key: round(value, 1) for key, value in peak.items()}


@contextlib.contextmanager
def scratch_beside(folder: str | Path):
    """A scratch folder next to ``folder`` (on the same filesystem, so a move into place is atomic), removed after."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def remove_stale_scratch(folder: str | Path) -> None:
    """Remove the scratch folders (:func:`scratch_beside`) a killed job left beside ``folder``, its Trainer checkpoints
    in them: no process of a live job uses one (Snakemake runs one job per output at a time), and nothing else would
    ever remove them."""
    folder = Path(folder)
    for stale in sorted(folder.parent.glob(f".{folder.name}.tmp-*")):
        logging.getLogger(__name__).info("removing %s, left by a killed job", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def shared_scratch_beside(folder: str | Path):
    """:func:`scratch_beside`, one for all processes of the job (rank 0's, :mod:`clemprm.distributed`): the Trainer's
    checkpoints, which rank 0 writes and every rank reads back (the best epoch's weights). Every rank enters it; rank 0
    first removes the scratch folders of a killed earlier job (:func:`remove_stale_scratch`)."""
    mine = None
    try:
        with contextlib.ExitStack() as stack:
            if distributed.is_main():
                remove_stale_scratch(folder)
            mine = stack.enter_context(scratch_beside(folder)) if distributed.is_main() else None
            yield distributed.from_main(mine)
            distributed.barrier()   # every rank is done with it before rank 0 removes it
    except Exception as error:   # a checkpoint the Trainer could not write: its error (safetensors') names no file
        if isinstance(error, records.WriteFailed) or not records.lack_of_space(error):
            raise
        raise records.write_failed(f"the Trainer's checkpoints of {folder} (in {mine or 'a scratch folder'}, now "
                                   f"removed)", error) from error


def write_adapter(model, spec: str, adapter_dir: str | Path, adapter_names: list[str] | None = None) -> None:
    """THE adapter writer: save the PEFT adapter (or the named adapters: ``default`` at the top, the others in
    sub-folders named after them, PEFT's layout) beside ``adapter_dir``, name their base by ``spec`` (``tiny:0``,
    ``embedded:...``, a hub id) rather than this machine's cache path, then move it into place. Rank 0 alone writes
    in a job of several processes (their adapters are the same: DDP keeps them so)."""
    if not distributed.is_main():
        return
    adapter_dir = Path(adapter_dir)
    with scratch_beside(adapter_dir) as scratch:
        out = scratch / "adapter"
        # save_embedding_layers=False: a LoRA on lm_head (or embed_tokens) would otherwise also save the whole base
        # matrix (PEFT's default for embedding targets, meant for a resized vocabulary; 113 MB for SmolLM2's lm_head)
        try:
            model.save_pretrained(str(out), save_embedding_layers=False,
                                  **({"selected_adapters": adapter_names} if adapter_names else {}))
        except Exception as error:   # a full disk: safetensors' error names no file
            if not records.lack_of_space(error):
                raise
            raise records.write_failed(f"adapter {adapter_dir} (written in {out} first, now removed)",
                                       error) from error
        for config_path in out.rglob("adapter_config.json"):
            data = json.loads(config_path.read_text())
            data["base_model_name_or_path"] = spec
            config_path.write_text(json.dumps(data, indent=2, sort_keys=True))
        if adapter_dir.exists():
            shutil.rmtree(adapter_dir)
        os.replace(out, adapter_dir)


def trainer_arguments(section: dict, *, key: str, seed: int, output_dir: str, device: str, dtype, grad_accum: int,
                      has_validation: bool, optimizer: str, gradient_checkpointing: bool, weight_decay: float,
                      tracking: TrackingRun) -> dict:
    """The ``TrainingArguments`` (and TRL ``SFTConfig``) settings SFT and the PRM share, from a stage's section
    ``key`` (``lr``, ``epochs``, ``scheduler``, ``warmup_ratio``, ``batch_size``): with a validation side, an
    evaluation before training (:func:`initial_evaluation`), an evaluation and a checkpoint per epoch and the best
    epoch's weights loaded at the end (early stopping reads the eval loss); length-grouped batches; progress as log
    lines (:func:`progress_callback`) and, every optimizer step, to the ``tracking`` run's tracker
    (:mod:`clemprm.tracking`). Over several processes (the Trainer's DDP) each accumulates ``grad_accum / processes``
    batches: the effective batch stays ``batch_size x grad_accum``."""
    import torch

    processes = distributed.world_size()
    accumulation = distributed.accumulation_steps(grad_accum, f"{key}.grad_accum")
    logging.getLogger(f"clemprm.{key}").info(
        "%s: effective batch %d = batch_size %d x accumulation %d x %d process(es)", key,
        section["batch_size"] * accumulation * processes, section["batch_size"], accumulation, processes)

    # the evaluation before training runs inside train() (eval_on_start): a Trainer.evaluate() before train() would
    # prepare the model for evaluation and leave it out of DDP, whose gradients then are never all-reduced
    per_epoch = {"eval_strategy": "epoch", "eval_on_start": True, "save_strategy": "epoch",
                 "load_best_model_at_end": True,
                 "metric_for_best_model": "eval_loss", "greater_is_better": False, "save_total_limit": 1,
                 "save_only_model": True} if has_validation else {"eval_strategy": "no", "save_strategy": "no"}
    return dict(
        output_dir=output_dir, seed=seed, data_seed=seed,
        learning_rate=section["lr"], num_train_epochs=section["epochs"], lr_scheduler_type=section["scheduler"],
        warmup_steps=section["warmup_ratio"], weight_decay=weight_decay, max_grad_norm=1.0,
        # evaluation one example at a time: the eval loss is then the mean over examples whatever the process count
        # (a batch's mean weighs its examples by the batch they fall in, which the process count changes, and the
        # best epoch is chosen by it)
        per_device_train_batch_size=section["batch_size"], per_device_eval_batch_size=1,
        gradient_accumulation_steps=accumulation, optim=optimizer,
        # several processes: DDP; on the CPU accelerate runs it (MULTI_CPU, gloo) only when told to use the CPU
        **({"ddp_backend": "nccl" if device == "cuda" else "gloo", "use_cpu": device == "cpu"} if processes > 1
           else {}),
        bf16=device == "cuda" and dtype == torch.bfloat16, fp16=device == "cuda" and dtype == torch.float16,
        activation_checkpointing=gradient_checkpointing,     # transformers 5 name of gradient_checkpointing
        activation_checkpointing_kwargs={"use_reentrant": False} if gradient_checkpointing else None,
        train_sampling_strategy="group_by_length",   # similar lengths per batch: less padding
        logging_strategy="steps", logging_steps=1, **trainer_settings(tracking), disable_tqdm=True,
        dataloader_pin_memory=device == "cuda", **per_epoch)


def schedule_factor(kind: str, warmup: int, total: int):
    """The learning-rate factor of optimizer step ``step`` (0-based) of ``total``, for ``kind`` (``linear``,
    ``cosine``, ``constant_with_warmup``) after ``warmup`` warm-up steps, such that no step runs at factor 0:
    transformers' schedules give the first step lr 0 (``step / warmup``) and, for ``linear``, the last step
    too, which a run of tens of steps cannot spare (Adam moves a weight by about lr per step). Here warm-up step
    ``i`` runs at ``(i + 1) / (warmup + 1)`` and the decay ends one step past the last: ``(total - step) /
    (total - warmup)``."""
    if kind not in ("linear", "cosine", "constant_with_warmup"):
        raise ValueError(f"unknown learning-rate schedule {kind!r} (known: linear, cosine, constant_with_warmup)")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant_with_warmup":
            return 1.0
        remaining = max(0.0, (total - step) / max(1, total - warmup))
        return remaining if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * (1.0 - remaining)))

    return factor


def stage_trainer(trainer_class):
    """``trainer_class`` as every training stage runs it (SFT and the PRM):

    * its length-grouped batches drawn per optimizer step of all processes: the Trainer groups
      ``batch_size x accumulation`` examples of similar length, here ``x processes`` too, so any process count with
      the same effective batch trains on the same batches in the same steps (each process takes its share of a
      group);
    * its schedule (``scheduler``, ``warmup_ratio`` of the stage's section) with no optimizer step at learning rate
      0 (:func:`schedule_factor`): a run of a few steps, as the embedded default's SFT is, would otherwise spend its
      first one on nothing."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    class StageTrainer(trainer_class):
        def _get_train_sampler(self, train_dataset=None):
            sampler = super()._get_train_sampler(train_dataset)
            if isinstance(sampler, LengthGroupedSampler):
                sampler.batch_size *= self.args.world_size
            return sampler

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                kind = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer,
                    schedule_factor(kind, self.args.get_warmup_steps(num_training_steps), num_training_steps))
                self._created_lr_scheduler = True
            return self.lr_scheduler

    StageTrainer.__name__ = StageTrainer.__qualname__ = trainer_class.__name__
    return StageTrainer


def trainable_snapshot(model) -> dict:
    """A copy of the trainable parameters (the adapter's), to tell afterwards whether training changed them."""
    return {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}


def changed_parameters(model, snapshot: dict) -> int:
    """How many of the :func:`trainable_snapshot` parameters ``model`` holds with other values now."""
    import torch

    current = dict(model.named_parameters())
    return sum(1 for name, before in snapshot.items()
               if name in current and not torch.equal(current[name].detach().to(before.device), before))


def applied_learning_rates(scheduler, steps: int) -> list[float] | None:
    """The learning rate of each of the first ``steps`` optimizer steps under ``scheduler`` (the Trainer's: a
    ``LambdaLR``, as every transformers schedule is), or None for another kind of scheduler."""
    lambdas, base = getattr(scheduler, "lr_lambdas", None), getattr(scheduler, "base_lrs", None)
    if not lambdas or not base:
        return None
    return [base[0] * lambdas[0](step) for step in range(steps)]


def untrained_reason(steps: int, rates: list[float] | None, changed: int) -> str | None:
    """Why a training run left its adapter as it was (None when it did not): weights that did not change in its
    ``steps`` (none runs at learning rate 0: :func:`stage_trainer`)."""
    if changed:
        return None
    described = f" (learning rates {min(rates):.3g} to {max(rates):.3g})" if rates else ""
    return f"its weights did not change in {steps} optimizer step(s){described}"


def finish_metrics(metrics: dict, start: float, settings: dict, metrics_path: str | Path) -> None:
    """Add wall seconds, peak memory, config and versions to a stage's metrics and write them."""
    metrics["seconds"] = round(time.perf_counter() - start, 2)
    metrics["peak_memory_mb"] = peak_memory_mb()
    metrics.update(provenance(settings))
    records.write_json(metrics_path, metrics)
