"""Soft labels by the lockstep engine (the soft_labels stage) vs clemcore's branching runner (tiny model).

    python -m clemprm.bench labels [--model tiny:0] [--k 4] [--instances 8]

The policy plays the train instances of guessnumber, wordref and oddoneout to make branch points; then the
same K-rollout labels are computed twice, side by side in one run, from the same branch-point states:
clemcore's ``BranchingRunner`` (k deep copies at the branch point, each branch generated one call at a time)
and ``clemprm.stages.labels.label_chunk`` (all continuations of all branch points in lockstep, one batched call per
step), interleaved ``--repeat`` times. Greedy decoding (the default) makes both play the same continuations: the
benchmark checks that the labels are identical, and reports continuations/s of each and the ratio. clemcore's
runner is the test suite's (``tests/clemcore_runners.py``): this benchmark runs from a source checkout.
"""

from __future__ import annotations

import time

from clemprm.bench import Figures
from clemprm.config import load_config
from clemprm.models.generation import PolicyModel
from clemprm.models.loader import ModelConfig
from clemprm.play.catalog import GameCatalog
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.stages import branch_points, labels

REPEATS_ITSELF = True


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="tiny:0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--instances", type=int, default=8, help="train instances per game")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="as labels.max_new_tokens in config.yaml")


def run(args) -> Figures:
    from tests.clemcore_runners import run_clemcore_branching

    config = load_config(overrides={"games": {"max_instances": {"train": args.instances}}})
    settings = {"seed": config["seed"], "model": config["model"], "games": config["games"],
                "branch_points": {**config["branch_points"], "temperature": 0.0, "max_new_tokens": args.max_new_tokens},
                "labels": {**config["labels"], "k": args.k, "temperature": 0.0, "max_new_tokens": args.max_new_tokens,
                           "max_rollout_rounds": 1000}}
    policy = PolicyModel(ModelConfig(spec=args.model, threads=args.threads), max_new_tokens=args.max_new_tokens)
    bps = branch_points.branch_points(settings, None, str(args.workdir / "episodes.parquet"),
                                      str(args.workdir / "branch_points.parquet"), policy=policy)
    catalog = GameCatalog(settings["games"], settings["seed"])   # as the branch-point stage draws its instances
    engine = RolloutEngine(catalog, Sampling(0.0, 1.0, args.max_new_tokens))
    states = branch_points.BranchPointStates(engine, catalog, policy, settings["seed"])
    live = [bp for bp, root in zip(bps, states.states(bps)) if not root.done]
    n_continuations = len(live) * args.k
    figures = Figures("labels")
    figures.note(f"model {policy.name}, {len(bps)} branch points ({len(live)} not terminal), K={args.k}: "
                 f"{n_continuations} continuations, greedy, max {args.max_new_tokens} new tokens, {args.threads} "
                 "threads")
    labels.label_chunk(engine, states, live[:4], settings["labels"])  # warm-up, untimed
    for _ in range(args.repeat):
        policy.decoder.forget_conversations()  # both runs start cold, as the soft-label stage does
        start = time.perf_counter()
        rows = labels.label_chunk(engine, states, live, settings["labels"])
        figures.add("engine continuations/s", n_continuations / (time.perf_counter() - start), "continuations/s")
        policy.decoder.forget_conversations()
        start = time.perf_counter()
        reference = run_clemcore_branching(states.states(live), args.k, settings["labels"]["aborted_value"])
        figures.add("branching continuations/s", n_continuations / (time.perf_counter() - start), "continuations/s")
    figures.ratio("engine vs clemcore branching runner", "engine continuations/s", "branching continuations/s")
    same = sum(sorted(row["rollout_scores"]) == sorted(scores) for row, scores in zip(rows, reference))
    figures.note(f"identical labels: {same}/{len(rows)} (last repeat)")
    return figures
