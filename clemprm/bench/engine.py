"""The lockstep engine vs clemcore's sequential and batchwise runners on the same episodes (tiny model).

    python -m clemprm.bench engine [--episodes 64] [--model tiny:0] [--batch-size 64] [--repeat 5]

Plays the same episodes (distinct guessnumber + oddoneout instances, greedy decoding) three ways, side by
side in one run, and reports episodes/s of each and the ratios. Greedy decoding makes the three runs play
the same games, which the benchmark checks (identical responses). The engine plays all episodes in one run, as
the pipeline's stages do; clemcore's runners play one game at a time (their API takes one game). The runners are
interleaved ``--repeat`` times (a run takes well under a second, so one timing is noisy). clemcore's runners are
the test suite's (``tests/clemcore_runners.py``): this benchmark runs from a source checkout.
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

REPEATS_ITSELF = True


def add_arguments(parser) -> None:
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--model", default="tiny:0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=24, help="as base_rollouts in config.yaml")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, so all runners play identical games (checked)")
    parser.add_argument("--batch-size", type=int, default=64, help="clemcore batchwise runner batch size")
    parser.add_argument("--games", nargs="+", default=["guessnumber", "oddoneout"],
                        help="built-in games whose instances are played (episodes split evenly)")
    parser.set_defaults(repeat=5)


def run(args) -> Figures:
    from tests.clemcore_runners import run_clemcore

    games = load_config(overrides={"games": {"builtin": args.games,
                                             "max_instances": {"train": 1000, "validation": 1000, "test": 1000}}})
    catalog = GameCatalog(games["games"])
    per_game = args.episodes // len(catalog.games)
    instances = {game: [i for split in ("train", "validation", "test")
                        for i in catalog.instances(game, split)][:per_game]
                 for game in catalog.games}
    n_episodes = sum(map(len, instances.values()))
    policy = PolicyModel(ModelConfig(spec=args.model, threads=args.threads), temperature=args.temperature,
                         max_new_tokens=args.max_new_tokens)
    figures = Figures("engine")
    per_game_text = ", ".join(f"{g}: {len(v)}" for g, v in instances.items())
    figures.note(f"model {policy.name}, {n_episodes} episodes ({per_game_text}), temperature {args.temperature}, "
                 f"max {args.max_new_tokens} new tokens, {args.threads} threads")

    engine = RolloutEngine(catalog, Sampling(temperature=args.temperature, max_new_tokens=args.max_new_tokens))
    for game, game_instances in instances.items():  # warm-up (first-call costs of torch and clemcore), untimed
        engine.play(game_instances[:4], [policy], repeats=1, base_seed=0, stage="warmup", policy_name=policy.name)
        run_clemcore("sequential", catalog.benchmarks[game], game_instances[:4], policy)

    all_instances = [instance for game_instances in instances.values() for instance in game_instances]

    def engine_run():
        rows = engine.play(all_instances, [policy], repeats=1, base_seed=0, stage="bench", policy_name=policy.name)
        return [[turn["response"] for turn in row["turns"]] for row in rows]

    def clemcore_run(runner):
        return [episode.responses for game, game_instances in instances.items()
                for episode in run_clemcore(runner, catalog.benchmarks[game], game_instances, policy,
                                            batch_size=args.batch_size)]

    runs = {"engine": engine_run, "batchwise": lambda: clemcore_run("batchwise"),
            "sequential": lambda: clemcore_run("sequential")}
    responses = {}
    for _ in range(args.repeat):
        for name, play in runs.items():
            policy.decoder.forget_conversations()  # every run starts cold, as a pipeline stage does
            start = time.perf_counter()
            responses[name] = play()
            figures.add(f"{name} episodes/s", n_episodes / (time.perf_counter() - start), "episodes/s")
    figures.ratio("engine vs sequential", "engine episodes/s", "sequential episodes/s")
    figures.ratio("engine vs batchwise", "engine episodes/s", "batchwise episodes/s")
    for name in runs:
        turns = sum(map(len, responses[name]))  # of the last run: sampled runs may play longer or shorter games
        figures.note(f"{name}: {turns} turns (last repeat)")
    for runner in ("sequential", "batchwise"):
        if args.temperature > 0:
            break  # sampled: each runner draws its own samples, identical games are not expected
        same = sum(a == b for a, b in zip(responses["engine"], responses[runner]))
        figures.note(f"identical episodes engine vs {runner}: {same}/{n_episodes}")
    return figures
