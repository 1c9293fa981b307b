"""Statistics, in one place: seeds derived by hashing, the within-game paired bootstrap, means over seeds,
correlations and AUROC.

The bootstrap's unit is the instance ``(game, experiment, game_id)``: a caller sums what it measures per instance
into one table per game (its sufficient statistics, one row per instance), and a *statistic* turns such tables and
per-game instance weights into metric arrays per game and overall (one value per row of the weights). Draws resample
instances with replacement within each game (every game keeps its size), seeded per game and size: two modes, or two
scorers, on the same instances get the same draws, so their difference is paired. Intervals are percentile intervals.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import numpy as np
import pandas as pd

OVERALL = "overall"

# tables: {game: per-instance sums}, weights: {game: draws x instances} -> {game or OVERALL: {metric: draws}}
Statistic = Callable[[dict[str, pd.DataFrame], dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]


def derive_seed(*parts) -> int:
    """A 63-bit seed from any parts (base seed, stage, episode id, turn): stable across machines and runs."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ------------------------------------------------------------------------------------------------ bootstrap


def split_by_game(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """A per-instance table indexed by ``(game, experiment, game_id)`` as one table per game, games sorted."""
    return {game: part for game, part in table.groupby(level="game", sort=True)}


def bootstrap_weights(tables: dict[str, pd.DataFrame], samples: int, seed: int) -> dict[str, np.ndarray]:
    """Per game, ``samples`` draws of its instances with replacement (as counts), seeded per game and size: two
    modes on the same instances get the same draws (paired), and a game's draws do not depend on other games."""
    weights = {}
    for game, table in tables.items():
        rng = np.random.default_rng(derive_seed(seed, "bootstrap", game, len(table)))
        weights[game] = rng.multinomial(len(table), np.full(len(table), 1 / len(table)), size=samples)
    return weights


def interval(point: float, draws: np.ndarray, ci: float) -> dict:
    """Point estimate and percentile bootstrap interval; null where undefined (e.g. quality with nothing played)."""
    draws = draws[~np.isnan(draws)]
    if math.isnan(point) or not draws.size:
        return {"value": None, "ci_low": None, "ci_high": None}
    low, high = np.percentile(draws, [50 * (1 - ci), 50 * (1 + ci)])
    return {"value": float(point), "ci_low": float(low), "ci_high": float(high)}


def bootstrap(tables: dict[str, pd.DataFrame], statistic: Statistic, samples: int, seed: int, ci: float,
              baseline: dict[str, pd.DataFrame] | None = None) -> dict[str, dict[str, dict]]:
    """Every metric of ``statistic`` per group (game, overall) as a point estimate with its interval. With
    ``baseline`` (tables of the same instances, in the same order), the paired difference ``tables - baseline``:
    both sides computed on the same draws."""
    ones = {game: np.ones((1, len(part))) for game, part in tables.items()}
    weights = bootstrap_weights(tables, samples, seed)
    points, draws = statistic(tables, ones), statistic(tables, weights)
    if baseline is not None:
        points = _subtract(points, statistic(baseline, ones))
        draws = _subtract(draws, statistic(baseline, weights))
    return {group: {metric: interval(points[group][metric][0], draws[group][metric], ci) for metric in metrics}
            for group, metrics in points.items()}


def paired_difference(table: pd.DataFrame, baseline: pd.DataFrame, statistic: Statistic, samples: int, seed: int,
                      ci: float) -> dict[str, dict]:
    """``table - baseline`` (per-instance tables indexed by ``(game, experiment, game_id)``) on the instances both
    have, per game and overall, with paired intervals and each group's instance count; {} when they share none."""
    common = table.index.intersection(baseline.index)
    if common.empty:
        return {}
    tables = split_by_game(table.loc[common])
    result = bootstrap(tables, statistic, samples, seed, ci, baseline=split_by_game(baseline.loc[common]))
    for group in result:
        result[group]["instances"] = len(common) if group == OVERALL else len(tables[group])
    return result


def _subtract(a: dict[str, dict], b: dict[str, dict]) -> dict[str, dict]:
    return {group: {metric: a[group][metric] - b[group][metric] for metric in a[group]} for group in a}


def macro_average(per_game: list[dict[str, np.ndarray]], metrics) -> dict[str, np.ndarray]:
    """clembench's overall: each metric averaged over games, over the games where it is defined (quality with
    nothing played is not)."""
    overall = {}
    for metric in metrics:
        stacked = np.vstack([values[metric] for values in per_game])
        defined = ~np.isnan(stacked)
        overall[metric] = np.where(defined.any(axis=0), np.nansum(stacked, axis=0) / np.maximum(defined.sum(axis=0), 1),
                                   np.nan)
    return overall


# ---------------------------------------------------------------------------------------------- over seeds


def mean_over_seeds(estimates: list[dict], ci: float = 0.95) -> dict:
    """The mean of one figure over seeds, each seed's estimate a point with its interval (:func:`interval`), and a
    conservative interval for the mean: the wider of two. One from the seeds' spread (Student's t with n - 1
    degrees of freedom: how much a new draw of instances, labels and training moves the figure); one from each
    seed's own interval (normal, seeds independent, half the interval's width over z a seed's standard error: the
    evaluation's own noise). With three seeds neither alone is safe: three seeds that happen to agree would hide
    the noise each seed's interval shows, and seeds with narrow intervals would hide how far the draw moves the
    figure. Null where a seed lacks the figure or its interval, or with fewer than two seeds."""
    from scipy import stats

    if len(estimates) < 2 or any(e.get("value") is None or e.get("ci_low") is None for e in estimates):
        return {"value": None, "ci_low": None, "ci_high": None}
    values = np.array([e["value"] for e in estimates], dtype=float)
    z = stats.norm.ppf(0.5 + ci / 2)
    errors = np.array([(e["ci_high"] - e["ci_low"]) / (2 * z) for e in estimates])
    within = z * math.sqrt(float(np.sum(errors ** 2))) / len(values)
    between = stats.t.ppf(0.5 + ci / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    mean, half = float(values.mean()), float(max(within, between))
    return {"value": mean, "ci_low": mean - half, "ci_high": mean + half}


# --------------------------------------------------------------------------------------- correlations, AUROC


def _finite(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation; None when either side is constant (or there are fewer than two points)."""
    from scipy import stats

    if len(x) < 2 or min(x) == max(x) or min(y) == max(y):
        return None
    return _finite(stats.pearsonr(x, y).statistic)


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman rank correlation (ties share their mean rank); None when either side is constant."""
    from scipy import stats

    if len(x) < 2 or min(x) == max(x) or min(y) == max(y):
        return None
    return _finite(stats.spearmanr(x, y).statistic)


def auroc(scores: list[float], labels: list[float]) -> float | None:
    """AUROC of ``scores`` for ``label > 0.5`` (ties count half); None when a class is missing."""
    from sklearn.metrics import roc_auc_score

    positive = [label > 0.5 for label in labels]
    if all(positive) or not any(positive):
        return None
    return _finite(roc_auc_score(positive, scores))
