"""SCoRe on the embedded default: training time and memory from an SFT adapter, then self_correct's t1/t2 table.

The stage trains from a run's SFT adapter, then eval mode self_correct plays the SFT and the SCoRe policy; reports
training time, peak memory, what each stage did, and the t1/t2 table with bootstrap CIs.

    python -m clemprm.bench score --results results [--threads 1] [--workdir /tmp/bench_score]
    python -m clemprm.bench score --sft-adapter DIR

The settings are config.yaml's (``score``, ``eval``, ``games``), with ``model.threads`` and the options below on top.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from clemprm.bench import Figures, RunFiles


def show(estimate: dict) -> str:
    if estimate["value"] is None:
        return "n/a"
    return f"{estimate['value']:6.1f} [{estimate['ci_low']:6.1f}, {estimate['ci_high']:6.1f}]"


def add_arguments(parser) -> None:
    adapter = parser.add_mutually_exclusive_group(required=True)
    adapter.add_argument("--results", type=Path, help="a run's results folder: its SFT adapter SCoRe starts from")
    adapter.add_argument("--sft-adapter", help="the SFT adapter SCoRe starts from")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stage1-steps", type=int, default=None, help="default: config.yaml's score.stage1_steps")
    parser.add_argument("--stage2-steps", type=int, default=None, help="default: config.yaml's score.stage2_steps")
    parser.add_argument("--validation-instances", type=int, default=None,
                        help="guessnumber validation instances self_correct plays (default: games.max_instances)")


def run(args) -> Figures:
    sft_adapter = args.sft_adapter or str(RunFiles(args.results).sft_adapter())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from clemprm.config import eval_mode_params, load_config
    from clemprm.rl.score import train_score
    from clemprm.evaluation.self_correct import evaluate_self_correct, self_correction_summary

    overrides = {"model": {"threads": args.threads}, "score": {}}
    for key in ("stage1_steps", "stage2_steps"):
        if getattr(args, key) is not None:
            overrides["score"][key] = getattr(args, key)
    if args.validation_instances is not None:
        overrides["games"] = {"max_instances": {"validation": args.validation_instances}}
    config = load_config(overrides=overrides)
    out = args.workdir

    start = time.perf_counter()
    metrics = train_score({name: config[name] for name in ("seed", "model", "games", "score")}, sft_adapter,
                          str(out / "adapter"), str(out / "metrics.json"), config["cache_dir"])
    train_seconds = time.perf_counter() - start
    settings = {**eval_mode_params(config, "self_correct"), "score": config["score"]}
    start = time.perf_counter()
    rows = evaluate_self_correct(settings, str(out / "self_correct.parquet"), config["cache_dir"],
                                 sft_adapter=sft_adapter, score_adapter=str(out / "adapter"))
    eval_seconds = time.perf_counter() - start
    summary = self_correction_summary(rows, config["eval"]["bootstrap_samples"], config["seed"], config["eval"]["ci"])
    (out / "self_correction.json").write_text(json.dumps(summary, indent=1))

    score = config["score"]
    figures = Figures("score")
    figures.add("training", train_seconds, "s")
    figures.add("training peak RSS", metrics["peak_memory_mb"]["rss"], "MB")
    figures.add("self_correct eval", eval_seconds, "s")
    figures.note(f"SCoRe on {config['model']['spec']}, games {', '.join(score['games'])}, threads {args.threads}: "
                 f"stage I {score['stage1_steps']} + stage II {score['stage2_steps']} steps of "
                 f"{score['instances_per_step']} instances x {score['group_size']} episodes x 2 attempts")
    figures.note("step stage  reward_t1 reward_t2   diff  success_t1 success_t2  i->c c->i  kl_t1     kl_t2     "
                 "trained  s(att1/att2/update)")
    for entry in metrics["history"]:
        kl = entry["kl"]
        figures.note(f"{entry['step']:4d} {entry['stage']:5d}  {entry['reward_t1']:9.3f} {entry['reward_t2']:9.3f} "
                     f"{entry['reward_difference']:6.3f}  {entry['attempt1']['success_rate']:10.1f} "
                     f"{entry['attempt2']['success_rate']:10.1f}  {entry['transitions']['incorrect_to_correct']:4d} "
                     f"{entry['transitions']['correct_to_incorrect']:4d}  {kl['attempt1'] or 0:.2e}  "
                     f"{kl['attempt2'] or 0:.2e}  {entry['trained_turns']:7d}  {entry['seconds']['attempt1']:.0f}/"
                     f"{entry['seconds']['attempt2']:.0f}/{entry['seconds']['update']:.0f}")
    figures.note(f"self_correct on {config['eval']['split']} (greedy), overall, "
                 f"{round(100 * config['eval']['ci'])}% bootstrap CI over instances:")
    metrics_shown = ("accuracy_t1", "accuracy_t2", "delta_t1_t2", "delta_i_to_c", "delta_c_to_i", "percent_played_t1",
                     "percent_played_t2", "quality_t1", "quality_t2")
    figures.note(f"{'metric':18s}" + "".join(f"{role:>26s}" for role in summary["policies"]) + f"{'score - sft':>26s}")
    difference = summary["difference"].get("score_minus_sft", {}).get("overall")
    for metric in metrics_shown:
        cells = [show(entry["results"]["overall"][metric]) for entry in summary["policies"].values()]
        cells.append(show(difference[metric]) if difference else "n/a")
        figures.note(f"{metric:18s}" + "".join(f"{cell:>26s}" for cell in cells))
    episodes = summary["policies"]["sft"]["results"]["overall"]["episodes"]
    figures.note(f"({episodes} attempt pairs per policy; outputs in {out})")
    return figures
