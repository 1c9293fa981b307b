"""The clembench 2.0 text games of a checkout through the pipeline's stages: what each stage did, per game.

For every game, on its own (one game failing to load does not stop the others): load it (the parse-time checks
and the catalog), base rollouts on its first instance(s) (round-robin over its experiments, given as a playpen-data
instance list), branch points and K-rollout soft labels of those trajectories (the base policy stands in for the
SFT policy), greedy evaluation on its next instance(s). Every stage runs with ``on_failure: continue`` so that the
table shows what each stage did; a stage that raised is named in the last column. Also printed: which partial
score a capped label continuation of the game gets (the game's ``partial_bench_score``, its own scorer on the
episode closed as lost, 0 where that yields none, or an error where the scorer raises on answers), probed after 0,
1, 2 answers of the game's own programmatic players (clembench players implement ``_custom_response``).

    python -m clemprm.bench clembench_suite --clembench /path/to/clembench --model tiny:0
    python -m clemprm.bench clembench_suite --clembench /path/to/clembench --model embedded:smollm2-135m-instruct \
        --threads 2 --games wordle,referencegame --max-context-tokens auto

Counts are small on purpose (1 instance per split, 1 episode, K=2): it shows that each game runs as clembench
intends, not how well the model plays. taboo and codenames need NLTK data (docs/games.md: clembench games).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path

from clemprm.bench import Figures

SUITE = ("wordle", "wordle_withclue", "wordle_withcritic", "referencegame", "imagegame", "privateshared", "taboo",
         "codenames", "matchit_ascii", "guesswhat", "textmapworld", "textmapworld_graphreasoning",
         "textmapworld_specificroom", "adventuregame")
"""The text games of the clembench 2.0 suite."""


def instance_list(clembench: str, game: str, per_split: int, folder: Path) -> str | None:
    """A playpen-data instance list for ``game``: its first instances (round-robin over the experiments of its
    instances file) for train, the next ones for validation; None when the game is not found (the checks say why)."""
    import json

    from clemprm.play.catalog import clembench_specs, instances_file

    try:
        game_dir, spec = clembench_specs(clembench)[game]
        experiments = json.loads(instances_file(game_dir, spec).read_text(encoding="utf-8"))["experiments"]
    except (KeyError, ValueError):
        return None
    keys = [key for group in zip(*[[(e["name"], i["game_id"]) for i in e["game_instances"]] for e in experiments])
            for key in group] or [(e["name"], i["game_id"]) for e in experiments[:1] for i in e["game_instances"]]
    rows = [{"game": game, "experiment": name, "task_id": game_id, "split": split}
            for split, chosen in (("train", keys[:per_split]), ("validation", keys[per_split:2 * per_split]))
            for name, game_id in chosen]
    path = folder / f"{game}.instances.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def model_settings(args) -> dict:
    """The ``model`` section the suite's options set (the rest: the config's defaults)."""
    chosen = {"spec": args.model, "threads": args.threads, "max_context_tokens": args.max_context_tokens}
    return {key: value for key, value in chosen.items() if value is not None}


def context_tokens(text: str) -> int | str:
    """``--max-context-tokens``: a number, or auto (the model's own context length)."""
    return text if text == "auto" else int(text)


def settings_for(args, game: str, workdir: Path) -> dict:
    from clemprm.config import load_config

    tokens = args.max_new_tokens
    config = load_config(overrides={
        "model": model_settings(args),
        "games": {"builtin": [], "clembench_path": args.clembench, "clembench_games": [game],
                  "instance_list": instance_list(args.clembench, game, args.instances, workdir),
                  "max_instances": {"train": args.instances, "validation": args.instances, "test": 1}},
        "base_rollouts": {"episodes_per_instance": args.episodes, "max_new_tokens": tokens},
        "branch_points": {"episodes_per_instance": 1, "max_new_tokens": tokens, "max_per_episode": args.branch_points},
        "labels": {"k": args.k, "max_new_tokens": tokens, "max_rollout_rounds": args.max_rollout_rounds, "shards": 1},
        "eval": {"episodes_per_instance": args.episodes, "max_new_tokens": tokens},
        "on_failure": "continue"})
    return config


def partial_score_kind(game: str, catalog, policy, seed: int) -> str:
    """How a capped continuation of ``game`` is scored: its ``partial_bench_score()``, or its own scorer on the
    episode closed as lost (0 where that yields no score), probed after each of the first answers of the game's own
    programmatic players (clembench players implement ``_custom_response``: moves in the game's format)."""
    from clemprm.play.contract import Generation, Sampling
    from clemprm.play.engine import RolloutEngine
    from clemprm.stages.continuation_scores import ContinuationError, closed_as_lost_score

    engine = RolloutEngine(catalog, Sampling(0.0, 1.0, 48))
    episode = engine.start(catalog.instances(game, "train")[0], [policy], f"{game}/probe", seed)
    if episode.error:
        return f"n/a (set-up failed: {episode.error[:60]})"
    if hasattr(episode.env.game_master, "partial_bench_score"):
        return "its partial_bench_score()"
    found = []
    for answers in range(3):
        if episode.done:
            break
        try:
            score, reason = closed_as_lost_score(episode)
            found.append(f"{answers}: " + (f"scorer {score:.1f}" if reason is None else f"0 ({reason[:40]})"))
        except ContinuationError as error:  # the scorer raised on answers: an error of the game's code
            found.append(f"{answers}: error ({str(error.__cause__)[:40]})")
        player, _ = engine.waiting(episode)
        agent = episode.env.agent_selection
        try:
            text = player._custom_response(episode.env.observe(agent))
        except Exception as error:
            found.append(f"no programmatic move ({type(error).__name__})")
            break
        engine.apply(episode, Generation(text=text, raw_text=text, prompt_tokens=0, new_tokens=0))
    return "after " + ", ".join(found) + " answers" if found else "n/a (the game ended at set-up)"


def run_game(args, game: str, policy, workdir: Path) -> dict:
    """One game through every stage; what happened, as one table row."""
    from clemprm import records
    from clemprm.evaluation import evaluate
    from clemprm.stages import branch_points, continuation_scores, labels, rollouts
    from clemprm.play.catalog import GameCatalog
    from clemprm.checks.parse_time import check_config_inputs
    from clemprm.config import eval_mode_params, sections

    row = {"game": game, "loads": "no", "stage_errors": []}
    start = time.perf_counter()
    settings = settings_for(args, game, workdir)
    out = workdir / game
    try:
        check_config_inputs(settings)
        catalog = GameCatalog(settings["games"])
    except Exception as error:
        row.update(seconds=time.perf_counter() - start, left_out=" ".join(str(error).split())[:160])
        return row
    row["loads"] = "yes"
    row["partial"] = partial_score_kind(game, catalog, policy, settings["seed"])

    def stage(name, call):
        try:
            return call()
        except Exception as error:
            row["stage_errors"].append(f"{name}: {type(error).__name__}: {str(error)[:100]}")
            logging.getLogger(__name__).error("%s %s:\n%s", game, name, traceback.format_exc())
            return None

    base = stage("base_rollouts", lambda: rollouts.base_rollouts(
        sections(settings, "seed", "model", "games", "base_rollouts"), out / "base.parquet", policy=policy,
        on_failure="continue")) or []
    row["base"] = episode_stats(base)
    bp_settings = sections(settings, "seed", "model", "games", "branch_points")
    bp_episodes = out / "bp_episodes.parquet"
    bps = stage("branch_points", lambda: branch_points.branch_points(
        bp_settings, None, bp_episodes, out / "bp.parquet", policy=policy, on_failure="continue"))
    played = episode_stats(records.read_records(bp_episodes)) if bp_episodes.exists() else "-"
    row["branch_points"] = f"{played}; {len(bps or [])} branch points"
    if bps:
        errors = continuation_scores.ErrorCounts()
        soft = stage("soft_labels", lambda: labels.soft_labels_shard(
            sections(settings, "seed", "model", "games", "labels"), out / "bp.parquet", None, 0, 1,
            out / "labels.parquet", policy=policy, errors=errors)) or []
        row["labels"] = labels.labelling_counts(bps, soft, errors)
    else:
        row["labels"] = "no branch points"
    greedy = stage("eval", lambda: evaluate.evaluate_mode(
        "greedy_base", eval_mode_params(settings, "greedy_base"), out / "greedy_base.parquet", policy=policy,
        on_failure="continue")) or []
    row["eval"] = episode_stats(greedy)
    row["seconds"] = time.perf_counter() - start
    return row


def episode_stats(rows: list[dict]) -> str:
    if not rows:
        return "-"
    played = sum(not r["aborted"] for r in rows)
    turns = sum(r["n_turns"] for r in rows) / len(rows)
    errors = [r["error"] for r in rows if r["error"]]
    text = f"{len(rows)} ep, {100 * played / len(rows):.0f}% played, {turns:.1f} turns, {len(errors)} errors"
    return text + (f" ({errors[0][:60]})" if errors else "")


def add_arguments(parser) -> None:
    parser.add_argument("--clembench", required=True, help="a clembench checkout")
    parser.add_argument("--model", default="tiny:0")
    parser.add_argument("--games", default=",".join(SUITE), help="comma-separated (default: the 2.0 text games)")
    parser.add_argument("--instances", type=int, default=1, help="instances per split")
    parser.add_argument("--episodes", type=int, default=1, help="episodes per instance")
    parser.add_argument("--k", type=int, default=2, help="continuations per branch point")
    parser.add_argument("--branch-points", type=int, default=2, help="branch points per trajectory at most")
    parser.add_argument("--max-rollout-rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-context-tokens", type=context_tokens, default=None,
                        help="model.max_context_tokens: the longest prompt (default: the config's), or auto: the "
                             "model's own context length (games with long prompts)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log", default=None, help="log file (default: suite.log in the work folder)")


def run(args) -> Figures:
    from clemprm.models.generation import load_policy

    args.clembench = str(Path(args.clembench).resolve())
    workdir = args.workdir.resolve()
    os.chdir(workdir)  # matchit_ascii appends its players' first words to ./first_words.txt
    log_file = args.log or str(workdir / "suite.log")
    logging.basicConfig(level=logging.INFO, filename=log_file, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    policy = load_policy(model_settings(args))
    figures = Figures("clembench_suite")
    figures.note(f"model {args.model} loaded in {time.perf_counter() - start:.0f} s, prompts up to "
                 f"{policy.cfg.max_context_tokens} tokens; {args.instances} instance(s) per split, "
                 f"{args.episodes} episode(s), K={args.k}, {args.max_new_tokens} new tokens; log {log_file}")
    header = ("game", "loads", "base rollouts (train)", "branch points", "soft labels",
              "greedy eval (validation)", "partial score", "left out / stage errors")
    print(" | ".join(header), flush=True)
    for game in args.games.split(","):
        row = run_game(args, game, policy, workdir)
        figures.add(f"{game}: seconds", row["seconds"], "s")
        print(" | ".join([row["game"], row["loads"], row.get("base", "-"), row.get("branch_points", "-"),
                          row.get("labels", "-"), row.get("eval", "-"), row.get("partial", "-"),
                          row.get("left_out") or "; ".join(row["stage_errors"]) or "-"]), flush=True)
    figures.add("total", time.perf_counter() - start, "s")
    return figures
