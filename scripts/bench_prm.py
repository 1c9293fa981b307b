"""Benchmark PRM scoring: length-sorted micro-batches under a token budget vs one pair at a time (same scorer).

Prints pairs/s (and tokens/s) of ``PRMScorer.score`` on all pairs at once and on one pair per call, measured side
by side (interleaved runs, the best of ``--repeats``), their ratio, and the largest score difference between the
two (batching must not change a score). The pairs look like branch points of the built-in games: a game prompt,
0-3 earlier exchanges (``--max-exchanges``), a short candidate answer (about 60-200 tokens).

Default: the tiny model (``tiny:0``) at 1 thread; ``--smollm2`` adds the embedded SmolLM2 (fewer pairs).
On CPU a long pair is already a large matrix product, and the tiny Qwen3.5's Gated-DeltaNet layers run
transformers' reference PyTorch kernel, whose cost grows with batch x length: batching gains most on short pairs
and on GPUs.
``--adapter DIR`` scores with a trained PRM adapter (the scores, not the speed, depend on it).

    python scripts/bench_prm.py
    python scripts/bench_prm.py --smollm2 --pairs 128
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from clemprm.models import ModelConfig  # noqa: E402
from clemprm.prm import PRMScorer, encode_pair  # noqa: E402

FEEDBACK = ["Your guess is too low. The number is higher.", "Your guess is too high. The number is lower.",
            "That is not a valid answer. Please answer with GUESS: and a number.", "Wrong word. Try again."]


def make_pairs(n: int, max_exchanges: int, seed: int = 0) -> list[tuple[list[dict], str]]:
    """``n`` branch-point-like pairs with 0 to ``max_exchanges`` earlier exchanges each."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        prefix = [{"role": "user", "content": f"Let us play a game, round {i}. I am thinking of a number from 1 to "
                                              f"{10 + i % 90}. Answer with GUESS: followed by a number."}]
        for turn in range(rng.randint(0, max_exchanges)):
            prefix += [{"role": "assistant", "content": f"GUESS: {rng.randint(1, 100)}"},
                       {"role": "user", "content": " ".join(rng.choices(FEEDBACK, k=rng.randint(1, 3)))}]
        pairs.append((prefix, f"GUESS: {rng.randint(1, 100)}" + " because it is halfway" * rng.randint(0, 2)))
    return pairs


def timed(fn, pairs) -> tuple[float, list[float]]:
    start = time.perf_counter()
    scores = fn(pairs)
    return time.perf_counter() - start, scores


def bench_model(scorer: PRMScorer, args, n_pairs: int) -> None:
    import torch

    pairs = make_pairs(n_pairs, args.max_exchanges)
    lengths = [len(encode_pair(scorer.tokenizer, prefix, candidate, scorer.cfg.chat_template_kwargs,
                               scorer.max_length)[0]) for prefix, candidate in pairs]
    tokens = sum(lengths)
    print(f"\n== {scorer.cfg.short_name}: {sum(p.numel() for p in scorer.model.parameters()) / 1e6:.1f}M params, "
          f"{torch.get_num_threads()} threads, {n_pairs} pairs of {min(lengths)}-{max(lengths)} tokens "
          f"(mean {statistics.mean(lengths):.0f}), token budget {scorer.token_budget}, "
          f"best of {args.repeats} interleaved runs")
    one_by_one = lambda ps: [scorer.score([pair])[0] for pair in ps]   # noqa: E731
    scorer.score(pairs[:4])          # warm up (first calls allocate, load kernels)
    batched_runs, single_runs = [], []
    for _ in range(args.repeats):
        batched_runs.append(timed(scorer.score, pairs))
        single_runs.append(timed(one_by_one, pairs))
    batched = min(t for t, _ in batched_runs)
    single = min(t for t, _ in single_runs)
    difference = max(abs(a - b) for a, b in zip(batched_runs[0][1], single_runs[0][1]))
    print(f"{'mode':<28} | {'pairs/s':>8} {'tokens/s':>9}")
    print(f"{'batched, length-sorted':<28} | {n_pairs / batched:8.1f} {tokens / batched:9.0f}")
    print(f"{'one pair at a time':<28} | {n_pairs / single:8.1f} {tokens / single:9.0f}")
    print(f"ratio batched / one at a time: {single / batched:.2f}x; largest score difference {difference:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=256, help="pairs scored per run (tiny model)")
    parser.add_argument("--smollm2", action="store_true", help="also benchmark embedded:smollm2-135m-instruct")
    parser.add_argument("--smollm2-pairs", type=int, default=64)
    parser.add_argument("--adapter", default=None, help="a trained PRM adapter folder (for the first model)")
    parser.add_argument("--max-exchanges", type=int, default=3,
                        help="earlier (answer, feedback) exchanges per prefix: 0 to this many (built-in games: 0-3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (on a busy 2-core machine 2 threads slow small batches down most)")
    parser.add_argument("--token-budget", type=int, default=2048,
                        help="padded tokens per forward pass (prm.score_batch_tokens)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    runs = [("tiny:0", args.pairs)] + ([("embedded:smollm2-135m-instruct", args.smollm2_pairs)] if args.smollm2 else [])
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(the machine has {os.cpu_count()} cores; other processes distort absolute figures, less so ratios)")
    for i, (spec, n_pairs) in enumerate(runs):
        start = time.perf_counter()
        cfg = ModelConfig(spec=spec, threads=args.threads, cache_dir=args.cache_dir,
                          adapter=args.adapter if i == 0 else None)
        scorer = PRMScorer(cfg, max_length=args.max_length, token_budget=args.token_budget)
        print(f"loaded {spec} in {time.perf_counter() - start:.1f} s")
        bench_model(scorer, args, n_pairs)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
