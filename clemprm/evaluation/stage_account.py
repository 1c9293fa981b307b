"""What each stage of a run did, in a few lines after its results table: a first-time user sees every stage did its
job (or which one left the next with nothing), read from the run's own files under ``results/``; a file not there
(a stage not run yet) is left out.

* base rollouts: episodes played per game and how many were won;
* SFT: the interactions of won episodes kept, the optimizer steps, the eval loss before and after;
* labels: candidates per split, states with siblings, the labels' mean and spread, the held-out states whose
  siblings differ (the pairs the PRM's ranking is measured on);
* PRM: its train-side and held-out pairwise accuracy (the table above has the rest).
"""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

from clemprm import records

BASE_ROLLOUTS, SFT_DATA, SFT_METRICS = "rollouts/base_train.parquet", "sft/sft_data.parquet", "sft/metrics.json"
SOFT_LABELS, PRM_METRICS = "labels/soft_labels.parquet", "prm/metrics.json"


def stage_lines(results: str | Path) -> list[str]:
    """The account of the run whose outputs are under ``results`` (module doc); [] where none is there."""
    results = Path(results)
    lines = [line for line in (base_line(results), sft_line(results), labels_line(results), prm_line(results))
             if line]
    return ["", "what each stage did:", *lines] if lines else []


def _columns(path: Path, names: list[str]) -> dict[str, list] | None:
    if not path.is_file():
        return None
    return records.read_table(path).select(names).to_pydict()


def base_line(results: Path) -> str | None:
    episodes = _columns(results / BASE_ROLLOUTS, ["game", "success"])
    if episodes is None:
        return None
    played, won = collections.Counter(episodes["game"]), collections.Counter(
        game for game, success in zip(episodes["game"], episodes["success"]) if success)
    per_game = ", ".join(f"{game} {won[game]} of {count}" for game, count in sorted(played.items()))
    return f"  base rollouts: {sum(played.values())} episodes, {sum(won.values())} won ({per_game})"


def sft_line(results: Path) -> str | None:
    data, metrics_path = results / SFT_DATA, results / SFT_METRICS
    if not data.is_file() or not metrics_path.is_file():
        return None
    metrics = json.loads(metrics_path.read_text())
    losses = (f", eval loss {metrics['initial_eval_loss']:.3f} -> {metrics['eval_loss']:.3f}"
              if metrics.get("initial_eval_loss") is not None and metrics.get("eval_loss") is not None else "")
    return (f"  SFT: {records.read_table(data).num_rows} interactions of won episodes kept, "
            f"{metrics.get('steps', 0)} optimizer steps ({metrics.get('status')}){losses}")


def labels_line(results: Path) -> str | None:
    rows = _columns(results / SOFT_LABELS, ["split", "prefix_id", "label"])
    if rows is None:
        return None
    splits = collections.Counter(rows["split"])
    states = collections.defaultdict(set)
    for split, prefix, label in zip(rows["split"], rows["prefix_id"], rows["label"]):
        states[(split, prefix)].add(label)
    differing = sum(len(labels) > 1 for (split, _), labels in states.items() if split == "validation")
    spread = statistics.pstdev(rows["label"]) if rows["label"] else 0.0
    mean = statistics.fmean(rows["label"]) if rows["label"] else 0.0
    return (f"  labels: {len(rows['label'])} candidates ({', '.join(f'{n} {s}' for s, n in sorted(splits.items()))}) "
            f"on {len(states)} states; label mean {mean:.3f}, spread {spread:.3f}; {differing} held-out states whose "
            f"siblings differ")


def prm_line(results: Path) -> str | None:
    path = results / PRM_METRICS
    if not path.is_file():
        return None
    metrics = json.loads(path.read_text())
    train = ((metrics.get("train_ranking") or {}).get("pairwise_accuracy") or {}).get("value")
    held = ((((metrics.get("ranking") or {}).get("scorers") or {}).get("prm") or {}).get("overall") or {})
    held = (held.get("pairwise_accuracy") or {}).get("value")
    return (f"  PRM: {metrics.get('status')} in {metrics.get('steps', 0)} steps; pairwise accuracy {_figure(train)} "
            f"on its train siblings, {_figure(held)} on the held-out ones")


def _figure(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
