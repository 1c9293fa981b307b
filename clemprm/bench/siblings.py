"""What M sibling candidates per branch point cost (branch points and soft labels), and what the prefix store saves.

    python -m clemprm.bench siblings [--model embedded:smollm2-135m-instruct] [--siblings 1 2 4] [--k 2]
                                     [--instances 1] [--threads 2]

The policy (the base ``--model``; the pipeline uses the SFT policy, which plays alike in cost) plays ``--instances``
train instances per built-in game once; their branch points (``branch_points.max_per_episode`` per episode) are the
states. Then, for each M of ``--siblings``: the M - 1 siblings sampled from each state
(:func:`clemprm.stages.branch_points.with_siblings`, the branch-point stage's part that grows with M), and the
K-continuation soft labels of all M candidates of every state (:func:`clemprm.stages.labels.label_chunk`, the
soft-label stage), once with the decoder's prefix store (``model.prefix_cache_mb``: a fork or a game's next turn
prefills only its new tokens) and once without it, side by side. Reports seconds per state (sibling sampling +
labels), continuations/s, the cost relative to M = 1, the store's saving, and how many states' siblings got different
labels (what a PRM trained on siblings can learn from).
"""

from __future__ import annotations

import time

from clemprm.bench import Figures
from clemprm.config import load_config
from clemprm.models.generation import load_policy
from clemprm.play.catalog import GameCatalog
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.stages import branch_points, labels


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="model spec (default: config.yaml's model.spec)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--siblings", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--k", type=int, default=2, help="continuations per candidate")
    parser.add_argument("--instances", type=int, default=1, help="train instances per game")


def run(args) -> Figures:
    config = load_config(overrides={"games": {"max_instances": {"train": args.instances}}})
    model = {**config["model"], "threads": args.threads, **({"spec": args.model} if args.model else {})}
    bp_settings, label_settings = config["branch_points"], {**config["labels"], "k": args.k}
    seed = config["seed"]
    policy = load_policy(model)
    catalog = GameCatalog(config["games"])
    engine = RolloutEngine(catalog, Sampling(bp_settings["temperature"], bp_settings["top_p"],
                                             bp_settings["max_new_tokens"]))
    label_engine = RolloutEngine(catalog, Sampling(label_settings["temperature"], label_settings["top_p"],
                                                   label_settings["max_new_tokens"]))
    start = time.perf_counter()
    episodes = engine.play(catalog.all_instances("train"), [policy], repeats=1, base_seed=seed, stage="branch_points",
                           policy_name=policy.name)
    play_seconds = time.perf_counter() - start
    states = [row for episode in episodes
              for row in branch_points.branch_points_of(episode, bp_settings["max_per_episode"], seed)]
    figures = Figures("siblings")
    figures.note(f"model {policy.name}, {args.threads} threads, {len(episodes)} episodes played in {play_seconds:.1f} "
                 f"s, {len(states)} states, K={args.k}, labels max {label_settings['max_new_tokens']} new tokens")
    store = policy.decoder.prefix_store
    for m in args.siblings:
        policy.decoder.forget_conversations()
        start = time.perf_counter()
        rows = states if m == 1 else branch_points.with_siblings(
            engine, branch_points.BranchPointStates(engine, catalog, policy, seed), states, m, seed)
        sibling_seconds = time.perf_counter() - start
        figures.add(f"M {m}: sibling sampling", sibling_seconds, "s")
        for use_store in (True, False):
            policy.decoder.prefix_store = store if use_store else None
            policy.decoder.forget_conversations()   # every run starts cold, as the soft-label stage does
            start = time.perf_counter()
            states_after = branch_points.BranchPointStates(label_engine, catalog, policy, seed)
            labelled = labels.label_chunk(label_engine, states_after, rows, label_settings)
            seconds = time.perf_counter() - start
            continuations = sum(len(row["rollout_scores"]) for row in labelled)
            by_prefix = {}
            for row in labelled:
                by_prefix.setdefault(row["prefix_id"], set()).add(row["label"])
            varied = sum(len(values) > 1 for values in by_prefix.values())
            name = f"M {m}, store {'on' if use_store else 'off'}"
            figures.add(f"{name}: continuations/s", continuations / seconds, "continuations/s")
            figures.add(f"{name}: s/state", (sibling_seconds + seconds) / len(states), "s/state")
            figures.add(f"{name}: states w/ diff. labels", varied, f"of {len(by_prefix)}")
            if m != args.siblings[0]:
                first = f"M {args.siblings[0]}, store {'on' if use_store else 'off'}: s/state"
                figures.ratio(f"{name}: cost x M={args.siblings[0]}", f"{name}: s/state", first)
        figures.ratio(f"M {m}: store off / on", f"M {m}, store off: s/state", f"M {m}, store on: s/state")
        policy.decoder.prefix_store = store
    figures.note("s/state: sibling sampling + labels per state; cost x M=1: that cost relative to M=1 (same store "
                 "setting)")
    return figures
