"""Benchmark: which PRM training ranks held-out siblings best, variants side by side on the same soft labels.

    python scripts/bench_prm_training.py --workdir DIR [--labels SOFT_LABELS] [--instances 6] [--siblings 4] [--k 4]
                                         [--seed N] [--variant bce] [--variant pairwise:pairwise_weight=1.0] ...

Soft labels are made once into ``DIR/soft_labels.parquet`` (reused when there): the policy (config.yaml's
``model``, no SFT adapter) plays ``--instances`` train instances per built-in game, every trajectory gives its
branch points (``branch_points.max_per_episode``) with ``--siblings`` candidates each, each labelled by ``--k``
continuations (the ``branch_points`` and ``soft_labels`` stages' own functions); ``--labels`` takes a pipeline's
``results/labels/soft_labels.parquet`` instead. Then the PRM stage
(:func:`clemprm.stages.prm.train_prm`) trains once per ``--variant NAME:key=value,...`` (keys of the ``prm``
section, e.g. ``pairwise_weight``, ``lr``, ``epochs``) on the same labels and the same instance split, and the
script prints each variant's held-out figures next to the baselines': within-prefix pairwise accuracy, top-1
regret and the pick's label (bootstrap CIs over held-out instances), global AUROC and Pearson, and the training
time.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from clemprm.stages import labels, prm
from clemprm.config import deep_merge, load_config


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
    rows = labels.branch_points(settings, None, str(workdir / "episodes.parquet"), str(workdir / "bp.parquet"))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--labels", type=Path, default=None, help="soft labels to train on (default: made here)")
    parser.add_argument("--sft-adapter", default=None,
                        help="the policy of the log-probability baseline (with --labels)")
    parser.add_argument("--episodes", nargs="*", default=[], help="played episode records (a pipeline's "
                        "results/rollouts/base_train.parquet, results/labels/sft_train_episodes.parquet) for variants "
                        "with acceptance_examples")
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
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    args.workdir.mkdir(parents=True, exist_ok=True)
    config = load_config(overrides={**({"seed": args.seed} if args.seed is not None else {}),
                                    "games": {"max_instances": {"train": args.instances}},
                                    "model": {"threads": args.threads, **({"spec": args.model} if args.model else {})},
                                    "branch_points": {"siblings": args.siblings}, "labels": {"k": args.k},
                                    # every labelled pair, whole sibling groups, a third of the instances held out
                                    "prm": {"max_examples": None, "epochs": args.epochs,
                                            "validation_fraction": args.validation_fraction}})
    labels_path = args.labels or make_labels(config, args.workdir)
    variants = [parse_variant(text) for text in (args.variant or ["bce", "pairwise:pairwise_weight=1.0"])]
    results = {}
    for name, overrides in variants:
        settings = {"seed": config["seed"], "model": config["model"], "prm": deep_merge(config["prm"], overrides)}
        folder = args.workdir / name
        # a variant that fails the quality gate is a result here, not an error
        metrics = prm.train_prm(settings, str(labels_path), str(folder / "adapter"), str(folder / "metrics.json"),
                                sft_adapter=args.sft_adapter, on_failure="continue", episode_paths=args.episodes)
        results[name] = metrics
    first = next(iter(results.values()))
    ranking, side = first["ranking"], first["ranking"]["side"]
    print(f"\n{first['examples']['train']} train pairs on {first['examples']['train_instances']} instances; held out "
          f"({side}): {first['examples'][side]} pairs, {ranking['prefixes']} states with siblings on "
          f"{ranking['instances']} instances, {ranking['pairs_with_different_labels']} sibling pairs with different "
          f"labels; best sibling's label {show(ranking['best_label'].get('overall'))}")
    print(f"{'scorer':<28} {'pairwise accuracy':<24} {'top-1 regret':<24} {'pick label':<24} {'AUROC':>6} "
          f"{'Pearson':>7} {'train s':>7}")
    rows = [(f"prm [{name}]", metrics, "prm") for name, metrics in results.items()]
    rows += [(baseline, first, baseline) for baseline in ranking["scorers"] if baseline != "prm"]
    for label, metrics, scorer in rows:
        overall = metrics["ranking"]["scorers"][scorer]["overall"]
        block = metrics["evaluation"][side] if scorer == "prm" else metrics["baselines"][scorer][side]
        auroc, pearson = (block or {}).get("auroc"), (block or {}).get("pearson")
        print(f"{label:<28} {show(overall['pairwise_accuracy']):<24} {show(overall['top1_regret']):<24} "
              f"{show(overall['pick_label']):<24} {auroc if auroc is None else round(auroc, 3)!s:>6} "
              f"{pearson if pearson is None else round(pearson, 3)!s:>7} "
              f"{metrics.get('train_seconds', '') if scorer == 'prm' else '':>7}")
    for name, metrics in results.items():
        held_out = metrics["evaluation"][side] or {}
        print(f"prm [{name}] gate {metrics['gate']['status']}: mean prediction {held_out.get('mean_prediction')}, "
              f"label {held_out.get('mean_label')}; std prediction {held_out.get('std_prediction')}, "
              f"label {held_out.get('std_label')}")
        per_game = metrics["ranking"]["scorers"]["prm"]
        print(f"prm [{name}] per game: " + "; ".join(
            f"{game}: accuracy {show(entry['pairwise_accuracy'])}, regret {show(entry['top1_regret'])}"
            for game, entry in per_game.items() if game != "overall"))


if __name__ == "__main__":
    main()
