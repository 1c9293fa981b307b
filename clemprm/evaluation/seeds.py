"""The learning benchmark over seeds: one table from each seed's ``prm_eval.json``, blind and lookahead apart.

A claim of the pipeline holds when it holds on average over the seeds, each seed a different draw of train
instances, labels and episodes. Every figure is in one regime (:mod:`clemprm.search`):

* ``blind/...``: the PRM that reads the candidate alone, within states against the candidate's length, the policy's
  log-probability and a random pick, beside the game's acceptance of the candidate (a reference: what a blind
  scorer gets if it knows only the rules' validity verdict); blind ``best_of_n`` against ``random_of_n`` and
  ``best_of_n_logprob``. These are the figures comparable with clembench.
* ``lookahead/...``: the PRM that reads the game's answer, against the same baselines and the rule that reads the
  same answer with no model; ``best_of_n_lookahead`` against ``best_of_n_rule``, ``beam_search`` against
  ``beam_search_rule`` and ``beam_search_logprob``.

Every claim is a paired difference (the PRM minus a baseline within states, a search minus its control), judged
only on its mean over at least ``MIN_SEEDS`` seeds (fewer: not judged, whatever one seed shows): it holds when the
mean's 95% interval clears 0 in the claimed direction (:func:`clemprm.stats.mean_over_seeds`: the wider of the
seeds' spread and the seeds' own intervals), not when the point estimate merely lies on the right side. A mean is
taken only over seeds that all have the figure (a figure missing in one seed has no mean), so that the two sides of
a claim always average the same seeds. ``scripts/learning_benchmark.py`` runs the seeds and writes the
table.
"""

from __future__ import annotations

import math

import numpy as np

from clemprm.modes import PRM_INPUT_REGIMES
from clemprm.stats import OVERALL, mean_over_seeds

MIN_SEEDS = 3   # a claim is judged on the mean over at least this many seeds
RANKING_METRICS = ("pairwise_accuracy", "top1_regret")
DIFFERENCE_METRICS = ("percent_played", "quality")
RANKING_BASELINES = {"blind": ("candidate_length", "policy_logprob", "constant_mean"),
                     "lookahead": ("candidate_length", "policy_logprob", "constant_mean", "rule")}
REFERENCES = {"blind": ("acceptance",), "lookahead": ()}   # tabulated, not claimed against
SEARCH_CONTROLS = {   # regime -> search -> its controls
    "blind": {"best_of_n": ("random_of_n", "best_of_n_logprob")},
    "lookahead": {"best_of_n_lookahead": ("best_of_n_rule",),
                  "beam_search": ("beam_search_rule", "beam_search_logprob")},
}


def _value(estimate: dict | None) -> float:
    value = (estimate or {}).get("value")
    return math.nan if value is None else float(value)


def _interval(estimate: dict | None) -> str | None:
    if not estimate or estimate.get("ci_low") is None:
        return None
    return f"[{estimate['ci_low']:+.3f}, {estimate['ci_high']:+.3f}]"


def _estimate(row: dict, key: str) -> dict:
    """A seed's figure under ``key`` with the interval :func:`_interval` wrote under ``key/ci``, read back."""
    value, interval = row.get(key, math.nan), row.get(f"{key}/ci")
    if isinstance(value, str) or math.isnan(value) or interval is None:
        return {"value": None, "ci_low": None, "ci_high": None}
    low, high = (float(bound) for bound in interval.strip("[]").split(","))
    return {"value": value, "ci_low": low, "ci_high": high}


def prm_regime(summary: dict) -> str | None:
    """The regime of a summary's PRM: blind for one that read the candidate alone, lookahead for one that read the
    game's reply (a PRM from before ``prm.input`` existed read it); None without a PRM."""
    prm = summary.get("prm")
    if not prm:
        return None
    return PRM_INPUT_REGIMES.get(prm.get("input"), "lookahead")


def seed_row(summary: dict) -> dict[str, float | str]:
    """The benchmark's figures of one run's summary, flat, each key led by its regime:
    ``<regime>/ranking/<scorer>/<metric>``, ``<regime>/ranking/prm-<scorer>/<metric>`` and
    ``<regime>/difference/<search>-<control>/<metric>`` (each difference with its paired interval as text under the
    same key + ``/ci``), ``<regime>/gate``. A run holds one PRM, so one regime's ranking;
    its modes may hold either regime's searches (each mode's own mark decides)."""
    row: dict[str, float | str] = {}
    regime = prm_regime(summary)
    if regime is not None:
        prm = summary["prm"]
        ranking = prm.get("ranking") or {}
        for scorer, groups in (ranking.get("scorers") or {}).items():
            for metric in RANKING_METRICS:
                row[f"{regime}/ranking/{scorer}/{metric}"] = _value((groups.get(OVERALL) or {}).get(metric))
        for scorer, groups in (ranking.get("differences") or {}).items():
            for metric in RANKING_METRICS:
                difference = (groups.get(OVERALL) or {}).get(metric)
                row[f"{regime}/ranking/prm-{scorer}/{metric}"] = _value(difference)
                if interval := _interval(difference):
                    row[f"{regime}/ranking/prm-{scorer}/{metric}/ci"] = interval
        row[f"{regime}/gate"] = (prm.get("gate") or {}).get("status") or "n/a"
    differences = summary.get("differences") or {}
    modes = summary.get("modes") or {}
    for mode_regime, searches in SEARCH_CONTROLS.items():
        for search, controls in searches.items():
            if (modes.get(search) or {}).get("regime") != mode_regime:
                continue   # not run, or (best_of_n records made before the regimes) read as lookahead
            for control in controls:
                overall = ((differences.get(control) or {}).get(search) or {}).get(OVERALL) or {}
                for metric in DIFFERENCE_METRICS:
                    key = f"{mode_regime}/difference/{search}-{control}/{metric}"
                    row[key] = _value(overall.get(metric))
                    if interval := _interval(overall.get(metric)):
                        row[f"{key}/ci"] = interval
    return row


def seeds_table(rows: dict[int, dict]) -> dict:
    """Per seed the figures of :func:`seed_row` (``rows``: seed -> row; a row may carry text such as the gate, an
    interval or the commit that ran it); their mean and standard deviation over the seeds, only where every seed has
    the figure (``incomplete`` lists the others); and the claims of :func:`claims`."""
    rows = dict(sorted(rows.items()))
    keys = sorted({key for row in rows.values() for key, value in row.items() if not isinstance(value, str)})
    mean, sd, incomplete = {}, {}, []
    for key in keys:
        values = np.array([row.get(key, math.nan) for row in rows.values()], dtype=float)
        if np.isnan(values).any():
            incomplete.append(key)
            mean[key] = sd[key] = math.nan
            continue
        mean[key] = float(values.mean())
        sd[key] = float(values.std(ddof=1)) if values.size > 1 else math.nan
    return {"seeds": rows, "mean": mean, "sd": sd, "incomplete": incomplete, "claims": claims(rows)}


def rows_of(table: dict) -> dict[int, dict]:
    """The per-seed rows of a table :func:`seeds_table` made, read back from its JSON (seeds run elsewhere: another
    machine, a cluster job, an earlier run)."""
    return {int(seed): row for seed, row in table["seeds"].items()}


def join_row(joined: dict, run_here: dict) -> dict:
    """A seed's row joined from elsewhere (``joined``) updated by the regimes run here: a regime in ``run_here``
    replaces all of that regime's figures, the other regime's stay (a lookahead run on one machine beside the blind
    run of the same seed on another)."""
    regimes_here = {key.split("/", 1)[0] for key in run_here}
    return {**{key: value for key, value in joined.items() if key.split("/", 1)[0] not in regimes_here}, **run_here}


def claim_differences() -> dict[str, tuple[str, int]]:
    """The benchmark's claims, per regime: claim -> (the paired difference it rests on, the sign it needs)."""
    result = {}
    for regime, baselines in RANKING_BASELINES.items():
        for baseline in baselines + REFERENCES[regime]:
            reference = " (reference)" if baseline in REFERENCES[regime] else ""
            result[f"{regime}: prm ranks siblings better than {baseline}{reference} (pairwise accuracy)"] = (
                f"{regime}/ranking/prm-{baseline}/pairwise_accuracy", +1)
            result[f"{regime}: prm picks better than {baseline}{reference} (top-1 regret)"] = (
                f"{regime}/ranking/prm-{baseline}/top1_regret", -1)
    for regime, searches in SEARCH_CONTROLS.items():
        for search, controls in searches.items():
            for control in controls:
                for metric in DIFFERENCE_METRICS:
                    result[f"{regime}: {search} beats {control} on {metric}"] = (
                        f"{regime}/difference/{search}-{control}/{metric}", +1)
    return result


def claims(rows: dict[int, dict]) -> dict[str, dict]:
    """Each claim's paired difference, its mean over the seeds with a 95% interval
    (:func:`clemprm.stats.mean_over_seeds`), and whether it holds: the interval clears 0 in the claimed direction
    (None: not judged, with fewer than ``MIN_SEEDS`` seeds or where a seed lacks the figure)."""
    result = {}
    for claim, (key, sign) in claim_differences().items():
        mean = mean_over_seeds([_estimate(row, key) for row in rows.values()])
        holds = None
        if len(rows) >= MIN_SEEDS and mean["value"] is not None:
            holds = bool(mean["ci_low"] > 0 if sign > 0 else mean["ci_high"] < 0)
        result[claim] = {"difference": key, "mean": mean, "holds": holds}
    return result


def markdown(table: dict) -> str:
    """The table as Markdown: one column per seed (a difference with its paired interval), then the mean and the
    standard deviation over the seeds; blind figures first, then lookahead; then the claims."""
    seeds = list(table["seeds"])
    keys = sorted({key for row in table["seeds"].values() for key in row if not key.endswith("/ci")},
                  key=lambda key: (not key.startswith("blind/"), key))

    def show(value) -> str:
        return value if isinstance(value, str) else "n/a" if value is None or math.isnan(value) else f"{value:.3f}"

    def cell(row: dict, key: str) -> str:
        interval = row.get(f"{key}/ci")
        return show(row.get(key, math.nan)) + (f" {interval}" if interval else "")

    lines = ["| figure | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean | sd |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for key in keys:
        cells = [cell(table["seeds"][seed], key) for seed in seeds]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {show(table['mean'].get(key, ''))} | "
                     f"{show(table['sd'].get(key, ''))} |")
    if table.get("incomplete"):
        lines += ["", "No mean (a seed lacks the figure): " + ", ".join(table["incomplete"])]
    unjudged = (f"not judged ({len(seeds)} seed{'s' if len(seeds) != 1 else ''}; {MIN_SEEDS} needed)"
                if len(seeds) < MIN_SEEDS else "n/a")
    lines += ["", f"| claim (on the mean over at least {MIN_SEEDS} seeds: its 95% interval clears 0) "
              "| mean difference [95% interval] | holds |", "|---|---|---|"]
    for claim, judged in table["claims"].items():
        mean = judged["mean"]
        shown = "n/a" if mean["value"] is None else f"{mean['value']:+.3f} {_interval(mean)}"
        holds = unjudged if judged["holds"] is None else "yes" if judged["holds"] else "no"
        lines.append(f"| {claim} | {shown} | {holds} |")
    return "\n".join(lines) + "\n"
