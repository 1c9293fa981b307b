"""hanabi RL: SmolLM2 base vs the RL-trained policy of configs/hanabi.yaml, side by side, and the RL run's curves.

    snakemake -c2 --configfile configs/hanabi.yaml -- results/merged/rl_grpo     # the RL stage, merged and verified
    python -m clemprm.bench hanabi_rl [--results results] [--algorithm grpo]

The trained policy is the run's ``merged/rl_ALGORITHM`` under ``--results``. Both policies answer the same
validation states (the rule-based player's self-play on the validation split, the
prompt set the RL stage trains on, but of held-out deck orders; ``--max-per-episode`` states per game) ``--samples``
times each at the RL stage's sampling (``rl.temperature``, ``rl.max_new_tokens``, seeded per state and sample), and
play every validation instance once greedily as whole games. Per answer the game's own per-turn scores (deduction
score, exact deduction, move rating, format) and the weighted reward the RL stage trains on; per game the fireworks
score (0 for an aborted game) and % played. The trained policy is the merged checkpoint (a plain model folder), so
this also checks that it plays. The curves are the per-step means of the run's ``rl/ALGORITHM/metrics.json`` (mean
of the first and last steps, and every step).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from clemprm.bench import Figures, RunFiles

SCORES = ("deduction", "exact_deduction", "move_rating", "format")


def state_answers(engine, catalog, policy, states: list[dict], samples: int, sampling, seed: int) -> list[dict]:
    """The game's per-turn scores of ``samples`` answers of ``policy`` at each state (one propose call)."""
    from clemprm.stats import derive_seed
    from clemprm.games.hanabi.rewards import turn_rewards
    from clemprm.stages.rl_states import replay_state, state_instance

    episodes = [replay_state(engine, state_instance(catalog, state), list(state["history"]), [policy],
                             f"{state['state_id']}/{s}", derive_seed(seed, "bench_hanabi_rl", state["state_id"], s))
                for state in states for s in range(samples)]
    for episode, candidates in zip(episodes, engine.propose(episodes, 1, sampling)):
        for generation in candidates:
            engine.apply(episode, generation)
    return [turn_rewards(episode)[len(episode.turns) - 1] for episode in episodes if episode.turns]


def games(engine, catalog, policy, sampling, seed: int) -> list[dict]:
    instances = catalog.instances("hanabi", "validation")
    episodes = engine.start_all(instances, [policy], repeats=1, base_seed=seed, stage="bench_hanabi_rl")
    engine.run(episodes, label="bench_hanabi_rl games", sampling=sampling)
    return [episode.record(policy.name, sampling) for episode in episodes]


def measure(label: str, model_settings: dict, config: dict, states: list[dict], samples: int) -> dict:
    from clemprm.play.catalog import GameCatalog
    from clemprm.play.contract import Sampling
    from clemprm.play.engine import RolloutEngine
    from clemprm.rl.rewards import weighted_turn_reward
    from clemprm.models.generation import load_policy

    rl = config["rl"]
    catalog = GameCatalog(config["games"])
    sampled = Sampling(rl["temperature"], rl["top_p"], rl["max_new_tokens"])
    greedy = Sampling(0.0, 1.0, rl["max_new_tokens"])
    policy = load_policy(model_settings, config["cache_dir"])
    engine = RolloutEngine(catalog, sampled)
    start = time.perf_counter()
    answers = state_answers(engine, catalog, policy, states, samples, sampled, config["seed"])
    rows = games(engine, catalog, policy, greedy, config["seed"])
    fireworks = [0.0 if row["aborted"] else json.loads(row["episode_scores"])["Fireworks Score"] for row in rows]
    result = {"label": label, "answers": len(answers), "games": len(rows), "seconds": time.perf_counter() - start,
              **{key: statistics.mean(float(a[key]) for a in answers) for key in SCORES},
              "reward": statistics.mean(weighted_turn_reward(a, rl["reward"]["turn_weights"]) for a in answers),
              "fireworks": statistics.mean(fireworks), "played": 100 * statistics.mean(not r["aborted"] for r in rows),
              "turns_per_game": statistics.mean(r["n_turns"] for r in rows)}
    del policy
    return result


def add_to(figures: Figures, results: list[dict], max_score: int) -> None:
    for r in results:
        for key in SCORES + ("reward",):
            figures.add(f"{r['label']}: {key}", r[key], "mean per answer")
        figures.add(f"{r['label']}: fireworks", r["fireworks"], f"of {max_score}")
        figures.add(f"{r['label']}: played", r["played"], "%")
        figures.add(f"{r['label']}: turns per game", r["turns_per_game"], "turns")
        figures.add(f"{r['label']}: seconds", r["seconds"], "s")


def print_curves(metrics_path: Path) -> None:
    metrics = json.loads(open(metrics_path).read())
    history = metrics["history"]
    first, last = history[: max(1, len(history) // 4)], history[-max(1, len(history) // 4):]

    def mean(steps, key):
        values = [s["turn_scores"][key] if key in SCORES else s["turn_reward"]["mean"] for s in steps]
        return statistics.mean(values)

    print(f"\nRL run ({metrics_path}): {len(history)} steps, {metrics['seconds']:.0f} s; mean of the first "
          f"{len(first)} -> last {len(last)} steps:")
    print("  " + ", ".join(f"{key} {mean(first, key):.3f} -> {mean(last, key):.3f}" for key in ("reward",) + SCORES))
    print(f"  {'step':>4} {'reward':>7} {'std':>6} {'deduction':>9} {'exact':>6} {'move':>6} {'format':>6} "
          f"{'trained':>7} {'is_log_ratio':>12} {'grad':>7} {'s':>5}")
    for s in history:
        ratio = (s.get("is_log_ratio") or {}).get("max")
        print(f"  {s['step']:4d} {s['turn_reward']['mean']:7.3f} {s['turn_reward']['std']:6.3f} "
              f"{s['turn_scores']['deduction']:9.3f} {s['turn_scores']['exact_deduction']:6.3f} "
              f"{s['turn_scores']['move_rating']:6.3f} {s['turn_scores']['format']:6.3f} "
              f"{s['trained_turns']:3d}/{s['policy_turns']:<3d} {'-' if ratio is None else f'{ratio:12.2e}':>12} "
              f"{s['grad_norm']:7.3f} {s['seconds']['rollouts'] + s['seconds']['update']:5.0f}")


def add_arguments(parser) -> None:
    parser.add_argument("--config", default="configs/hanabi.yaml")
    parser.add_argument("--results", type=Path, default=Path("results"), help="the hanabi run's results folder")
    parser.add_argument("--algorithm", default="grpo",
                        help="the RL run: merged/rl_ALGORITHM, rl/ALGORITHM/metrics.json")
    parser.add_argument("--max-per-episode", type=int, default=2, help="validation states per game")
    parser.add_argument("--samples", type=int, default=2, help="answers per state and policy")
    parser.add_argument("--threads", type=int, default=1)


def run(args) -> Figures:
    from clemprm.config import load_config
    from clemprm.games.hanabi.rules import DeckConfig
    from clemprm.play.catalog import GameCatalog
    from clemprm.stages.rl_states import self_play_states

    run_files = RunFiles(args.results)
    trained_path = str(run_files.merged(f"rl_{args.algorithm}"))
    config = load_config(args.config)
    catalog = GameCatalog(config["games"])
    states = self_play_states(catalog, "validation", args.max_per_episode)
    base = {**config["model"], "threads": args.threads}
    trained = {**base, "spec": trained_path, "adapter": None}
    results = [measure("base", base, config, states, args.samples),
               measure("RL-trained", trained, config, states, args.samples)]
    max_score = max(DeckConfig.from_experiment(instance.experiment).max_score
                    for instance in catalog.instances("hanabi", "validation"))
    figures = Figures("hanabi_rl")
    add_to(figures, results, max_score)
    figures.note(f"base {config['model']['spec']}, RL-trained {trained_path}; hanabi validation: {len(states)} "
                 f"states x {args.samples} answers (T={config['rl']['temperature']}), {results[0]['games']} greedy "
                 f"games; {args.threads} thread(s)")
    print_curves(run_files.rl_metrics(args.algorithm))
    return figures
