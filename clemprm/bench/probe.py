"""What blind best-of-N costs with each PRM kind: random_of_n, best_of_n with a LoRA PRM and with a probe PRM.

The three (``prm.kind: probe`` for the last) in one run on the same model, instances and episode seeds.

Both PRMs are fitted first (not timed) on soft labels of candidates the policy sampled on train prompts, with labels
drawn at random: what a token costs does not depend on what the PRM learnt (the paths, and so the turns played,
do: compare seconds per turn and the PRM's tokens per second). Then each mode plays the validation
instances of the configured games (``--episodes`` per instance) with the policy sampling ``--n`` candidates per turn,
and the benchmark reports, per mode (``--repeat`` interleaved rounds: every round plays the same
episodes), wall seconds, episodes, turns, the policy's generated tokens (``SearchCost``), the
PRM's pairs, tokens read and seconds (``scorer.stats``). The probe reads the policy's own weights through the same
text the LoRA PRM reads, a turn's candidates on their shared prompt (one pass over the prompt, N short ones over the
answers); ``best_of_n (probe, unshared)`` is the same probe reading every candidate in full, side by side.

    python -m clemprm.bench probe                 # the tiny model (tiny:0)
    python -m clemprm.bench probe --smollm2 --episodes 1
"""

from __future__ import annotations

import random
import time

from clemprm import records
from clemprm.bench import Figures
from clemprm.config import load_config
from clemprm.models.generation import load_policy
from clemprm.models.prm import load_prm
from clemprm.play.catalog import GameCatalog
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.search import RandomScorer
from clemprm.search.best_of_n import best_of_n
from clemprm.stages import prm

REPEATS_ITSELF = True


def label_rows(engine: RolloutEngine, catalog: GameCatalog, policy, n: int, seed: int) -> list[dict]:
    """Soft-label rows of ``n`` sampled candidates on each train instance's first prompt, labels drawn at random
    (two instances in three train, the rest held out as the validation split's)."""
    rng = random.Random(seed)
    episodes = engine.start_all(catalog.all_instances("train"), [policy], repeats=1, base_seed=seed, stage="bench")
    rows = []
    for index, (episode, candidates) in enumerate(zip(episodes, engine.propose(episodes, n, engine.sampling))):
        game, experiment, game_id = episode.instance.key
        prefix = engine.waiting(episode)[1]
        for turn, candidate in enumerate(candidates):
            label = rng.choice([0.0, 0.25, 1.0])
            episode_id = f"{game}/{experiment}/{game_id}/0"
            rows.append({"bp_id": f"{episode_id}/{turn}", "prefix_id": f"{episode_id}/0", "episode_id": episode_id,
                         "game": game, "experiment": experiment, "game_id": game_id,
                         "split": "validation" if index % 3 == 2 else "train", "turn_idx": 0, "player": "Player 1",
                         "game_role": "", "prefix": prefix, "candidate": candidate.text, "history": [candidate.text],
                         "parse_ok": True, "reply": "", "seed": turn, "episode_bench_score": 0.0,
                         "episode_success": False, "episode_aborted": False, "k": 4, "terminal": False,
                         "rollout_scores": [100.0 * label] * 4, "n_aborted": 0, "n_success": round(4 * label),
                         "n_capped": 0, "new_tokens": candidate.new_tokens, "label": label, "multiplicity": 1})
    return rows


def play(name: str, catalog: GameCatalog, policy, scorer, n: int, sampling: Sampling, episodes: int,
         seed: int) -> dict:
    """One mode's search over the validation instances, timed, with its costs."""
    engine = RolloutEngine(catalog, sampling)
    started = engine.start_all(catalog.all_instances("validation"), [policy], repeats=episodes, base_seed=seed,
                               stage="eval")
    stats = getattr(scorer, "stats", None)
    before = (stats.pairs, stats.tokens, stats.seconds) if stats else (0, 0, 0.0)
    start = time.perf_counter()
    costs = best_of_n(engine, started, scorer, n, sampling, label=name)
    seconds = time.perf_counter() - start
    after = (stats.pairs, stats.tokens, stats.seconds) if stats else (0, 0, 0.0)
    turns = sum(len(episode.turns) for episode in started)
    return {"mode": name, "seconds": round(seconds, 1), "episodes": len(started), "turns": turns,
            "seconds_per_turn": round(seconds / max(1, turns), 2),
            "policy_tokens": sum(cost.policy_tokens for cost in costs), "prm_pairs": after[0] - before[0],
            "prm_tokens": after[1] - before[1], "prm_seconds": round(after[2] - before[2], 1)}


def add_arguments(parser) -> None:
    parser.add_argument("--smollm2", action="store_true", help="the embedded SmolLM2 instead of the tiny model")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=1, help="episodes per validation instance")
    parser.add_argument("--instances", type=int, default=2, help="instances per game and split")
    parser.add_argument("--seed", type=int, default=7)
    parser.set_defaults(repeat=2)


def run(args) -> Figures:
    spec = "embedded:smollm2-135m-instruct" if args.smollm2 else "tiny:0"
    config = load_config(overrides={
        "model": {"spec": spec, "threads": 2},
        "games": {"max_instances": {"train": args.instances, "validation": args.instances, "test": 1}},
        "prm": {"epochs": 1, "warmup_ratio": 0.0, "max_examples": None, "validation_fraction": 0.0,
                "probe": {"layers": [-1, -2] if not args.smollm2 else [-1, -4, -8], "window": 32,
                          "l2": [0.1, 1.0], "combination": ["value"], "folds": 2}}})
    sampling = Sampling(config["eval"]["temperature"], config["eval"]["top_p"], config["eval"]["max_new_tokens"])
    catalog = GameCatalog(config["games"])
    policy = load_policy(config["model"])
    figures = Figures("probe")
    work = args.workdir
    labels = work / "labels.parquet"
    records.write_records(labels, label_rows(RolloutEngine(catalog, sampling), catalog, policy, args.n, args.seed),
                          records.SOFT_LABELS, {})
    scorers = {"random_of_n": RandomScorer(args.seed)}
    for kind in ("lora", "probe"):
        section = {**config["prm"], "kind": kind}
        settings = {"seed": args.seed, "model": config["model"], "prm": section}
        start = time.perf_counter()
        prm.train_prm(settings, str(labels), f"{work}/{kind}", f"{work}/{kind}.parquet")
        figures.note(f"prm.kind {kind}: fitted in {time.perf_counter() - start:.1f} s")
        scorers[f"best_of_n ({kind})"] = load_prm(config["model"], section, f"{work}/{kind}")
    unshared = load_prm(config["model"], {**config["prm"], "kind": "probe"}, f"{work}/probe")
    unshared.features.share_prefixes = False
    scorers["best_of_n (probe, unshared)"] = unshared
    for _ in range(args.repeat):
        for name, scorer in scorers.items():
            row = play(name, catalog, policy, scorer, args.n, sampling, args.episodes, args.seed)
            for key in ("seconds", "seconds_per_turn", "prm_seconds"):
                figures.add(f"{name}: {key}", row[key], "s" if key != "seconds_per_turn" else "s/turn")
            figures.add(f"{name}: PRM tokens/s", row["prm_tokens"] / row["prm_seconds"] if row["prm_seconds"] else None,
                        "tokens/s")
            figures.note(f"{name}: {row['episodes']} episodes, {row['turns']} turns, {row['policy_tokens']} policy "
                         f"tokens, {row['prm_pairs']} PRM pairs, {row['prm_tokens']} PRM tokens")
    for kind in ("lora", "probe", "probe, unshared"):
        figures.ratio(f"best_of_n ({kind}) / random_of_n, s/turn", f"best_of_n ({kind}): seconds_per_turn",
                      "random_of_n: seconds_per_turn")
    figures.ratio("probe: unshared / shared prompt, PRM s", "best_of_n (probe, unshared): prm_seconds",
                  "best_of_n (probe): prm_seconds")
    figures.note(f"{spec}, n {args.n}")
    return figures
