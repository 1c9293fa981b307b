"""The learning benchmark over seeds: one table from the ``prm_eval.json`` of each seed's run.

A claim of the pipeline (the PRM ranks siblings better than the baselines; PRM-guided search plays better than the
random pick among the same candidates and than the same search ranked by the policy's log-probability) holds when
it holds on average over the seeds, each seed a different draw of train instances, labels and episodes. Per seed and
on average (with the standard deviation over seeds): the PRM's within-state pairwise accuracy and top-1 regret next
to every baseline's, its quality gate, and each search's differences in % played and quality to ``random_of_n`` and
to its log-probability control. ``scripts/learning_benchmark.py`` runs the seeds and writes the table.
"""

from __future__ import annotations

import math

import numpy as np

from clemprm.stats import OVERALL

RANKING_METRICS = ("pairwise_accuracy", "top1_regret")
DIFFERENCE_METRICS = ("percent_played", "quality")
SEARCH_CONTROLS = {"best_of_n": "best_of_n_logprob", "beam_search": "beam_search_logprob"}   # search -> its control
RANDOM_CONTROL = "random_of_n"


def _value(estimate: dict | None) -> float:
    value = (estimate or {}).get("value")
    return math.nan if value is None else float(value)


def seed_row(summary: dict) -> dict[str, float | str]:
    """The benchmark's figures of one run's summary, flat: ``ranking/<scorer>/<metric>``,
    ``difference/<search>-<control>/<metric>``, ``gate``; NaN where the run has no such figure."""
    row: dict[str, float | str] = {}
    prm = summary.get("prm") or {}
    for scorer, groups in ((prm.get("ranking") or {}).get("scorers") or {}).items():
        for metric in RANKING_METRICS:
            row[f"ranking/{scorer}/{metric}"] = _value((groups.get(OVERALL) or {}).get(metric))
    row["gate"] = (prm.get("gate") or {}).get("status") or "n/a"
    differences = summary.get("differences") or {}
    for search, control in SEARCH_CONTROLS.items():
        for baseline in (RANDOM_CONTROL, control):
            overall = ((differences.get(baseline) or {}).get(search) or {}).get(OVERALL) or {}
            for metric in DIFFERENCE_METRICS:
                row[f"difference/{search}-{baseline}/{metric}"] = _value(overall.get(metric))
    return row


def seeds_table(rows: dict[int, dict]) -> dict:
    """Per seed the figures of :func:`seed_row` (``rows``: seed -> row; a row may carry text such as the gate or the
    commit that ran it); their mean and standard deviation over the seeds that have them; and the claims, each
    holding when it holds on the mean."""
    rows = dict(sorted(rows.items()))
    keys = sorted({key for row in rows.values() for key, value in row.items() if not isinstance(value, str)})
    mean, sd = {}, {}
    for key in keys:
        values = np.array([row.get(key, math.nan) for row in rows.values()], dtype=float)
        values = values[~np.isnan(values)]
        mean[key] = float(values.mean()) if values.size else math.nan
        sd[key] = float(values.std(ddof=1)) if values.size > 1 else math.nan
    return {"seeds": rows, "mean": mean, "sd": sd, "claims": claims(mean)}


def rows_of(table: dict) -> dict[int, dict]:
    """The per-seed rows of a table :func:`seeds_table` made, read back from its JSON (seeds run elsewhere: another
    machine, a cluster job, an earlier run)."""
    return {int(seed): row for seed, row in table["seeds"].items()}


def claims(mean: dict[str, float]) -> dict[str, bool | None]:
    """The benchmark's claims on the means (None where a figure is missing)."""
    def compare(a: str, b: str, higher: bool = True) -> bool | None:
        x, y = mean.get(a, math.nan), mean.get(b, math.nan)
        return None if math.isnan(x) or math.isnan(y) else (x > y if higher else x < y)

    result = {}
    for baseline in ("candidate_length", "policy_logprob", "constant_mean"):
        result[f"prm ranks siblings better than {baseline} (pairwise accuracy)"] = compare(
            "ranking/prm/pairwise_accuracy", f"ranking/{baseline}/pairwise_accuracy")
        result[f"prm picks better than {baseline} (top-1 regret)"] = compare(
            "ranking/prm/top1_regret", f"ranking/{baseline}/top1_regret", higher=False)
    for search, control in SEARCH_CONTROLS.items():
        for baseline in (RANDOM_CONTROL, control):
            for metric in DIFFERENCE_METRICS:
                value = mean.get(f"difference/{search}-{baseline}/{metric}", math.nan)
                result[f"{search} beats {baseline} on {metric}"] = None if math.isnan(value) else value > 0
    return result


def markdown(table: dict) -> str:
    """The table as Markdown: one column per seed, then the mean and the standard deviation; then the claims."""
    seeds = list(table["seeds"])
    keys = sorted({key for row in table["seeds"].values() for key in row})

    def show(value) -> str:
        return value if isinstance(value, str) else "n/a" if value is None or math.isnan(value) else f"{value:.3f}"

    lines = ["| figure | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean | sd |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for key in keys:
        cells = [show(table["seeds"][seed].get(key, math.nan)) for seed in seeds]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {show(table['mean'].get(key, ''))} | "
                     f"{show(table['sd'].get(key, ''))} |")
    lines += ["", "| claim (on the mean over seeds) | holds |", "|---|---|"]
    lines += [f"| {claim} | {'n/a' if holds is None else 'yes' if holds else 'no'} |"
              for claim, holds in table["claims"].items()]
    return "\n".join(lines) + "\n"
