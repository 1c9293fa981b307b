"""SFT on the embedded default: SFT time and peak memory, then base vs SFT play on the validation split.

    python -m clemprm.bench sft                       # SFT data: made first (base rollouts + win filter)
    python -m clemprm.bench sft --results results     # a run's SFT data (results/sft/sft_data.parquet)
    python -m clemprm.bench sft --episodes 4 --workdir /tmp/bench-sft
    python -m clemprm.bench sft --config my.yaml      # other settings on top of config.yaml

SFT runs in a fresh process (``clemprm.stages.sft.train_sft``, exactly what the ``sft_adapter`` rule runs), so its peak
RSS is the SFT's own. Both policies then play every built-in game's validation instances with the base rollout
sampling settings and the same seeds; per game: episodes, % played, success rate and quality (mean BENCH_SCORE
of played episodes), and their macro averages. Everything is written under ``--workdir``.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import sys
import time
from pathlib import Path

from clemprm.bench import Figures, RunFiles


def _train_in_child(settings, data, adapter, metrics, cache_dir, log_file):
    logging.basicConfig(level=logging.INFO, filename=log_file, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from clemprm.stages import sft
    sft.train_sft(settings, data, adapter, metrics, cache_dir)


def per_game(rows: list[dict]) -> dict:
    """episodes, % played, success rate (% of all episodes), quality (mean BENCH_SCORE of played ones) per game."""
    games = {}
    for game in sorted({row["game"] for row in rows}):
        game_rows = [row for row in rows if row["game"] == game]
        played = [row for row in game_rows if not row["aborted"]]
        games[game] = {
            "episodes": len(game_rows),
            "played": 100 * len(played) / len(game_rows),
            "success": 100 * sum(row["success"] for row in game_rows) / len(game_rows),
            "quality": sum(row["bench_score"] for row in played) / len(played) if played else math.nan,
        }
    keys = ("played", "success", "quality")
    games["macro"] = {key: _mean([g[key] for g in games.values()]) for key in keys}
    games["macro"]["episodes"] = len(rows)
    return games


def _mean(values):
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="a config file on top of config.yaml")
    parser.add_argument("--results", type=Path, help="a run's results folder: its SFT data (default: made here)")
    parser.add_argument("--data", type=Path, help="an SFT data parquet (instead of --results)")
    parser.add_argument("--episodes", type=int, default=2, help="plays per validation instance and policy")
    parser.add_argument("--skip-play", action="store_true", help="only measure SFT")


def run(args) -> Figures:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")

    from clemprm.config import load_config
    config = load_config(args.config)
    out = args.workdir
    report = {"config": {k: config[k] for k in ("seed", "model", "base_rollouts", "sft")}}
    figures = Figures("sft")

    data = args.data or (RunFiles(args.results).sft_data() if args.results else None)
    if data is None:
        from clemprm.stages import rollouts
        start = time.perf_counter()
        episodes = out / "base_train.parquet"
        rollouts.base_rollouts({k: config[k] for k in ("seed", "model", "games", "base_rollouts")}, str(episodes),
                               config["cache_dir"])
        data = str(out / "sft_data.parquet")
        rollouts.win_filter({"win_filter": config["win_filter"]}, str(episodes), data)
        report["data_seconds"] = round(time.perf_counter() - start, 1)
        figures.add("SFT data (base rollouts + win filter)", report["data_seconds"], "s")
    report["data"] = str(data)

    # SFT in a fresh process: its peak RSS is the SFT's own
    adapter, metrics_path = out / "adapter", out / "metrics.json"
    settings = {k: config[k] for k in ("seed", "model", "sft")}
    start = time.perf_counter()
    child = multiprocessing.get_context("spawn").Process(
        target=_train_in_child, args=(settings, str(data), str(adapter), str(metrics_path), config["cache_dir"],
                                      str(out / "sft.log")))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"SFT failed (exit {child.exitcode}); see {out / 'sft.log'}")
    metrics = json.loads(metrics_path.read_text())
    report["sft"] = {
        "wall_seconds": round(time.perf_counter() - start, 1), "seconds": metrics["seconds"],
        "train_seconds": metrics.get("train_seconds"), "peak_memory_mb": metrics["peak_memory_mb"],
        "steps": metrics["steps"], "epochs_run": metrics["epochs_run"], "best_epoch": metrics.get("best_epoch"),
        "examples": {k: metrics["examples"][k] for k in ("train", "validation", "train_instances",
                                                         "validation_instances", "shortened", "dropped_too_long")},
        "tokens": metrics["tokens"], "train_loss": metrics["train_loss"],
        "initial_eval_loss": metrics.get("initial_eval_loss"), "eval_loss": metrics["eval_loss"],
        "initial_eval_token_accuracy": metrics.get("initial_eval_token_accuracy"),
        "eval_token_accuracy": metrics["eval_token_accuracy"], "status": metrics["status"]}
    figures.add("SFT in the job", metrics["seconds"], "s")
    figures.add("SFT training", metrics.get("train_seconds"), "s")
    figures.add("SFT peak RSS", metrics["peak_memory_mb"]["rss"], "MB")
    figures.note(f"SFT: {metrics['status']}, {metrics['steps']} steps over {metrics['examples']['train']} train pairs "
                 f"({metrics['tokens']['train']} tokens); eval loss {metrics.get('initial_eval_loss')} -> "
                 f"{metrics['eval_loss']}, token accuracy {metrics.get('initial_eval_token_accuracy')} -> "
                 f"{metrics['eval_token_accuracy']}")

    if not args.skip_play:
        from clemprm.play.catalog import GameCatalog
        from clemprm.play.contract import Sampling
        from clemprm.play.engine import RolloutEngine
        from clemprm.models.loader import ModelConfig
        from clemprm.models.generation import PolicyModel

        catalog = GameCatalog(config["games"])
        instances = catalog.all_instances("validation")
        rollout = config["base_rollouts"]
        engine = RolloutEngine(catalog, Sampling(rollout["temperature"], rollout["top_p"], rollout["max_new_tokens"]))
        report["play"] = {"split": "validation", "instances": len(instances), "episodes_per_instance": args.episodes,
                          "temperature": rollout["temperature"]}
        for name, adapter_dir in (("base", None), ("sft", str(adapter))):
            cfg = ModelConfig.from_dict({**config["model"], "adapter": adapter_dir, "cache_dir": config["cache_dir"]})
            policy = PolicyModel(cfg, name=name)
            start = time.perf_counter()
            rows = engine.play(instances, [policy], repeats=args.episodes, base_seed=config["seed"],
                               stage="bench_sft", policy_name=name)   # same seeds for both policies
            report["play"][name] = {"seconds": round(time.perf_counter() - start, 1), "games": per_game(rows)}
            del policy

        figures.note(f"play: validation split, {len(instances)} instances x {args.episodes} episodes, "
                     f"temperature {rollout['temperature']}")
        for game in report["play"]["base"]["games"]:
            for name in ("base", "sft"):
                g = report["play"][name]["games"][game]
                for key, unit in (("played", "% played"), ("success", "% success"), ("quality", "quality")):
                    figures.add(f"{game} {name}: {key}", None if math.isnan(g[key]) else g[key], unit)

    (out / "bench_sft.json").write_text(json.dumps(report, indent=1, default=str))
    figures.note(f"the whole report: {out / 'bench_sft.json'}")
    return figures
