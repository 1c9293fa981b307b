"""PRM scoring three ways: one pair at a time, batched, and batched with shared prefixes (same model); training.

Two workloads, each scored (a) one pair per call, (b) all at once in length-sorted micro-batches under a token
budget, every pair in full (``share_prefixes=False``), (c) all at once with the token prefix common to a prefix's
candidates computed once (the default). Reports pairs/s and tokens/s (interleaved runs, ``--repeat`` of each),
the ratios c/a and b/a per repeat, and the largest score difference of b and c from a (neither may change a score).

``best-of-N``: ``--prefixes`` prefixes with ``--candidates`` candidates of different lengths each, as best-of-N and
beam search score them. ``mixed``: pairs with prefixes of their own (nothing to share), as the PRM's training and
evaluation sides look. A prefix looks like a branch point of the built-in games: a game prompt, 0-3 earlier
exchanges (``--max-exchanges``); a candidate is a short answer (about 60-230 tokens a pair).

Default: the tiny model (``tiny:0``) at 2 threads (as config.yaml); ``--smollm2`` adds the embedded SmolLM2
(fewer pairs).
On CPU a long pair is already a large matrix product, and the tiny Qwen3.5's Gated-DeltaNet layers (even with
clemprm.models.gated_delta's kernel) cost about the same per token at any batch size: batching alone gains most on short
pairs and on GPUs, sharing gains on every device in proportion to the prefix tokens it skips.
``--adapter DIR`` scores with a trained PRM adapter (the scores, not the speed, depend on it).

``--training LABELS`` times the PRM's training step instead, on the sibling groups of a soft-labels file (a
pipeline's ``results/labels/soft_labels.parquet``: real perspectives), micro-batches of ``prm.batch_size`` states as
the stage makes them with ``prm.pairwise_weight`` > 0: forward and backward of the loss with every pair in full
against the siblings on their shared prefix (:func:`clemprm.models.scoring.logits_sharing_prefixes`), interleaved,
on a fresh LoRA of config.yaml's ``prm.lora`` (dropout off, so both compute the same loss).

    python -m clemprm.bench prm
    python -m clemprm.bench prm --smollm2
    python -m clemprm.bench prm --training runs/learning/seed-11/results/labels/soft_labels.parquet --batches 6
"""

from __future__ import annotations

import random
import statistics
import time

from clemprm.bench import Figures
from clemprm.models.loader import ModelConfig
from clemprm.models.prm import PRMScorer, encode_pair
from clemprm.play.contract import Pair

REPEATS_ITSELF = True

FEEDBACK = ["Your guess is too low. The number is higher.", "Your guess is too high. The number is lower.",
            "That is not a valid answer. Please answer with GUESS: and a number.", "Wrong word. Try again."]


def make_prefix(i: int, rng: random.Random, max_exchanges: int) -> list[dict]:
    """A game prompt and 0 to ``max_exchanges`` earlier (answer, feedback) exchanges."""
    prefix = [{"role": "user", "content": f"Let us play a game, round {i}. I am thinking of a number from 1 to "
                                          f"{10 + i % 90}. Answer with GUESS: followed by a number."}]
    for _ in range(rng.randint(0, max_exchanges)):
        prefix += [{"role": "assistant", "content": f"GUESS: {rng.randint(1, 100)}"},
                   {"role": "user", "content": " ".join(rng.choices(FEEDBACK, k=rng.randint(1, 3)))}]
    return prefix


def make_candidate(rng: random.Random) -> str:
    return f"GUESS: {rng.randint(1, 100)}" + " because it is halfway" * rng.randint(0, 2)


def make_pairs(n: int, max_exchanges: int, seed: int = 0) -> list[Pair]:
    """``n`` pairs, each with a prefix of its own and the game's reply."""
    rng = random.Random(seed)
    return [Pair(make_prefix(i, rng, max_exchanges), make_candidate(rng), rng.choice(FEEDBACK), True)
            for i in range(n)]


def make_best_of_n(n_prefixes: int, n_candidates: int, max_exchanges: int, seed: int = 0) -> list[Pair]:
    """``n_candidates`` candidates of different lengths for each of ``n_prefixes`` prefixes, in order."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n_prefixes):
        prefix = make_prefix(i, rng, max_exchanges)
        pairs += [Pair(prefix, make_candidate(rng) + " and then" * k, rng.choice(FEEDBACK), True)
                  for k in range(n_candidates)]
    return pairs


def timed(fn, pairs) -> tuple[float, list[float]]:
    start = time.perf_counter()
    scores = fn(pairs)
    return time.perf_counter() - start, scores


def bench_workload(name: str, pairs, shared: PRMScorer, full: PRMScorer, repeats: int, figures: Figures) -> None:
    """The three ways on ``pairs``, interleaved, ``repeats`` runs each."""
    lengths = [len(encode_pair(full.tokenizer, pair.perspective, pair.candidate, pair.reply,
                               full.cfg.chat_template_kwargs, full.max_length)[0]) for pair in pairs]
    tokens = sum(lengths)
    ways = {"(a) one pair at a time": lambda ps: [full.score([pair])[0] for pair in ps],
            "(b) batched, length-sorted": full.score,
            "(c) batched, shared prefixes": shared.score}
    scores = {}
    before = shared.stats.shared_tokens
    row = f"{shared.cfg.short_name} {name}"
    for _ in range(repeats):
        for way, fn in ways.items():
            seconds, scores[way] = timed(fn, pairs)
            figures.add(f"{row} {way}", len(pairs) / seconds, "pairs/s")
    skipped = (shared.stats.shared_tokens - before) / repeats
    figures.note(f"{row}: {len(pairs)} pairs of {min(lengths)}-{max(lengths)} tokens (mean "
                 f"{statistics.mean(lengths):.0f}, {tokens} in all); shared prefixes skip {skipped:.0f} tokens "
                 f"({skipped / tokens:.0%}); tokens/s = pairs/s x {tokens / len(pairs):.1f}")
    for way in list(ways)[1:]:
        figures.ratio(f"{row} {way[:3]} vs (a)", f"{row} {way}", f"{row} (a) one pair at a time")
        difference = max(abs(x - y) for x, y in zip(scores[way], scores["(a) one pair at a time"]))
        figures.note(f"{row} {way[:3]}: max |score - (a)| {difference:.2e}")


def bench_model(shared: PRMScorer, args, n_prefixes: int, n_mixed: int, figures: Figures) -> None:
    import torch

    full = PRMScorer(shared.cfg, input=shared.input, max_length=shared.max_length,
                     token_budget=shared.token_budget, tokenizer=shared.tokenizer, model=shared.model,
                     share_prefixes=False)
    figures.note(f"{shared.cfg.short_name}: {sum(p.numel() for p in shared.model.parameters()) / 1e6:.1f}M params, "
                 f"{torch.get_num_threads()} threads, token budget {shared.token_budget}, {args.repeat} "
                 f"interleaved runs; prefix sharing {'on' if shared.share_prefixes else 'unsupported: (c) = (b)'}")
    best_of_n = make_best_of_n(n_prefixes, args.candidates, args.max_exchanges)
    shared.score(best_of_n[:8])            # warm up (first calls allocate, load kernels)
    full.score(best_of_n[:8])
    bench_workload(f"best-of-{args.candidates}", best_of_n, shared, full, args.repeat, figures)
    bench_workload("mixed", make_pairs(n_mixed, args.max_exchanges), shared, full, args.repeat, figures)


def bench_training(args, figures: Figures) -> None:
    """Seconds per training micro-batch (forward + backward), every pair in full vs siblings on a shared prefix."""
    import torch
    from peft import get_peft_model

    from clemprm.config import load_config
    from clemprm.models.loader import load_tokenizer_and_model
    from clemprm.models.scoring import logits_sharing_prefixes, pad_right
    from clemprm.stages import prm, prm_data
    from clemprm.training import lora_config

    settings = load_config()["prm"]
    cfg = ModelConfig(spec=args.training_model, threads=args.threads, cache_dir=args.cache_dir)
    tokenizer, model = load_tokenizer_and_model(cfg, for_training=True, task="seq-cls")
    model = get_peft_model(model, lora_config({**settings["lora"], "dropout": 0.0}, "SEQ_CLS"))
    examples = prm_data.build_examples(prm_data.read_labels(args.training), tokenizer, cfg.chat_template_kwargs,
                                       settings["max_length"])
    states = [group for group in prm_data.sibling_groups(examples) if len(group) > 1]
    batches = [states[i:i + settings["batch_size"]] for i in range(0, len(states), settings["batch_size"])]
    batches = random.Random(0).sample(batches, min(args.batches, len(batches)))
    figures.note(f"{cfg.short_name} training step, {torch.get_num_threads()} threads: {len(examples)} pairs in "
                 f"{len(states)} states with siblings; {len(batches)} micro-batches of {settings['batch_size']} states")

    def step(batch, shared: bool) -> tuple[float, float]:
        pairs = [example for state in batch for example in state]
        input_ids, attention_mask = pad_right([e.input_ids for e in pairs], tokenizer.pad_token_id)
        groups = torch.tensor([k for k, state in enumerate(batch) for _ in state])
        start = time.perf_counter()
        logits = (logits_sharing_prefixes(model, input_ids, attention_mask, groups.tolist(), tokenizer.pad_token_id)
                  if shared else model(input_ids=input_ids, attention_mask=attention_mask).logits)
        loss = prm.prm_loss(logits.squeeze(-1).float(), torch.tensor([e.label for e in pairs]), groups, "bce", 1.0)
        loss.backward()
        model.zero_grad()
        return time.perf_counter() - start, loss.item()

    step(batches[0], True)   # warm up
    tokens = sum(len(e.input_ids) for batch in batches for state in batch for e in state)
    gap = 0.0
    for _ in range(args.repeat):
        seconds = {"full": 0.0, "shared": 0.0}
        for batch in batches:
            (full_s, full_loss), (shared_s, shared_loss) = step(batch, False), step(batch, True)
            seconds["full"] += full_s
            seconds["shared"] += shared_s
            gap = max(gap, abs(full_loss - shared_loss))
        figures.add("every pair in full", seconds["full"] / len(batches), "s/micro-batch")
        figures.add("siblings on a shared prefix", seconds["shared"] / len(batches), "s/micro-batch")
    figures.ratio("full / shared", "every pair in full", "siblings on a shared prefix")
    figures.note(f"{tokens} tokens per repeat (tokens/s = tokens / (s/micro-batch x {len(batches)})); largest loss "
                 f"difference {gap:.1e}")


def add_arguments(parser) -> None:
    parser.add_argument("--prefixes", type=int, default=64, help="best-of-N prefixes (tiny model)")
    parser.add_argument("--candidates", type=int, default=4, help="candidates per best-of-N prefix")
    parser.add_argument("--pairs", type=int, default=256, help="mixed pairs (tiny model)")
    parser.add_argument("--smollm2", action="store_true", help="also benchmark embedded:smollm2-135m-instruct")
    parser.add_argument("--smollm2-prefixes", type=int, default=16)
    parser.add_argument("--smollm2-pairs", type=int, default=64)
    parser.add_argument("--adapter", default=None, help="a trained PRM adapter folder (for the first model)")
    parser.add_argument("--max-exchanges", type=int, default=3,
                        help="earlier (answer, feedback) exchanges per prefix: 0 to this many (built-in games: 0-3)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (default: config.yaml's model.threads; on a busy machine use 1)")
    parser.add_argument("--token-budget", type=int, default=2048,
                        help="padded tokens per forward pass (prm.score_batch_tokens)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--training", default=None, metavar="SOFT_LABELS",
                        help="time the PRM's training step on this soft-labels file instead of scoring")
    parser.add_argument("--training-model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, default=6, help="training micro-batches timed (--training)")
    parser.set_defaults(repeat=2)


def run(args) -> Figures:
    figures = Figures("prm")
    if args.training:
        bench_training(args, figures)
        return figures
    runs = [("tiny:0", args.prefixes, args.pairs)]
    if args.smollm2:
        runs.append(("embedded:smollm2-135m-instruct", args.smollm2_prefixes, args.smollm2_pairs))
    for i, (spec, n_prefixes, n_mixed) in enumerate(runs):
        start = time.perf_counter()
        cfg = ModelConfig(spec=spec, threads=args.threads, cache_dir=args.cache_dir,
                          adapter=args.adapter if i == 0 else None)
        # the workload of a lookahead search: each pair with the game's reply (the longest text a PRM reads)
        scorer = PRMScorer(cfg, input="candidate_with_reply", max_length=args.max_length,
                           token_budget=args.token_budget)
        figures.note(f"loaded {spec} in {time.perf_counter() - start:.1f} s")
        bench_model(scorer, args, n_prefixes, n_mixed, figures)
    return figures
