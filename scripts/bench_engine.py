"""Benchmark: the lockstep engine vs clemcore's sequential and batchwise runners on the same episodes.

    python scripts/bench_engine.py [--episodes 64] [--model tiny:0] [--batch-size 64]

Plays the same episodes (distinct guessnumber + oddoneout instances, greedy decoding) three ways, side by
side in one run, and prints episodes/s of each and the ratios. Greedy decoding makes the three runs play
the same games, which the script checks (identical responses). The engine plays all episodes in one run, as
the pipeline's stages do; clemcore's runners play one game at a time (their API takes one game). Each runner
is timed ``--repeats`` times, the runners interleaved, and the median is reported (a run takes well under a
second, so one timing is noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time

from clemprm.play.catalog import GameCatalog
from tests.clemcore_runners import run_clemcore
from clemprm.config import load_config
from clemprm.play.engine import RolloutEngine, Sampling
from clemprm.models.loader import ModelConfig
from clemprm.models.generation import PolicyModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--model", default="tiny:0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=24, help="as base_rollouts in config.yaml")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy, so all runners play identical games (checked)")
    parser.add_argument("--batch-size", type=int, default=64, help="clemcore batchwise runner batch size")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per runner (the median is reported)")
    parser.add_argument("--games", nargs="+", default=["guessnumber", "oddoneout"],
                        help="built-in games whose instances are played (episodes split evenly)")
    args = parser.parse_args()

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
    print(f"model {policy.name}, {n_episodes} episodes ({', '.join(f'{g}: {len(v)}' for g, v in instances.items())}), "
          f"temperature {args.temperature}, max {args.max_new_tokens} new tokens, {args.threads} threads")

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
    samples, responses = {name: [] for name in runs}, {}
    for _ in range(args.repeats):
        for name, run in runs.items():
            policy.decoder.forget_conversations()  # every run starts cold, as a pipeline stage does
            start = time.perf_counter()
            responses[name] = run()
            samples[name].append(time.perf_counter() - start)
    timings = {name: statistics.median(values) for name, values in samples.items()}

    for name, seconds in timings.items():
        turns = sum(map(len, responses[name]))  # of the last run: sampled runs may play longer or shorter games
        print(f"{name:>10}: {seconds:7.3f} s  {n_episodes / seconds:7.2f} episodes/s  {turns:4d} turns  "
              f"(median of {args.repeats}; range {min(samples[name]):.3f}-{max(samples[name]):.3f} s)")
    print(f"engine vs sequential: {timings['sequential'] / timings['engine']:.1f}x faster")
    print(f"engine vs batchwise:  {timings['batchwise'] / timings['engine']:.2f}x faster")
    for runner in ("sequential", "batchwise"):
        if args.temperature > 0:
            break  # sampled: each runner draws its own samples, identical games are not expected
        same = sum(a == b for a, b in zip(responses["engine"], responses[runner]))
        print(f"identical episodes engine vs {runner}: {same}/{n_episodes}")


if __name__ == "__main__":
    main()
