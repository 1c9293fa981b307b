"""Which PRM training ranks held-out siblings best: variants side by side on the same soft labels.

    python -m clemprm.bench prm_training --workdir DIR [--results RESULTS] [--instances 6] [--siblings 4] [--k 4]
                                         [--seed N] [--variant bce] [--variant pairwise:pairwise_weight=1.0] ...

Soft labels are made once into ``DIR/soft_labels.parquet`` (reused when there): the policy (config.yaml's
``model``, no SFT adapter) plays ``--instances`` train instances per built-in game, every trajectory gives its
branch points (``branch_points.max_per_episode``) with ``--siblings`` candidates each, each labelled by ``--k``
continuations (the ``branch_points`` and ``soft_labels`` stages' own functions); ``--results`` takes a pipeline's
results folder instead: its ``labels/soft_labels.parquet``, its SFT adapter (the log-probability baseline's policy)
and its ``labels/answers.parquet`` (for variants with acceptance_examples). Then the PRM stages
(:func:`clemprm.stages.prm.train_prm`, :func:`clemprm.stages.prm_evaluation.measure_prm`) train and measure once
per ``--variant NAME:key=value,...`` (keys of the ``prm`` section, e.g. ``pairwise_weight``, ``lr``, ``epochs``) on
the same labels and the same instance split, and the
benchmark reports each variant's held-out figures next to the baselines': within-prefix pairwise accuracy, top-1
regret and the pick's label (bootstrap CIs over held-out instances), global AUROC and Pearson, and the training
time.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from clemprm.bench import Figures, RunFiles
from clemprm.config import deep_merge, load_config
from clemprm.stages import branch_points, labels, prm, prm_evaluation


def parse_variant(text: str) -> tuple[str, dict]:
    """``name:key=value,key=value`` -> (name, {key: value}) with JSON values (numbers, true/false, null)."""
    name, _, rest = text.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    return name, overrides


def make_labels(config: dict, workdir: Path) -> Path:
    output = workdir / "soft_labels.parquet"
    if output.exists():
        return output
    settings = {name: config[name] for name in ("seed", "model", "games", "branch_points", "labels")}
    start = time.perf_counter()
    rows = branch_points.branch_points(settings, None, str(workdir / "episodes.parquet"), str(workdir / "bp.parquet"))
    bp_seconds = time.perf_counter() - start
    start = time.perf_counter()
    labels.soft_labels_shard(settings, str(workdir / "bp.parquet"), None, 0, 1, str(output))
    print(f"labels: {len(rows)} candidates in {bp_seconds:.0f} s (branch points with siblings), labelled in "
          f"{time.perf_counter() - start:.0f} s")
    return output


def show(estimate: dict | None) -> str:
    if not estimate or estimate.get("value") is None:
        return "n/a"
    return f"{estimate['value']:.3f} [{estimate['ci_low']:.3f}, {estimate['ci_high']:.3f}]"


def add_arguments(parser) -> None:
    parser.add_argument("--results", type=Path, default=None, help="a pipeline's results folder: its soft labels, "
                        "SFT adapter and answers (default: soft labels made here)")
    parser.add_argument("--validation-fraction", type=float, default=0.3,
                        help="train instances held out when the labels have no validation-split rows")
    parser.add_argument("--instances", type=int, default=6, help="train instances per game (labels)")
    parser.add_argument("--siblings", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="model spec (default: config.yaml's model.spec)")
    parser.add_argument("--epochs", type=float, default=2)
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (default: config.yaml's)")
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME:key=value,... of the prm section (repeatable; default: bce and pairwise)")


def run(args) -> Figures:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = load_config(overrides={**({"seed": args.seed} if args.seed is not None else {}),
                                    "games": {"max_instances": {"train": args.instances}},
                                    "model": {"threads": args.threads, **({"spec": args.model} if args.model else {})},
                                    "branch_points": {"siblings": args.siblings}, "labels": {"k": args.k},
                                    # every labelled pair, whole sibling groups, a third of the instances held out
                                    "prm": {"max_examples": None, "epochs": args.epochs,
                                            "validation_fraction": args.validation_fraction}})
    run_files = RunFiles(args.results) if args.results else None
    labels_path = run_files.soft_labels() if run_files else make_labels(config, args.workdir)
    sft_adapter = str(run_files.sft_adapter()) if run_files else None
    answers = str(run_files.answers()) if run_files else None
    variants = [parse_variant(text) for text in (args.variant or ["bce", "pairwise:pairwise_weight=1.0"])]
    results = {}
    for name, overrides in variants:
        settings = {"seed": config["seed"], "model": config["model"], "prm": deep_merge(config["prm"], overrides)}
        folder = args.workdir / name
        # a variant that fails the quality gate is a result here, not an error
        prm.train_prm(settings, str(labels_path), str(folder / "adapter"), str(folder / "predictions.parquet"),
                      sft_adapter=sft_adapter, answers_path=answers)
        metrics = prm_evaluation.measure_prm(settings, str(labels_path), str(folder / "predictions.parquet"),
                                             str(folder / "metrics.json"), on_failure="continue")
        results[name] = metrics
    first = next(iter(results.values()))
    ranking, side = first["ranking"], first["ranking"]["side"]
    figures = Figures("prm_training")
    figures.note(f"{first['examples']['train']} train pairs on {first['examples']['train_instances']} instances; held "
                 f"out ({side}): {first['examples'][side]} pairs, {ranking['prefixes']} states with siblings on "
                 f"{ranking['instances']} instances, {ranking['pairs_with_different_labels']} sibling pairs with "
                 f"different labels; best sibling's label {show(ranking['best_label'].get('overall'))}")
    rows = [(f"prm [{name}]", metrics, "prm") for name, metrics in results.items()]
    rows += [(baseline, first, baseline) for baseline in ranking["scorers"] if baseline != "prm"]
    for label, metrics, scorer in rows:
        overall = metrics["ranking"]["scorers"][scorer]["overall"]
        block = metrics["evaluation"][side] if scorer == "prm" else metrics["baselines"][scorer][side]
        for key in ("pairwise_accuracy", "top1_regret", "pick_label"):
            figures.add(f"{label}: {key}", overall[key]["value"], "held out")
        for key in ("auroc", "pearson"):
            figures.add(f"{label}: {key}", (block or {}).get(key), "held out")
        figures.note(f"{label}: pairwise accuracy {show(overall['pairwise_accuracy'])}, top-1 regret "
                     f"{show(overall['top1_regret'])}, pick label {show(overall['pick_label'])} (bootstrap CIs)")
    for name, metrics in results.items():
        figures.add(f"prm [{name}]: training", metrics.get("train_seconds"), "s")
        held_out = metrics["evaluation"][side] or {}
        figures.note(f"prm [{name}] gate {metrics['gate']['status']}: mean prediction "
                     f"{held_out.get('mean_prediction')}, label {held_out.get('mean_label')}; std prediction "
                     f"{held_out.get('std_prediction')}, label {held_out.get('std_label')}")
        head, verdicts = metrics.get("head") or {}, (metrics.get("acceptance") or {}).get("heldout") or {}
        figures.add(f"prm [{name}]: head change / initial norm", head.get("change_over_initial_norm"), "ratio")
        figures.note(f"prm [{name}] head: moved {head.get('change_norm')} from its random start (norm "
                     f"{head.get('initial_norm')}, std {head.get('initial_std')} -> {head.get('final_std')}), largest "
                     f"LoRA B {head.get('lora_b_max_abs')}; learning rates {metrics.get('learning_rates')}; held-out "
                     f"verdicts AUROC {verdicts.get('auroc')} ({verdicts.get('n')} answers)")
        per_game = metrics["ranking"]["scorers"]["prm"]
        figures.note(f"prm [{name}] per game: " + "; ".join(
            f"{game}: accuracy {show(entry['pairwise_accuracy'])}, regret {show(entry['top1_regret'])}"
            for game, entry in per_game.items() if game != "overall"))
    return figures
