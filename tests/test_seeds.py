"""The learning benchmark's table over seeds (clemprm.evaluation.seeds) on real summaries: the tiny pipeline's
prm_eval.json (blind: the default), the same summary with its PRM made worse, and a lookahead summary made from it."""

from __future__ import annotations

import copy
import json
import math

import pytest

from clemprm.evaluation import seeds


def test_the_table_over_seeds_averages_per_seed_figures_and_judges_claims_on_the_mean(completed_run):
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    assert summary["prm"]["input"] == "candidate" and seeds.prm_regime(summary) == "blind"
    row = seeds.seed_row(summary)
    prm_accuracy = summary["prm"]["ranking"]["scorers"]["prm"]["overall"]["pairwise_accuracy"]["value"]
    if prm_accuracy is None:   # the tiny run's held-out siblings may all share a label
        assert math.isnan(row["blind/ranking/prm/pairwise_accuracy"])
    else:
        assert row["blind/ranking/prm/pairwise_accuracy"] == prm_accuracy
    assert "blind/ranking/acceptance/pairwise_accuracy" in row   # the reference row beside the blind PRM
    # % played is defined whatever was played (quality is not when nothing was)
    best = summary["differences"]["random_of_n"]["best_of_n"]["overall"]["percent_played"]
    assert row["blind/difference/best_of_n-random_of_n/percent_played"] == best["value"]
    assert row["blind/difference/best_of_n-random_of_n/percent_played/ci"] == (   # led by its level, eval.ci
        f"{100 * summary['bootstrap']['ci']:g}% [{best['ci_low']:+.3f}, {best['ci_high']:+.3f}]")
    assert row["blind/gate"] == summary["prm"]["gate"]["status"]
    assert not any(key.startswith("lookahead/") for key in row)   # no lookahead mode in the default run

    worse = copy.deepcopy(summary)
    overall = worse["prm"]["ranking"]["scorers"]["prm"]["overall"]
    overall["pairwise_accuracy"]["value"] = 0.0
    worse["differences"]["random_of_n"]["best_of_n"]["overall"]["percent_played"]["value"] = best["value"] - 10
    table = seeds.seeds_table({7: seeds.seed_row(summary), 11: {**seeds.seed_row(worse), "commit": "abc1234"}})
    assert set(table["seeds"]) == {7, 11}
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    assert table["mean"][key] == best["value"] - 5 and table["sd"][key] == math.sqrt(50)
    assert {claim["holds"] for claim in table["claims"].values()} == {None}   # two seeds judge no claim
    assert "commit" not in table["mean"]
    text = seeds.markdown(table)
    assert "| seed 7 | seed 11 | mean | sd |" in text
    line = next(line for line in text.splitlines() if line.startswith("| blind: best_of_n beats random_of_n on pe"))
    assert line.endswith("| not judged (2 seeds; 3 needed) |")
    assert "| commit | n/a | abc1234 |" in text
    three = seeds.seeds_table({**table["seeds"], 42: seeds.seed_row(summary)})
    claim = three["claims"]["blind: best_of_n beats random_of_n on percent_played"]
    assert claim["mean"]["value"] == pytest.approx(best["value"] - 10 / 3)
    assert claim["holds"] == (claim["mean"]["ci_low"] > 0)   # the interval clears 0, not the point estimate
    assert three["claims"]["lookahead: beam_search beats beam_search_rule on quality"]["holds"] is None   # not run
    # a table written as JSON (NaN included) reads back to the same rows: seeds run elsewhere join a later table
    again = seeds.seeds_table(seeds.rows_of(json.loads(json.dumps(table, allow_nan=True))))
    assert json.dumps(again, allow_nan=True, sort_keys=True) == json.dumps(table, allow_nan=True, sort_keys=True)


def test_a_mean_is_taken_over_the_same_seeds_only(completed_run):
    """A figure one seed lacks has no mean: two means in one claim never come from different seeds."""
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    row = seeds.seed_row(summary)
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    partial = {k: v for k, v in row.items() if not k.startswith(key)}
    table = seeds.seeds_table({7: row, 11: row, 42: partial})
    assert math.isnan(table["mean"][key]) and key in table["incomplete"]
    assert table["claims"]["blind: best_of_n beats random_of_n on percent_played"]["holds"] is None
    assert "No mean (a seed lacks the figure): " in seeds.markdown(table)


def test_a_lookahead_run_is_tabulated_apart_against_its_rule_control(completed_run):
    """A summary whose PRM read the game's reply: its ranking rows are lookahead rows, and a record of best_of_n
    read as lookahead (made before the regimes) never counts as a blind search."""
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    lookahead = copy.deepcopy(summary)
    lookahead["prm"]["input"] = "candidate_with_reply"
    lookahead["modes"]["best_of_n"]["regime"] = "lookahead"
    row = seeds.seed_row(lookahead)
    assert "lookahead/ranking/prm/pairwise_accuracy" in row and "lookahead/gate" in row
    assert not any(key.startswith("blind/ranking") or key.startswith("blind/difference/best_of_n") for key in row)
    # a seed's blind row from another table joined by its lookahead run here: both regimes' figures, each its own
    blind = {**seeds.seed_row(summary), "blind/commit": "abc1234"}
    joined = seeds.join_row(blind, {**row, "lookahead/commit": "def5678"})
    assert joined == {**blind, **row, "lookahead/commit": "def5678"}
    rerun = seeds.join_row(joined, {"blind/commit": "0123456"})   # a regime run here replaces all it held before
    assert not any(key.startswith("blind/") for key in rerun if key != "blind/commit")
    assert {key: value for key, value in rerun.items() if key.startswith("lookahead/")} == {
        **row, "lookahead/commit": "def5678"}
    legacy = copy.deepcopy(summary)
    del legacy["prm"]["input"]   # a PRM from before prm.input read the reply
    assert seeds.prm_regime(legacy) == "lookahead"


def test_a_claim_holds_when_the_mean_over_seeds_clears_0_not_when_its_point_estimate_does():
    """The blind best_of_n - random_of_n of seeds 7, 11 and 42 (docs/data/learning_seeds.json): the mean is +7.2 %
    played, on the right side of 0, but its interval is not; a search that gains on every seed with tight intervals
    holds; the PRM's regret, where lower is better, holds when the interval lies below 0."""
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    measured = {7: (5.0, "[-10.000, +18.333]"), 11: (15.0, "[+1.667, +30.000]"), 42: (1.667, "[-13.333, +16.708]")}
    rows = {seed: {key: value, f"{key}/ci": interval} for seed, (value, interval) in measured.items()}
    claim = seeds.seeds_table(rows)["claims"]["blind: best_of_n beats random_of_n on percent_played"]
    assert claim["mean"]["value"] == pytest.approx(7.222, abs=1e-3) and claim["mean"]["ci_low"] < 0
    assert claim["holds"] is False
    regret = "blind/ranking/prm-candidate_length/top1_regret"
    rows = {seed: {key: gain, f"{key}/ci": f"[{gain - 2:+.3f}, {gain + 2:+.3f}]",
                   regret: -0.05, f"{regret}/ci": "[-0.070, -0.030]"}
            for seed, gain in ((7, 9.0), (11, 10.0), (42, 11.0))}
    claims = seeds.seeds_table(rows)["claims"]
    assert claims["blind: best_of_n beats random_of_n on percent_played"]["holds"] is True
    assert claims["blind: prm picks better than candidate_length (top-1 regret)"]["holds"] is True
    assert claims["blind: prm ranks siblings better than candidate_length (pairwise accuracy)"]["holds"] is None


def test_a_claim_reads_each_seed_interval_at_the_level_it_was_made_at():
    """The same bounds made at 90% stand for larger errors than at 95%: a claim whose seeds' own intervals decide
    holds at 95% made, not at 90% made; an interval written without a level (tables made before rows recorded it)
    is read at 95%."""
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    claim = "blind: best_of_n beats random_of_n on percent_played"

    def rows(interval):
        return {seed: {key: 3.0, f"{key}/ci": interval} for seed in (7, 11, 42)}

    at_95 = seeds.seeds_table(rows("95% [+0.100, +5.900]"))["claims"][claim]
    at_90 = seeds.seeds_table(rows("90% [+0.100, +5.900]"))["claims"][claim]
    assert at_95["holds"] is True and at_90["holds"] is False
    assert at_90["mean"]["ci_low"] < at_95["mean"]["ci_low"]
    assert seeds.seeds_table(rows("[+0.100, +5.900]"))["claims"][claim] == at_95
