"""Benchmark: soft labels by the lockstep engine (the soft_labels stage) vs clemcore's branching runner.

    python scripts/bench_labels.py [--model tiny:0] [--k 4] [--instances 8]

The policy plays the train instances of guessnumber, wordref and oddoneout to make branch points; then the
same K-rollout labels are computed twice, side by side in one run, from the same branch-point states:
clemcore's ``BranchingRunner`` (k deep copies at the branch point, each branch generated one call at a time)
and ``clemprm.stages.labels.label_chunk`` (all continuations of all branch points in lockstep, one batched call per
step). Greedy decoding (the default) makes both play the same continuations: the script checks that the
labels are identical, and prints continuations/s of each and the ratio.
"""

from __future__ import annotations

import argparse
import time

from clemprm.stages import labels
from clemprm.play.catalog import GameCatalog
from tests.clemcore_runners import run_clemcore_branching
from clemprm.config import load_config
from clemprm.play.engine import RolloutEngine, Sampling
from clemprm.models.loader import ModelConfig
from clemprm.models.generation import PolicyModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--instances", type=int, default=8, help="train instances per game")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="as labels.max_new_tokens in config.yaml")
    args = parser.parse_args()

    config = load_config(overrides={"games": {"max_instances": {"train": args.instances}}})
    settings = {"seed": config["seed"], "model": config["model"], "games": config["games"],
                "branch_points": {**config["branch_points"], "temperature": 0.0, "max_new_tokens": args.max_new_tokens},
                "labels": {**config["labels"], "k": args.k, "temperature": 0.0, "max_new_tokens": args.max_new_tokens,
                           "max_rollout_rounds": 1000}}
    policy = PolicyModel(ModelConfig(spec=args.model, threads=args.threads), max_new_tokens=args.max_new_tokens)
    bps = labels.branch_points(settings, None, "/tmp/bench_labels_episodes.parquet", "/tmp/bench_labels_bp.parquet",
                               policy=policy)
    catalog = GameCatalog(settings["games"])
    engine = RolloutEngine(catalog, Sampling(0.0, 1.0, args.max_new_tokens))
    states = labels.BranchPointStates(engine, catalog, policy, settings["seed"])
    live = [bp for bp, root in zip(bps, states.states(bps)) if not root.done]
    n_continuations = len(live) * args.k
    print(f"model {policy.name}, {len(bps)} branch points ({len(live)} not terminal), K={args.k}: "
          f"{n_continuations} continuations, greedy, max {args.max_new_tokens} new tokens, {args.threads} threads")
    labels.label_chunk(engine, states, live[:4], settings["labels"])  # warm-up, untimed

    policy.decoder.forget_conversations()  # both runs start cold, as the soft-label stage does
    start = time.perf_counter()
    rows = labels.label_chunk(engine, states, live, settings["labels"])
    engine_seconds = time.perf_counter() - start
    policy.decoder.forget_conversations()
    start = time.perf_counter()
    reference = run_clemcore_branching(states.states(live), args.k, settings["labels"]["aborted_value"])
    reference_seconds = time.perf_counter() - start

    print(f"    engine: {engine_seconds:7.1f} s  {n_continuations / engine_seconds:7.2f} continuations/s")
    print(f" branching: {reference_seconds:7.1f} s  {n_continuations / reference_seconds:7.2f} continuations/s")
    print(f"engine vs clemcore branching runner: {reference_seconds / engine_seconds:.1f}x faster")
    same = sum(sorted(row["rollout_scores"]) == sorted(scores) for row, scores in zip(rows, reference))
    print(f"identical labels: {same}/{len(rows)}")


if __name__ == "__main__":
    main()
