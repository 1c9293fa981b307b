"""The merge on the embedded SmolLM2 (tied embeddings): an SFT LoRA that includes lm_head, merged and verified.

    python -m clemprm.bench merge                      # 6 training steps, 3 verification examples of up to 768 tokens
    python -m clemprm.bench merge --steps 4 --workdir /tmp/bench-merge
    python -m clemprm.bench merge --adapter /tmp/bench-merge/adapter   # the merge of an adapter trained before

The adapter is trained, not drawn: a LoRA as the SFT stage makes it (``sft.lora``: r 16, alpha 32, dropout 0.05) on
all linear layers + ``lm_head``, a few AdamW steps (raised learning rate, so that a few steps move the logits) on
the SFT stage's own prompt/answer pairs (``clemprm.stages.sft.build_examples``, loss on the answers) of synthetic
guessnumber dialogues (binary search over 1-1000, about ten turns, so the held-out pairs are hundreds of tokens
long). A plain training loop, not TRL: TRL 1.16's SFTTrainer refuses a LoRA on lm_head (its fused LM head reads
``lm_head.weight`` directly, so the adapter would never be trained). Then ``clemprm.stages.merge.merge_and_verify`` (the
``merge`` rule's code) merges it in a fresh process (so its peak RSS is the merge's own) and writes
``verification.json`` (in ``--workdir``): the correct merge (fp32, untied lm_head), the adapter's own effect, and
the two contrasts (a
bf16 merge; PEFT's ``merge_and_unload()``, which writes the lm_head delta into the shared embedding). Reports merge
time, peak memory and the verification table.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from pathlib import Path

from clemprm.bench import Figures

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
HIGHEST = 1000
SYSTEM = (f"You are playing a number guessing game. I have picked a whole number between 1 and {HIGHEST}. After "
          "each of your guesses I tell you whether my number is higher or lower than your guess. Find it in as few "
          "guesses as you can. Answer with GUESS: followed by one number and nothing else.")


def guessnumber_dialogue(target: int) -> list[dict]:
    """A won game: binary search over 1-HIGHEST, the feedback as the game master words it."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Let us start. What is your first guess?"}]
    low, high = 1, HIGHEST
    while True:
        guess = (low + high) // 2
        messages.append({"role": "assistant", "content": f"GUESS: {guess}"})
        if guess == target:
            messages.append({"role": "user", "content": f"Correct, my number was {target}. Well done!"})
            return messages[:-1]
        if guess < target:
            low = guess + 1
            feedback = f"My number is higher than {guess}. It lies between {low} and {high}. Your next guess?"
        else:
            high = guess - 1
            feedback = f"My number is lower than {guess}. It lies between {low} and {high}. Your next guess?"
        messages.append({"role": "user", "content": feedback})


def write_sft_data(path: Path, instances: int) -> None:
    rows = [{"messages": guessnumber_dialogue(1 + (367 * i) % HIGHEST),
             "meta": {"game": "guessnumber", "experiment": "bench", "task_id": i, "player_name": "Player 1",
                      "game_role": "Guesser", "model": "bench", "outcome": "success"}} for i in range(instances)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _child(function, log_file, *args):
    logging.basicConfig(level=logging.INFO, filename=log_file, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    function(*args)


def run_in_child(function, log_file, *args) -> float:
    """Run ``function(*args)`` in a fresh process (its own peak RSS); wall seconds."""
    start = time.perf_counter()
    process = multiprocessing.get_context("spawn").Process(target=_child, args=(function, log_file, *args))
    process.start()
    process.join()
    if process.exitcode:
        raise SystemExit(f"child failed ({process.exitcode}); see {log_file}")
    return time.perf_counter() - start


def train_adapter(config: dict, data: Path, adapter_dir: Path, steps: int, lr: float) -> dict:
    """A few AdamW steps of an SFT LoRA (``config["sft"]["lora"]``) on the train side of the SFT pairs of ``data``."""
    import torch
    from peft import get_peft_model

    from clemprm.records import read_interactions
    from clemprm.models.loader import ModelConfig, load_tokenizer_and_model
    from clemprm.models.scoring import pad_right
    from clemprm.stages import sft
    from clemprm.training import lora_config, sample_at_most, split_instances, write_adapter

    cfg = ModelConfig.from_dict({**config["model"], "cache_dir": config["cache_dir"]})
    tokenizer, model = load_tokenizer_and_model(cfg, for_training=True)
    torch.manual_seed(config["seed"])
    model = get_peft_model(model, lora_config(config["sft"]["lora"], "CAUSAL_LM"))
    chat = sft.ChatFormat(tokenizer, cfg.chat_template_kwargs, [tokenizer.eos_token_id])
    examples, _ = sft.build_examples(read_interactions(data), chat, config["sft"]["max_length"], "sft_data")
    held_out = split_instances([e.key for e in examples], config["sft"]["validation_fraction"], config["seed"])
    train = sample_at_most([e for e in examples if e.key not in held_out], 2 * steps, config["seed"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    start, losses = time.perf_counter(), []
    for step in range(steps):
        batch = train[2 * step:2 * step + 2]
        input_ids, attention_mask = pad_right([e.input_ids for e in batch], tokenizer.pad_token_id)
        labels = torch.full_like(input_ids, -100)
        for row, e in enumerate(batch):   # the loss on the answers only, as the SFT stage
            labels[row, len(e.prompt_ids):len(e)] = torch.tensor(e.completion_ids)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(float(loss.detach()), 3))
    write_adapter(model, cfg.spec, adapter_dir)
    return {"steps": steps, "losses": losses, "seconds": time.perf_counter() - start}


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=6, help="training steps of 2 pairs")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--examples", type=int, default=3, help="verification examples")
    parser.add_argument("--max-tokens", type=int, default=768, help="tokens per verification example at most")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--adapter", default=None, help="merge this adapter (trained by an earlier run) instead")


def run(args) -> Figures:
    from clemprm.config import load_config
    from clemprm.stages import merge

    out = args.workdir
    data = out / "sft_data.jsonl"
    write_sft_data(data, 20)
    config = load_config(overrides={
        "model": {"threads": args.threads}, "sft": {"validation_fraction": 0.25, "lora": {"target_modules": TARGETS}},
        "merge": {"examples": args.examples, "max_tokens": args.max_tokens}})
    lora = config["sft"]["lora"]
    figures = Figures("merge")

    adapter = Path(args.adapter) if args.adapter else out / "adapter"
    if not args.adapter:
        trained = train_adapter(config, data, adapter, args.steps, args.lr)
        figures.note(f"LoRA r {lora['r']}, alpha {lora['alpha']} on {', '.join(TARGETS)}: {trained['steps']} AdamW "
                     f"steps of 2 pairs at lr {args.lr:g}, answer loss {trained['losses']}, {trained['seconds']:.0f} s")

    merge_seconds = run_in_child(merge.merge_and_verify, str(out / "merge.log"), "sft", "causal-lm",
                                 merge.merge_params(config, "causal-lm"), str(adapter), str(data),
                                 str(out / "merged"), config["cache_dir"])
    verification = json.loads((out / "merged" / "verification.json").read_text())
    figures.add("load + merge + save", verification["seconds"]["merge"], "s")
    figures.add("merge peak RSS", verification["peak_memory_mb"]["merge"]["rss"], "MB")
    figures.add("with verification and contrasts", verification["seconds"]["total"], "s")
    figures.add("total peak RSS", verification["peak_memory_mb"]["total"]["rss"], "MB")
    figures.add("merge process", merge_seconds, "s")
    figures.note(f"merge of embedded SmolLM2-135M, fp32, untied {verification['untied']}")
    figures.note(f"verification on {verification['examples']['n']} {verification['examples']['source']} examples of "
                 f"{verification['examples']['tokens']} tokens; reference logits up to "
                 f"{verification['merged']['max_abs_reference_logit']:.1f}; passed: {verification['passed']}")
    figures.note(merge.verification_table(verification))
    return figures
