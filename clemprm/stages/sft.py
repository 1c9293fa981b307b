"""The ``sft_adapter`` stage: LoRA (QLoRA) fine-tuning of the policy on winning turns with TRL's SFTTrainer.

Data
    The input is the win-filtered SFT parquet (playpen-data ``interactions`` layout: one row per LLM player
    perspective, ``messages`` + ``meta``), plus, when ``sft.extra_data`` names one, a local parquet/jsonl
    export of playpen-data interactions, of which only rows with ``meta.outcome == "success"`` are used.
    Messages are normalised as the clemcore backends send them (consecutive same-role messages merged,
    an empty system message dropped), then every assistant turn becomes one prompt/completion pair: the
    prompt is the conversation before it, rendered with the chat template and the generation prompt
    exactly as :class:`clemprm.models.generation.PolicyModel` renders it at play time (``chat_template_kwargs``
    included), the completion is the answer text plus the template's end-of-turn token. The loss is on the
    completion tokens only (TRL ``completion_only_loss`` on pre-tokenised ``input_ids`` +
    ``completion_mask``), which works for every chat template.

Length
    A pair longer than ``sft.max_length`` tokens is shortened by dropping the oldest exchanges (an assistant
    answer and the user message after it), keeping the leading system message and the first user prompt and
    always the latest user message, so the trained answer is never cut off. A pair that still does not fit
    is dropped (counted per game in the log and the metrics' ``pairs_by_game``); a game that loses every pair so
    fails the stage (``game_lost_to_max_length``, naming ``sft.max_length``). TRL's own truncation (which keeps the
    start) never triggers.

Validation
    A held-out slice of *instances* ``(game, experiment, task_id)``, so no instance is on both sides;
    eval loss and token accuracy before training and after every epoch, early stopping with patience on
    the eval loss, and the best epoch's adapter is the one written.

Devices
    CUDA: the reference setup: base model as the loader gives it (``quantization: auto`` = 4-bit NF4, bf16
    compute), bf16 training, gradient checkpointing, paged 8-bit AdamW. CPU: fp32, no bf16, no gradient
    checkpointing, ``adamw_torch``; ``quantization: nf4`` still works (the real QLoRA path with fp32 compute and
    fp32 LoRA weights, where TRL would make them bf16).

Outputs
    The adapter folder (``adapter_config.json``, ``adapter_model.safetensors``; the tokenizer is never changed,
    so none is written) and a metrics JSON. Load the result with
    ``ModelConfig(spec=<model.spec>, adapter=<adapter dir>)``.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from clemprm import records
from clemprm.checks.run_time import check_not_empty, fail_or_warn, marks_metadata
from clemprm.play.chat import end_of_turn_text, end_token_ids, normalise, render_prompt
from clemprm.model_card import write_adapter_card
from clemprm.tracking import OFF, TrackingRun, tracker_environment
from clemprm.training import (OPTIMIZER_AUTO, applied_learning_rates, changed_parameters, device_name, epoch_history,
                              finish_metrics, finite, initial_evaluation, keep_4bit_differentiable, lora_config,
                              progress_callback, sample_at_most, shared_scratch_beside, split_instances, stage_trainer,
                              trainable_snapshot, trainer_arguments, untrained_reason, write_adapter)

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------- data


@dataclass
class Example:
    """One prompt/completion pair, tokenised."""

    prompt_ids: list[int]
    completion_ids: list[int]
    key: tuple[str, str, str]      # the instance: (game, experiment, task_id)
    source: str                    # "sft_data" | "extra_data"
    shortened: int = 0             # exchanges dropped to fit max_length

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def is_success(row: dict) -> bool:
    return str(row["meta"].get("outcome", "")).strip().lower() == "success"


def turn_pairs(messages: list[dict]) -> list[tuple[list[dict], str]]:
    """One ``(prompt messages, answer)`` per assistant turn that follows a user message."""
    pairs = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and any(m["role"] == "user" for m in messages[:i]):
            pairs.append((messages[:i], message["content"]))
    return pairs


def shortened_prompts(prompt: list[dict]):
    """``(prompt, dropped exchanges)``, from the full prompt to the shortest one: the head (system messages and
    the first user message) + the rest with the oldest (assistant, user) exchanges dropped, always keeping the
    last user message. Roles still alternate after every drop."""
    first_user = next(i for i, m in enumerate(prompt) if m["role"] == "user")
    head, body = prompt[:first_user + 1], prompt[first_user + 1:]
    dropped = 0
    while True:
        yield head + body, dropped
        if len(body) < 4 or body[0]["role"] != "assistant":   # keep the last exchange
            return
        body = body[2:]
        dropped += 1


class ChatFormat:
    """Prompts as the policy sees them at play time (:func:`clemprm.play.chat.render_prompt`) and answers as the
    model must write them (the answer, then the template's end of turn)."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None, eos_token_ids=()):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.end_text = end_of_turn_text(tokenizer, self.kwargs, eos_token_ids)

    def render_prompt(self, messages: list[dict]) -> str:
        return render_prompt(self.tokenizer, messages, self.kwargs)

    def encode(self, prompt: list[dict], answer: str, max_length: int):
        """``(prompt ids, completion ids, exchanges dropped)`` that fit ``max_length``, or None."""
        completion_ids = self.tokenizer(answer + self.end_text, add_special_tokens=False)["input_ids"]
        for candidate, dropped in shortened_prompts(prompt):
            prompt_ids = self.tokenizer(self.render_prompt(candidate), add_special_tokens=False)["input_ids"]
            if len(prompt_ids) + len(completion_ids) <= max_length:
                return prompt_ids, completion_ids, dropped
        return None


def build_examples(rows: list[dict], chat: ChatFormat, max_length: int, source: str
                   ) -> tuple[list[Example], collections.Counter]:
    """The tokenised pairs of all rows, and per game how many pairs did not fit ``max_length`` even shortened."""
    examples, too_long = [], collections.Counter()
    for row in rows:
        meta = row["meta"]
        key = records.instance_key(meta.get("game"), meta.get("experiment"), meta.get("task_id"))
        for prompt, answer in turn_pairs(normalise(row["messages"])):
            encoded = chat.encode(prompt, answer, max_length)
            if encoded is None:
                too_long[key[0]] += 1
                continue
            prompt_ids, completion_ids, dropped = encoded
            examples.append(Example(prompt_ids, completion_ids, key, source, dropped))
    return examples, too_long


def pairs_by_game(examples: list[Example], too_long: collections.Counter) -> dict[str, dict[str, int]]:
    """Per game: its pairs ``kept`` (``shortened`` of them to fit) and ``dropped`` (too long even shortened)."""
    games = sorted({e.key[0] for e in examples} | set(too_long))
    kept = collections.Counter(e.key[0] for e in examples)
    shortened = collections.Counter(e.key[0] for e in examples if e.shortened)
    return {game: {"kept": kept[game], "shortened": shortened[game], "dropped": too_long[game]} for game in games}


def check_games_kept(by_game: dict[str, dict[str, int]], max_length: int, on_failure: str) -> list:
    """Fail the stage when a game lost every pair to ``sft.max_length`` (it is then not trained on at all), naming
    every such game; with ``on_failure: continue`` one mark per game."""
    lost = [game for game, counts in by_game.items() if counts["dropped"] and not counts["kept"]]
    if not lost:
        return []
    described = {game: f"{game} ({by_game[game]['dropped']} pairs)" for game in lost}
    advice = (f"too long for sft.max_length {max_length} even with the oldest exchanges dropped: raise sft.max_length "
              f"(these games' first prompts alone do not fit)")
    if on_failure == "stop":
        fail_or_warn("sft_adapter", f"every pair of {', '.join(described.values())} is {advice}", on_failure,
                     condition="game_lost_to_max_length")
    return [fail_or_warn("sft_adapter", f"every pair of {described[game]} is {advice}", on_failure,
                         condition="game_lost_to_max_length", game=game, count=by_game[game]["dropped"])
            for game in lost]


# ------------------------------------------------------------------------------------------ training


def _as_dataset(examples: list[Example]):
    from datasets import Dataset
    return Dataset.from_dict({
        "input_ids": [e.input_ids for e in examples],
        "completion_mask": [[0] * len(e.prompt_ids) + [1] * len(e.completion_ids) for e in examples],
    })


def _sft_config(sft: dict, seed: int, output_dir: str, device: str, dtype, has_validation: bool,
                tracking: TrackingRun):
    from trl import SFTConfig

    gradient_checkpointing = sft["gradient_checkpointing"]
    if gradient_checkpointing == "auto":
        gradient_checkpointing = device == "cuda"
    optimizer = sft["optimizer"] if sft["optimizer"] != "auto" else OPTIMIZER_AUTO[device]
    return SFTConfig(
        **trainer_arguments(sft, key="sft", seed=seed, output_dir=output_dir, device=device, dtype=dtype,
                            grad_accum=sft["grad_accum"], has_validation=has_validation, optimizer=optimizer,
                            gradient_checkpointing=gradient_checkpointing, weight_decay=sft["weight_decay"],
                            tracking=tracking),
        max_length=sft["max_length"], packing=False, completion_only_loss=True, assistant_only_loss=False)


def train_sft(settings: dict, data_path: str, adapter_dir: str, metrics_path: str,
              cache_dir: str | None = None, on_failure: str = "stop", tracking: TrackingRun = OFF) -> dict:
    """Fine-tune ``settings["model"]`` on the pairs of ``data_path`` (+ ``sft.extra_data``); write the adapter
    folder and the metrics JSON; return the metrics. ``settings`` is the rule's params: seed, model, sft;
    ``tracking``: the tracker run that gets every step's loss (:mod:`clemprm.tracking`).
    Without any win to learn from the stage fails (:mod:`clemprm.checks.run_time`), unless ``on_failure`` is
    continue: then the adapter is untrained and the metrics say so (``status``, and the stage's failure mark)."""
    import torch
    from peft import get_peft_model
    from transformers import EarlyStoppingCallback, PrinterCallback
    from trl import SFTTrainer

    from clemprm.models.loader import ModelConfig, load_tokenizer_and_model, resolve_dtype, resolve_quantization

    import datasets
    datasets.disable_progress_bars()   # the rule log gets LogProgress lines instead

    start = time.perf_counter()
    sft, seed = settings["sft"], int(settings["seed"])
    # data first (a bad file fails before a model is loaded): the pipeline's wins, in the interactions schema,
    # + optional public interactions (successful ones only)
    rows = {"sft_data": records.read_interactions(data_path, records.INTERACTIONS)}
    if sft.get("extra_data"):
        extra = records.read_interactions(sft["extra_data"])
        rows["extra_data"] = [row for row in extra if is_success(row)]
        log.info("extra data %s: %d of %d rows are successful episodes", sft["extra_data"], len(rows["extra_data"]),
                 len(extra))
    cfg = ModelConfig.from_dict({**settings["model"], "cache_dir": cache_dir})
    device = device_name()
    marks = check_not_empty("sft_adapter", "wins to fine-tune on", sum(map(len, rows.values())),
                            f"{len(rows['sft_data'])} player perspectives of won episodes in {data_path}, "
                            f"{len(rows.get('extra_data', []))} successful rows of sft.extra_data", on_failure,
                            condition="no_wins")
    tokenizer, model = load_tokenizer_and_model(cfg, for_training=True, task="causal-lm")
    if device == "cpu":
        keep_4bit_differentiable(model)
    chat = ChatFormat(tokenizer, cfg.chat_template_kwargs, end_token_ids(tokenizer, model.generation_config))
    examples, too_long_by_game = [], collections.Counter()
    for source, source_rows in rows.items():
        built, dropped = build_examples(source_rows, chat, sft["max_length"], source)
        examples += built
        too_long_by_game += dropped
    too_long = sum(too_long_by_game.values())
    by_game = pairs_by_game(examples, too_long_by_game)
    for game, counts in by_game.items():
        log.info("sft data of game %s: %d pairs kept (%d of them shortened), %d too long even shortened", game,
                 counts["kept"], counts["shortened"], counts["dropped"])
    validation_keys = split_instances([e.key for e in examples], sft["validation_fraction"], seed)
    train = [e for e in examples if e.key not in validation_keys]
    validation = [e for e in examples if e.key in validation_keys]
    if not marks:   # wins, but no pair to train on: every one too long for sft.max_length (validation never takes all)
        marks = check_not_empty("sft_adapter", "training examples", len(train),
                                f"{sum(map(len, rows.values()))} wins, {too_long} of them too long for sft.max_length "
                                f"{sft['max_length']} even shortened", on_failure, condition="no_training_examples")
    if not marks:   # some games fit, but one lost every pair: it would be missing from the policy without a word
        marks = check_games_kept(by_game, sft["max_length"], on_failure)
    available = len(train)
    train = sample_at_most(train, sft["max_examples"], seed)
    validation = sample_at_most(validation, sft["max_examples"], seed + 1)
    log.info("sft data: %d pairs (%d shortened, %d too long even shortened) from %s; train %d of %d pairs on "
             "%d instances, validation %d pairs on %d instances", len(examples), sum(e.shortened > 0 for e in examples),
             too_long, {k: len(v) for k, v in rows.items()}, len(train), available, len({e.key for e in train}),
             len(validation), len(validation_keys))

    metrics = {
        "model": {"spec": cfg.spec, "base_adapter": cfg.adapter, "device": device,
                  "quantization": resolve_quantization(cfg, device), "dtype": str(resolve_dtype(cfg, device))},
        "examples": {
            "train": len(train), "validation": len(validation), "train_available": available,
            "train_instances": len({e.key for e in train}), "validation_instances": len(validation_keys),
            "validation_instance_keys": ["/".join(key) for key in sorted(validation_keys)],
            "rows": {k: len(v) for k, v in rows.items()},
            "pairs_by_source": dict(collections.Counter(e.source for e in examples)),
            "train_by_game": dict(sorted(collections.Counter(e.key[0] for e in train).items())),
            "shortened": sum(e.shortened > 0 for e in examples), "dropped_too_long": too_long,
            "pairs_by_game": by_game},
        "tokens": {"train": sum(len(e) for e in train), "train_answer": sum(len(e.completion_ids) for e in train),
                   "validation": sum(len(e) for e in validation),
                   "max_sequence": max((len(e) for e in train + validation), default=0)},
        **marks_metadata(marks),
    }

    with shared_scratch_beside(adapter_dir) as scratch, tracker_environment(tracking):
        if not train:
            # nothing to learn from (e.g. a base policy without wins): an untrained adapter (LoRA B = 0) is
            # exactly the base policy, so downstream stages still run; the metrics say so.
            log.warning("sft: no training examples; writing an untrained adapter (identical to the base policy)")
            peft_model = model if cfg.adapter else get_peft_model(model, lora_config(sft["lora"], "CAUSAL_LM"))
            metrics.update(status="untrained: no training examples", steps=0, epochs_run=0, train_loss=None,
                           eval_loss=None, eval_token_accuracy=None, history=[])
        else:
            args = _sft_config(sft, seed, str(scratch / "checkpoints"), device, resolve_dtype(cfg, device),
                               has_validation=bool(validation), tracking=tracking)
            callbacks = [progress_callback()]
            if validation:
                callbacks.append(EarlyStoppingCallback(early_stopping_patience=sft["early_stopping_patience"]))
            trainer = stage_trainer(SFTTrainer)(
                model=model, args=args, train_dataset=_as_dataset(train),
                eval_dataset=_as_dataset(validation) if validation else None, processing_class=tokenizer,
                peft_config=None if cfg.adapter else lora_config(sft["lora"], "CAUSAL_LM"), callbacks=callbacks)
            trainer.remove_callback(PrinterCallback)   # progress goes to the log through LogProgress
            if device == "cpu":  # TRL casts QLoRA adapters to bf16: on CPU keep them fp32 (bf16 is slow there)
                for param in trainer.model.parameters():
                    if param.requires_grad and param.dtype != torch.float32:
                        param.data = param.data.float()
            before = trainable_snapshot(trainer.model)
            train_start = time.perf_counter()
            result = trainer.train()
            train_seconds = time.perf_counter() - train_start
            state = trainer.state
            rates = applied_learning_rates(trainer.lr_scheduler, state.global_step)
            untrained = untrained_reason(state.global_step, rates, changed_parameters(trainer.model, before))
            if untrained:   # the adapter is the base policy
                marks.append(fail_or_warn("sft_adapter", f"the adapter did not train: {untrained}", on_failure,
                                          condition="adapter_not_trained", count=state.global_step))
                metrics.update(marks_metadata(marks))
            initial, log_history = initial_evaluation(state.log_history)
            history = epoch_history(log_history, initial)
            evals = [row for row in history if row.get("eval_loss") is not None and row["epoch"] > 0]
            best = min(evals, key=lambda row: row["eval_loss"]) if evals else (history[-1] if history else {})
            last_step = next((e for e in reversed(state.log_history) if "num_tokens" in e), {})
            metrics.update(
                status=f"untrained: {untrained}" if untrained else "trained", steps=state.global_step,
                learning_rates={"min": min(rates), "max": max(rates)} if rates else None,
                epochs_run=round(state.epoch or 0.0, 4),
                max_epochs=sft["epochs"], stopped_early=bool(validation) and (state.epoch or 0) < sft["epochs"] - 1e-6,
                best_epoch=best.get("epoch"), train_loss=finite(result.training_loss),
                final_train_loss=history[-1].get("train_loss") if history else None,
                eval_loss=best.get("eval_loss"), eval_token_accuracy=best.get("eval_token_accuracy"),
                initial_eval_loss=finite(initial["eval_loss"]) if initial else None,
                initial_eval_token_accuracy=finite(initial.get("eval_mean_token_accuracy")) if initial else None,
                history=history, optimizer=args.optim if isinstance(args.optim, str) else str(args.optim.value),
                bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing,
                train_seconds=round(train_seconds, 2))
            metrics["tokens"]["processed"] = last_step.get("num_tokens")
            peft_model = trainer.model
        write_adapter(peft_model, cfg.spec, adapter_dir)
    finish_metrics(metrics, start, settings, metrics_path)
    write_adapter_card("sft", adapter_dir, metrics)   # after finish_metrics: the final metrics
    log.info("sft: %s in %.0f s; %s steps, train loss %s, eval loss %s -> %s (token accuracy %s -> %s); adapter %s",
             metrics["status"], metrics["seconds"], metrics.get("steps"), metrics.get("train_loss"),
             metrics.get("initial_eval_loss"), metrics.get("eval_loss"), metrics.get("initial_eval_token_accuracy"),
             metrics.get("eval_token_accuracy"), adapter_dir)
    return metrics


