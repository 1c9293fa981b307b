"""hanabi: the rule-based player vs random play, the move rating's cost, and (``--smollm2``) SmolLM2 base play.

    python -m clemprm.bench hanabi                    # rule-based vs random play on every instance of both decks
    python -m clemprm.bench hanabi --smollm2 8        # + 8 SmolLM2 base episodes (validation split, small deck)

Rule-based and random play run in pure Python on all 70 deck orders per experiment (train + validation + test);
random play picks a uniformly random legal move (seeded per game). The move rating's cost is the time of
``move_values`` (one rule-based continuation per legal move) per turn of the rule-based player's first 10 games;
the deduction baseline is the deduction score of answering ``??`` for every card at the same states.

The SmolLM2 run plays the configured model (``--config``, default configs/hanabi.yaml, with its base-rollout
sampling) on the validation split and reports the per-turn means the game logs (deduction score, exact deduction,
move rating, format), the fireworks score, % played and turns/s.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time

from clemprm.bench import Figures
from clemprm.games import SPLITS, builtin_game_dir
from clemprm.games.hanabi import bot, protocol
from clemprm.games.hanabi.rules import DeckConfig, HanabiState

RATED_GAMES = 10


def experiments() -> dict[str, tuple[DeckConfig, list[str]]]:
    """Per experiment: its deck and every instance's deck order over all splits."""
    found: dict[str, tuple[DeckConfig, list[str]]] = {}
    for split in SPLITS:
        data = json.loads((builtin_game_dir("hanabi") / "in" / f"instances_{split}.json").read_text())
        for experiment in data["experiments"]:
            config = DeckConfig.from_experiment(experiment)
            decks = found.setdefault(experiment["name"], (config, []))[1]
            decks.extend(i["deck"] for i in experiment["game_instances"])
    return found


def play(config: DeckConfig, deck: str, choose, on_turn=None) -> int:
    state = HanabiState(config, config.parse_deck(deck))
    while not state.over:
        if on_turn:
            on_turn(state)
        move = choose(state)
        assert state.illegal_reason(move) is None
        state.apply(move)
    return state.score()


def rule_based_vs_random(figures: Figures) -> None:
    figures.note("rule-based player vs random play (pure Python, every instance of every split)")
    for name, (config, decks) in experiments().items():
        rating_seconds, blank_deduction = [], []

        def on_turn(state):
            start = time.perf_counter()
            bot.move_values(state)
            rating_seconds.append(time.perf_counter() - start)
            blank_deduction.append(protocol.deduction_scores([(None, None)] * len(state.hands[state.current]),
                                                             state, state.current)[0])

        bot_scores = [play(config, deck, bot.bot_move, on_turn if index < RATED_GAMES else None)
                      for index, deck in enumerate(decks)]
        random_scores = [play(config, deck, lambda s, rng=random.Random(seed): bot.random_move(s, rng))
                         for seed, deck in enumerate(decks)]
        for label, scores in (("rule-based", bot_scores), ("random", random_scores)):
            figures.add(f"{name} {label}: mean score", statistics.mean(scores), f"of {config.max_score}")
            figures.add(f"{name} {label}: BENCH_SCORE", 100 * statistics.mean(scores) / config.max_score, "0-100")
            figures.note(f"{name} {label}: {len(scores)} games, perfect {sum(s == config.max_score for s in scores)}, "
                         f"zero {sum(s == 0 for s in scores)}")
        figures.add(f"{name} move rating", 1000 * statistics.mean(rating_seconds), "ms/turn")
        figures.note(f"{name} move rating: {1000 * max(rating_seconds):.1f} ms max, over {len(rating_seconds)} turns; "
                     f"deduction score of an all-?? answer at these states: {statistics.mean(blank_deduction):.3f}")


def smollm2(episodes: int, config_path: str, figures: Figures) -> None:
    from clemprm.play.catalog import GameCatalog
    from clemprm.config import load_config
    from clemprm.play.contract import Sampling
    from clemprm.play.engine import RolloutEngine
    from clemprm.games.hanabi.rewards import REWARD_KEYS, turn_rewards
    from clemprm.models.generation import load_policy

    config = load_config(config_path)
    catalog = GameCatalog(config["games"])
    instances = catalog.instances("hanabi", "validation")
    rollout = config["base_rollouts"]
    sampling = Sampling(rollout["temperature"], rollout["top_p"], rollout["max_new_tokens"])
    policy = load_policy(config["model"], config["cache_dir"])
    engine = RolloutEngine(catalog, sampling)
    repeats = math.ceil(episodes / len(instances))
    started = engine.start_all(instances, [policy], repeats=repeats, base_seed=config["seed"], stage="bench_hanabi")
    started = started[:episodes]
    start = time.perf_counter()
    engine.run(started, label="bench_hanabi")
    seconds = time.perf_counter() - start
    rows = [episode.record(policy.name, sampling) for episode in started]
    rewards = [reward for episode in started for reward in turn_rewards(episode)]
    scores = [json.loads(row["episode_scores"]).get("Fireworks Score", math.nan) for row in rows]
    played = [row for row in rows if not row["aborted"]]
    turns = sum(row["n_turns"] for row in rows)
    experiments = ", ".join(sorted({i.experiment["name"] for i in instances}))
    figures.note(f"SmolLM2 base ({policy.name}, T={sampling.temperature}, {sampling.max_new_tokens} new tokens, "
                 f"{config['model']['threads']} threads), {len(rows)} validation episodes of {experiments}, "
                 f"{len(rewards)} answers, success {sum(row['success'] for row in rows)}, errors "
                 f"{sum(row['error'] is not None for row in rows)}")
    for key in REWARD_KEYS:
        figures.add(f"SmolLM2 per turn: {key}", statistics.mean(r[key] for r in rewards), "mean")
    figures.add("SmolLM2 played", 100 * len(played) / len(rows), "%")
    figures.add("SmolLM2 fireworks score (played)",
                statistics.mean(s for s, r in zip(scores, rows) if not r["aborted"]) if played else None, "mean")
    figures.add("SmolLM2 BENCH_SCORE (played)", statistics.mean(r["bench_score"] for r in played) if played else None,
                "0-100")
    figures.add("SmolLM2 turns/s", turns / seconds, "turns/s")
    example = next((turn for row in rows for turn in row["turns"]), None)
    if example:
        figures.note(f"SmolLM2 first answer: {example['response']!r}")


def add_arguments(parser) -> None:
    parser.add_argument("--smollm2", type=int, default=0, metavar="EPISODES", help="also play SmolLM2 base episodes")
    parser.add_argument("--config", default="configs/hanabi.yaml")


def run(args) -> Figures:
    figures = Figures("hanabi")
    rule_based_vs_random(figures)
    if args.smollm2:
        smollm2(args.smollm2, args.config, figures)
    return figures
