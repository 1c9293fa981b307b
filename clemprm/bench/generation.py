"""clemprm's batched generation against plain HF ``model.generate`` (same model, same settings): tokens/s.

Reports, per batch size, generated tokens/s of HF generate and of ``PolicyModel.generate`` measured side by
side (interleaved runs, ``--repeat`` of each), their ratio per repeat, and a greedy check that both pick exactly
the same tokens. Two workloads:

* fixed: every row generates exactly ``--new-tokens`` tokens (end tokens suppressed, HF ``min_new_tokens``),
  so both do the same number of forward passes: the pure decoding speed;
* natural: rows stop at their end token (HF keeps computing finished rows; clemprm drops them).

Default: the embedded SmolLM2 at 2 threads, sampling with temperature 0.7 and top-p 0.9 (HF's default top-k 50
on both sides), prompts of ~67 tokens, 32 new tokens. ``--tiny`` adds the tiny random model. The old script
reported the best of its repeats: the table's max for tokens/s.

    python -m clemprm.bench generation                 # SmolLM2, batch 1, 8, 32
    python -m clemprm.bench generation --tiny --no-main --batch-sizes 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from clemprm.bench import Figures
from clemprm.models.generation import PolicyModel
from clemprm.models.loader import ModelConfig
from clemprm.models.sampling import SamplingParams

REPEATS_ITSELF = True

TOPICS = ["apple", "river", "chair", "garden", "winter", "window", "rocket", "violin", "castle", "pencil",
          "orange", "forest", "bridge", "candle", "dragon", "island", "jacket", "kettle", "ladder", "mirror",
          "needle", "pillow", "rabbit", "saddle", "tomato", "trumpet", "valley", "wallet", "yogurt", "zebra",
          "anchor", "basket", "cactus", "donkey", "engine", "falcon", "guitar", "helmet", "igloo", "jungle"]


def make_prompts(n: int, target_tokens: int, policy: PolicyModel) -> list[list[dict]]:
    """``n`` distinct user messages whose rendered prompts have about ``target_tokens`` tokens."""
    perspectives = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        words = (f"We play a guessing game, round {i + 1}. I think of a number from 1 to {10 + i}. The hint is "
                 f"the word {topic}. Answer with GUESS: and a number, then explain your choice about the "
                 f"{topic} in one short sentence. Remember the rules of the game and be brief please, "
                 f"the {topic} game starts now and lasts for four turns").split()
        messages = [{"role": "user", "content": ""}]
        for k in range(1, len(words) + 1):
            messages[0]["content"] = " ".join(words[:k])
            if len(policy.tokenizer(policy.render(messages), add_special_tokens=False)["input_ids"]) >= target_tokens:
                break
        perspectives.append(messages)
    return perspectives


def hf_generate(policy: PolicyModel, perspectives, params: SamplingParams, seed: int):
    """Plain HF generate, as clemcore's HF backend calls it: left padding, attention mask, one call."""
    tok, model = policy.tokenizer, policy.model
    texts = [policy.render(m) for m in perspectives]
    side = tok.padding_side
    tok.padding_side = "left"
    enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(model.device)
    tok.padding_side = side
    kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=tok.pad_token_id)
    if params.min_new_tokens:
        kwargs["min_new_tokens"] = params.min_new_tokens
    if params.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs)
    eos = set(policy.decoder.eos)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def ours_generate(policy: PolicyModel, perspectives, params: SamplingParams, seed: int):
    prompts = [policy.tokenizer(policy.render(m), add_special_tokens=False)["input_ids"] for m in perspectives]
    seeds = [seed * 1000 + i for i in range(len(prompts))]
    policy.decoder.forget_conversations()  # cold, like HF: no conversation state kept from an earlier run
    return [ids for ids, _ in policy.decoder.generate(prompts, params, seeds, token_budget=policy.cfg.token_budget)]


def timed(fn, *args):
    start = time.perf_counter()
    rows = fn(*args)
    return time.perf_counter() - start, sum(len(r) for r in rows), rows


def bench_model(policy: PolicyModel, batch_sizes, args, figures: Figures) -> None:
    prompts_all = make_prompts(max(batch_sizes), args.prompt_tokens, policy)
    lengths = [len(policy.tokenizer(policy.render(m), add_special_tokens=False)["input_ids"]) for m in prompts_all]
    name = policy.name
    figures.note(f"{name}: {sum(p.numel() for p in policy.model.parameters()) / 1e6:.1f}M params, "
                 f"{torch.get_num_threads()} threads, prompts {min(lengths)}-{max(lengths)} tokens "
                 f"(mean {statistics.mean(lengths):.0f}), {args.new_tokens} new tokens, "
                 f"T={args.temperature} top_p={args.top_p} top_k={args.top_k}, {args.repeat} interleaved runs")
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_new_tokens=args.new_tokens)
    fixed = SamplingParams(**{**sampling.__dict__, "min_new_tokens": args.new_tokens})
    # warm up both paths (first calls allocate, load kernels)
    hf_generate(policy, prompts_all[:2], SamplingParams(0.0, max_new_tokens=2), 0)
    ours_generate(policy, prompts_all[:2], SamplingParams(0.0, max_new_tokens=2), 0)
    for batch in batch_sizes:
        perspectives = prompts_all[:batch]
        for label, params in (("fixed", fixed), ("natural", sampling)):
            if label == "natural" and not args.natural:
                continue
            row = f"{name} batch {batch} {label}"
            for rep in range(args.repeat):
                t, n, _ = timed(hf_generate, policy, perspectives, params, rep)
                figures.add(f"{row}: HF", n / t, "tokens/s")
                t, n, _ = timed(ours_generate, policy, perspectives, params, rep)
                figures.add(f"{row}: ours", n / t, "tokens/s")
            figures.ratio(f"{row}: ours / HF", f"{row}: ours", f"{row}: HF")
    if args.ablation:  # what each optimisation of the decoder is worth (largest batch, fixed workload)
        from clemprm.models import decode_attention, decoder
        batch = max(batch_sizes)
        settings = {"all optimisations": (True, decoder.MIN_SHARED_PREFIX),
                    "no shared-prefix prefill": (True, 10**9),
                    "no fast decode attention": (False, decoder.MIN_SHARED_PREFIX),
                    "neither": (False, 10**9)}
        saved = decode_attention.FAST_DECODE_ATTENTION, decoder.MIN_SHARED_PREFIX
        try:
            for rep in range(args.repeat):
                for setting, (fast, min_prefix) in settings.items():
                    decode_attention.FAST_DECODE_ATTENTION, decoder.MIN_SHARED_PREFIX = fast, min_prefix
                    t, n, _ = timed(ours_generate, policy, prompts_all[:batch], fixed, rep)
                    figures.add(f"{name} ablation batch {batch} fixed: {setting}", n / t, "tokens/s")
        finally:
            decode_attention.FAST_DECODE_ATTENTION, decoder.MIN_SHARED_PREFIX = saved
    # greedy: exactly the same tokens as HF generate (batched, left padded)
    batch = min(args.greedy_batch, len(prompts_all))
    greedy = SamplingParams(0.0, max_new_tokens=args.new_tokens)
    t_hf, n_hf, hf_rows = timed(hf_generate, policy, prompts_all[:batch], greedy, 0)
    t_ours, n_ours, our_rows = timed(ours_generate, policy, prompts_all[:batch], greedy, 0)
    same = sum(a == b for a, b in zip(hf_rows, our_rows))
    figures.note(f"{name} greedy batch {batch}: identical tokens in {same}/{batch} rows "
                 f"(HF {n_hf / t_hf:.1f} tok/s, ours {n_ours / t_ours:.1f} tok/s)")
    sample = policy.generate(prompts_all[:1], temperature=0.0, max_new_tokens=args.new_tokens)[0]
    figures.note(f"{name} example answer: {sample.text!r}")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--tiny", action="store_true", help="also benchmark tiny:0")
    parser.add_argument("--no-main", action="store_true", help="skip --model (with --tiny: the tiny model only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=67)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=50, help="HF generate's default is 50; 0 = off")
    parser.add_argument("--greedy-batch", type=int, default=32)
    parser.add_argument("--natural", action=argparse.BooleanOptionalAction, default=True,
                        help="also time rows that stop at their end token")
    parser.add_argument("--ablation", action="store_true", help="time the decoder without each optimisation")
    parser.add_argument("--cache-dir", default=None)
    parser.set_defaults(repeat=2)


def run(args) -> Figures:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    specs = ([] if args.no_main else [args.model]) + (["tiny:0"] if args.tiny else [])
    figures = Figures("generation")
    for spec in specs:
        start = time.perf_counter()
        policy = PolicyModel(ModelConfig(spec=spec, threads=args.threads, cache_dir=args.cache_dir))
        figures.note(f"loaded {spec} in {time.perf_counter() - start:.1f} s")
        bench_model(policy, batch_sizes, args, figures)
    return figures
