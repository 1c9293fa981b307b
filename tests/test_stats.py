"""clemprm.stats against definitions computed the long way, on random data."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from clemprm import stats


def brute_auroc(scores, labels):
    """P(score of a positive > score of a negative), ties half: every pair counted."""
    positives = [s for s, y in zip(scores, labels) if y > 0.5]
    negatives = [s for s, y in zip(scores, labels) if y <= 0.5]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


def mean_ranks(values):
    order = sorted(values)
    return [np.mean([i + 1 for i, v in enumerate(order) if v == value]) for value in values]


@pytest.mark.parametrize("seed", range(5))
def test_correlations_and_auroc_match_their_definitions_on_random_data(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 60))
    scores = list(np.round(rng.normal(size=n), 1))      # rounded: ties happen
    labels = list(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=n))
    labels[0], labels[1] = 0.0, 1.0                      # both classes present
    x, y = np.array(scores), np.array(labels)
    dx, dy = x - x.mean(), y - y.mean()
    pearson = (dx * dy).sum() / np.sqrt((dx ** 2).sum() * (dy ** 2).sum())
    assert stats.pearson(scores, labels) == pytest.approx(pearson, abs=1e-12)
    rx, ry = np.array(mean_ranks(scores)), np.array(mean_ranks(labels))
    spearman = np.corrcoef(rx, ry)[0, 1]
    assert stats.spearman(scores, labels) == pytest.approx(spearman, abs=1e-12)
    assert stats.auroc(scores, labels) == pytest.approx(brute_auroc(scores, labels), abs=1e-12)


def test_undefined_correlations_and_auroc_are_none():
    assert stats.pearson([1, 1, 1], [0, 1, 0]) is None and stats.spearman([1, 2], [3, 3]) is None
    assert stats.pearson([1], [2]) is None
    assert stats.auroc([0.2, 0.4], [0.7, 0.9]) is None and stats.auroc([0.2, 0.4], [0.0, 0.5]) is None


def instance_sums(rng, games=("a", "b"), instances=12):
    rows = [(game, "e", str(i), float(rng.integers(0, 5)), 4.0) for game in games for i in range(instances)]
    return pd.DataFrame(rows, columns=["game", "experiment", "game_id", "wins", "episodes"]).set_index(
        ["game", "experiment", "game_id"])


def win_rate(tables, weights):
    per_game = {game: {"rate": (weights[game] @ t["wins"].to_numpy()) / (weights[game] @ t["episodes"].to_numpy())}
                for game, t in tables.items()}
    return {**per_game, stats.OVERALL: stats.macro_average(list(per_game.values()), ["rate"])}


def test_bootstrap_point_is_the_plain_estimate_and_draws_resample_within_games():
    table = instance_sums(np.random.default_rng(0))
    tables = stats.split_by_game(table)
    result = stats.bootstrap(tables, win_rate, samples=500, seed=3, ci=0.9)
    for game, part in tables.items():
        assert result[game]["rate"]["value"] == pytest.approx(part["wins"].sum() / part["episodes"].sum())
        assert result[game]["rate"]["ci_low"] < result[game]["rate"]["value"] < result[game]["rate"]["ci_high"]
    weights = stats.bootstrap_weights(tables, 500, 3)
    assert all((w.sum(axis=1) == len(tables[g])).all() for g, w in weights.items())   # every game keeps its size
    assert result == stats.bootstrap(tables, win_rate, samples=500, seed=3, ci=0.9)   # seeded


def test_paired_difference_of_a_table_with_itself_is_exactly_zero_and_keeps_common_instances():
    table = instance_sums(np.random.default_rng(1))
    other = table.copy()
    other["wins"] = np.minimum(other["wins"] + 1, 4)
    same = stats.paired_difference(table, table, win_rate, 200, 0, 0.95)
    assert same[stats.OVERALL]["rate"] == {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0, "detectable": 0.0}
    better = stats.paired_difference(other, table.iloc[:-3], win_rate, 200, 0, 0.95)
    assert better[stats.OVERALL]["instances"] == len(table) - 3
    assert better[stats.OVERALL]["rate"]["ci_low"] > 0
    assert stats.paired_difference(other, table.iloc[:0], win_rate, 200, 0, 0.95) == {}


def test_the_detectable_difference_is_what_a_paired_interval_clears_0_for_in_80_percent_of_runs():
    """2.8 standard errors at 95 % and 80 %: a true difference that size clears 0 in about 80 % of runs."""
    sd, n = 1.0, 400
    assert stats.detectable_difference(np.random.default_rng(0).normal(0, sd / np.sqrt(n), 4000), 0.95) == \
        pytest.approx(2.80 * sd / np.sqrt(n), rel=0.05)
    assert stats.detectable_difference(np.array([np.nan, 1.0]), 0.95) is None
    assert stats.detectable_difference(np.random.default_rng(0).normal(0, 1.0, 4000), 0.90, power=0.5) == \
        pytest.approx(1.645, rel=0.05)   # at power 1/2: the interval's own half-width


def test_a_paired_difference_says_what_it_could_detect_and_more_instances_detect_less():
    table = instance_sums(np.random.default_rng(4), instances=120)
    other = table.copy()
    other["wins"] = np.random.default_rng(5).permutation(other["wins"].to_numpy())
    first = [i for i, key in enumerate(table.index) if int(key[2]) < 12]   # 12 instances per game
    small = stats.paired_difference(other.iloc[first], table.iloc[first], win_rate, 400, 0, 0.95)
    large = stats.paired_difference(other, table, win_rate, 400, 0, 0.95)
    for result in (small, large):
        rate = result[stats.OVERALL]["rate"]
        assert rate["detectable"] == pytest.approx(2.80 / (2 * 1.96) * (rate["ci_high"] - rate["ci_low"]), rel=0.2)
    assert large[stats.OVERALL]["rate"]["detectable"] < small[stats.OVERALL]["rate"]["detectable"]


def test_derive_seed_is_stable_and_63_bit():
    assert stats.derive_seed(1, "a", 2) == stats.derive_seed(1, "a", 2) != stats.derive_seed(1, "a", 3)
    assert 0 <= stats.derive_seed("x") < 2 ** 63


def test_the_mean_over_seeds_takes_the_wider_of_the_seeds_spread_and_their_own_intervals():
    """Three seeds that agree do not hide each seed's noise, and narrow intervals do not hide the draw's spread."""
    t2 = 4.302653   # the 97.5% quantile of Student's t with 2 degrees of freedom
    agreeing = [{"value": v, "ci_low": v - 20.0, "ci_high": v + 20.0, "level": 0.95} for v in (4.0, 4.5, 5.0)]
    mean = stats.mean_over_seeds(agreeing, 0.95)
    assert mean["value"] == pytest.approx(4.5)
    assert mean["ci_high"] - mean["value"] == pytest.approx(20.0) and mean["ci_low"] < 0
    spread = [{"value": v, "ci_low": v - 0.1, "ci_high": v + 0.1, "level": 0.95} for v in (-2.0, 5.0, 12.0)]
    mean = stats.mean_over_seeds(spread, 0.95)
    assert mean["ci_high"] - mean["value"] == pytest.approx(t2 * np.std([-2.0, 5.0, 12.0], ddof=1) / np.sqrt(3))
    assert mean["ci_low"] < 0
    consistent = [{"value": v, "ci_low": v - 1.0, "ci_high": v + 1.0, "level": 0.95} for v in (3.0, 3.5, 4.0)]
    assert stats.mean_over_seeds(consistent, 0.95)["ci_low"] > 0
    missing = consistent[:2] + [{"value": None, "ci_low": None, "ci_high": None}]
    assert stats.mean_over_seeds(missing, 0.95) == {"value": None, "ci_low": None, "ci_high": None}
    assert stats.mean_over_seeds(consistent[:1], 0.95)["value"] is None   # one seed has no interval over seeds


def test_the_seeds_own_errors_combine_as_fully_correlated_the_mean_of_their_standard_errors():
    """Seeds tested on the same instances share their evaluation noise: the within-seed term is the mean of the
    seeds' standard errors (here 1, 2 and 6: 3), not their root sum of squares over n (2.16), which would shrink
    the noise as if each seed had drawn its own test instances."""
    z = 1.959964
    seeds = [{"value": 0.0, "ci_low": -z * error, "ci_high": z * error, "level": 0.95} for error in (1.0, 2.0, 6.0)]
    mean = stats.mean_over_seeds(seeds, 0.95)
    assert mean["ci_high"] == pytest.approx(z * 3.0)
    assert mean["ci_high"] > z * np.sqrt(1 + 4 + 36) / 3   # what independent errors would give


def test_the_mean_over_seeds_reads_each_interval_at_its_level_and_gives_the_requested_one():
    """An interval at 0.9 comes out narrower than at 0.95; a seed's interval made at 0.9 stands for a larger
    standard error than the same interval made at 0.95."""
    def seeds(level):
        return [{"value": v, "ci_low": v - 1.0, "ci_high": v + 1.0, "level": level} for v in (0.5, 0.5, 0.5)]

    def width(estimate):
        return estimate["ci_high"] - estimate["ci_low"]

    z90, z95 = 1.644854, 1.959964
    at_90, at_95 = stats.mean_over_seeds(seeds(0.95), 0.9), stats.mean_over_seeds(seeds(0.95), 0.95)
    assert width(at_90) < width(at_95) == pytest.approx(2.0)
    assert width(at_90) == pytest.approx(2.0 * z90 / z95)
    made_at_90 = stats.mean_over_seeds(seeds(0.9), 0.95)
    assert width(made_at_90) == pytest.approx(2.0 * z95 / z90) and width(made_at_90) > width(at_95)
    assert width(stats.mean_over_seeds(seeds(0.9), 0.9)) == pytest.approx(2.0)   # the same level both ways


def test_an_overall_difference_of_a_mean_over_games_covers_the_games_both_sides_have():
    """Side b has no rate in game c (no episode there): the overall difference of a macro average is the mean of the
    per-game differences over a and b, and says it covers 2 games; the difference of the two macro averages would
    set a's mean over three games against b's over two."""
    rng = np.random.default_rng(4)
    a = instance_sums(rng, games=("a", "b", "c"))
    b = a.copy()
    b["wins"] = np.maximum(b["wins"] - 1, 0)
    b.loc["c", ["wins", "episodes"]] = 0.0   # nothing played in c: b's rate there is undefined
    a.loc["c", "wins"] = 4.0       # a wins all of c: far above its other games
    with np.errstate(invalid="ignore", divide="ignore"):
        result = stats.paired_difference(a, b, win_rate, 300, 0, 0.95, macro=("rate",))
    per_game = [result[game]["rate"]["value"] for game in ("a", "b")]
    assert result["c"]["rate"]["value"] is None
    assert result[stats.OVERALL]["games"] == {"rate": 2}
    assert result[stats.OVERALL]["rate"]["value"] == pytest.approx(np.mean(per_game))
    rates = {side: {game: part["wins"].sum() / part["episodes"].sum() for game, part in table.groupby(level="game")}
             for side, table in (("a", a), ("b", b.loc[["a", "b"]]))}
    of_averages = np.mean(list(rates["a"].values())) - np.mean(list(rates["b"].values()))
    assert of_averages > result[stats.OVERALL]["rate"]["ci_high"]   # what the old overall said: a's c won it
    assert result[stats.OVERALL]["rate"]["ci_low"] > 0
    with np.errstate(invalid="ignore", divide="ignore"):   # a pooled or everywhere-defined overall
        plain = stats.paired_difference(a, b, win_rate, 300, 0, 0.95)
    assert plain[stats.OVERALL]["rate"]["value"] == pytest.approx(of_averages)
