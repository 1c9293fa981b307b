"""Statistics, in one place: seeds derived by hashing, the within-game paired bootstrap, means over seeds,
correlations and AUROC.

The bootstrap's unit is the instance ``(game, experiment, game_id)``: a caller sums what it measures per instance
into one table per game (its sufficient statistics, one row per instance), and a *statistic* turns such tables and
per-game instance weights into metric arrays per game and overall (one value per row of the weights). Draws resample
instances with replacement within each game (every game keeps its size), seeded per game and size: two modes, or two
scorers, on the same instances get the same draws, so their difference is paired; a difference of a metric averaged
over games is averaged over the games where both sides have it (:func:`difference`). Intervals are percentile
intervals; a paired difference also says the smallest difference its draws could detect
(:func:`detectable_difference`). Over seeds, :func:`mean_over_seeds` combines each seed's figure and interval.
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


POWER = 0.8   # the chance a detectable difference (:func:`detectable_difference`) is seen


def detectable_difference(draws: np.ndarray, ci: float, power: float = POWER) -> float | None:
    """The smallest true difference that a paired difference with these bootstrap ``draws`` would show with its
    ``ci`` interval clear of 0 in ``power`` of runs like this one: ``(z_(1+ci)/2 + z_power)`` standard errors, the
    draws' standard deviation being the standard error (2.8 of them at 95 % and 80 %). A claim that holds no
    difference said what it could have seen; None without draws."""
    from scipy import stats

    draws = draws[~np.isnan(draws)]
    if draws.size < 2:
        return None
    return float((stats.norm.ppf(0.5 + ci / 2) + stats.norm.ppf(power)) * np.std(draws, ddof=1))


def bootstrap(tables: dict[str, pd.DataFrame], statistic: Statistic, samples: int, seed: int, ci: float,
              baseline: dict[str, pd.DataFrame] | None = None,
              macro: tuple[str, ...] = ()) -> dict[str, dict[str, dict]]:
    """Every metric of ``statistic`` per group (game, overall) as a point estimate with its interval. With
    ``baseline`` (tables of the same instances, in the same order), the paired difference ``tables - baseline``:
    both sides computed on the same draws (:func:`difference`; ``macro``: the metrics whose overall is a mean over
    games, :func:`macro_average`), and under ``OVERALL`` ``games``: per metric, how many games its overall difference
    covers (the games where both sides are defined); each difference's ``detectable`` is
    :func:`detectable_difference` of its draws."""
    ones = {game: np.ones((1, len(part))) for game, part in tables.items()}
    weights = bootstrap_weights(tables, samples, seed)
    points, draws = statistic(tables, ones), statistic(tables, weights)
    games = None
    if baseline is not None:
        base_points = statistic(baseline, ones)
        games = shared_games(points, base_points, points[OVERALL])
        points = difference(points, base_points, macro)
        draws = difference(draws, statistic(baseline, weights), macro)
    result = {group: {metric: interval(points[group][metric][0], draws[group][metric], ci) for metric in metrics}
              for group, metrics in points.items()}
    if games is not None:
        for group, metrics in result.items():
            for metric, estimate in metrics.items():
                detectable = detectable_difference(draws[group][metric], ci) if estimate["value"] is not None else None
                estimate["detectable"] = None if detectable is None else round(detectable, 6)
        result[OVERALL]["games"] = games
    return result


def paired_difference(table: pd.DataFrame, baseline: pd.DataFrame, statistic: Statistic, samples: int, seed: int,
                      ci: float, macro: tuple[str, ...] = ()) -> dict[str, dict]:
    """``table - baseline`` (per-instance tables indexed by ``(game, experiment, game_id)``) on the instances both
    have, per game and overall, with paired intervals, each group's instance count and the games each overall
    difference covers (:func:`bootstrap`); {} when they share none."""
    common = table.index.intersection(baseline.index)
    if common.empty:
        return {}
    tables = split_by_game(table.loc[common])
    result = bootstrap(tables, statistic, samples, seed, ci, baseline=split_by_game(baseline.loc[common]),
                       macro=macro)
    for group in result:
        result[group]["instances"] = len(common) if group == OVERALL else len(tables[group])
    return result


def difference(a: dict[str, dict], b: dict[str, dict], macro: tuple[str, ...] = ()) -> dict[str, dict]:
    """``a - b`` of two outputs of one statistic (one value per draw), per game and overall. The overall difference
    of a ``macro`` metric is the mean over games of the per-game differences, over the games where both sides are
    defined in that draw (NaN where there is none): the difference of two macro averages would compare different
    sets of games where one side is undefined in a game (quality where a mode played no episode). Other overall
    metrics (a pooled ratio, clemscore, defined everywhere) are subtracted as they are."""
    result = {group: {metric: a[group][metric] - b[group][metric] for metric in a[group]} for group in a}
    games = [group for group in a if group != OVERALL]
    for metric in macro:
        result[OVERALL][metric] = macro_average([result[game] for game in games], (metric,))[metric]
    return result


def shared_games(a: dict[str, dict], b: dict[str, dict], metrics) -> dict[str, int]:
    """Per metric, the games where both point estimates ``a`` and ``b`` (one statistic's outputs) are defined."""
    games = [group for group in a if group != OVERALL]
    return {metric: sum(not (np.isnan(a[game][metric][0]) or np.isnan(b[game][metric][0])) for game in games)
            for metric in metrics}


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


def mean_over_seeds(estimates: list[dict], ci: float) -> dict:
    """The mean of one figure over seeds, each seed's estimate a point with its interval (:func:`interval`) and the
    level that interval was made at (``level``: the seed's ``eval.ci`` or ``prm.ci``), and an interval at level ``ci``
    for the mean: the wider of two. One from the seeds' spread (Student's t with n - 1 degrees of freedom: how much
    a new draw of instances, labels and training moves the figure); one from each seed's own interval (a seed's
    standard error: half its interval's width over the normal quantile of its level), the seeds' errors combined as
    fully correlated, the mean of their standard errors: the seeds are evaluated on the same instances (the test
    split, whole for every seed), so the evaluation noise they show is largely one noise, and averaging seeds does
    not shrink it (combined as independent, three seeds would divide it by sqrt(3)). With three seeds neither
    interval alone is safe: three seeds that happen to agree would hide the noise each seed's interval shows, and
    seeds with narrow intervals would hide how far the draw moves the figure. Null where a seed lacks the figure or
    its interval, or with fewer than two seeds."""
    from scipy import stats

    if len(estimates) < 2 or any(e.get("value") is None or e.get("ci_low") is None for e in estimates):
        return {"value": None, "ci_low": None, "ci_high": None}
    if any(e.get("level") is None for e in estimates):
        raise ValueError("mean_over_seeds: every seed's interval needs the level it was made at ('level', e.g. 0.95)")
    values = np.array([e["value"] for e in estimates], dtype=float)
    errors = np.array([(e["ci_high"] - e["ci_low"]) / (2 * stats.norm.ppf(0.5 + e["level"] / 2)) for e in estimates])
    within = stats.norm.ppf(0.5 + ci / 2) * float(errors.mean())
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
