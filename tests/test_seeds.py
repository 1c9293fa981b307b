"""The learning benchmark's table over seeds (clemprm.evaluation.seeds) on real summaries: the tiny pipeline's
prm_eval.json, and the same summary with its PRM made worse."""

from __future__ import annotations

import copy
import json
import math

from clemprm.evaluation import seeds


def test_the_table_over_seeds_averages_per_seed_figures_and_judges_claims_on_the_mean(completed_run):
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    row = seeds.seed_row(summary)
    prm_accuracy = summary["prm"]["ranking"]["scorers"]["prm"]["overall"]["pairwise_accuracy"]["value"]
    if prm_accuracy is None:   # the tiny run's held-out siblings may all share a label
        assert math.isnan(row["ranking/prm/pairwise_accuracy"])
    else:
        assert row["ranking/prm/pairwise_accuracy"] == prm_accuracy
    # % played is defined whatever was played (quality is not when nothing was)
    beam = summary["differences"]["random_of_n"]["beam_search"]["overall"]["percent_played"]["value"]
    assert row["difference/beam_search-random_of_n/percent_played"] == beam
    assert row["gate"] == summary["prm"]["gate"]["status"]
    assert math.isnan(row["difference/beam_search-beam_search_logprob/quality"])   # not a default mode

    worse = copy.deepcopy(summary)
    overall = worse["prm"]["ranking"]["scorers"]["prm"]["overall"]
    overall["pairwise_accuracy"]["value"] = 0.0
    worse["differences"]["random_of_n"]["beam_search"]["overall"]["percent_played"]["value"] = beam - 10
    table = seeds.seeds_table({7: seeds.seed_row(summary), 11: {**seeds.seed_row(worse), "commit": "abc1234"}})
    assert set(table["seeds"]) == {7, 11}
    key = "difference/beam_search-random_of_n/percent_played"
    assert table["mean"][key] == beam - 5 and table["sd"][key] == math.sqrt(50)
    claim = table["claims"]["beam_search beats random_of_n on percent_played"]
    assert claim == (beam - 5 > 0)
    assert table["claims"]["best_of_n beats best_of_n_logprob on quality"] is None    # no such mode in the run
    assert "commit" not in table["mean"]
    text = seeds.markdown(table)
    assert "| seed 7 | seed 11 | mean | sd |" in text and "beam_search beats random_of_n on percent_played" in text
    assert "| commit | n/a | abc1234 |" in text
    # a table written as JSON (NaN included) reads back to the same rows: seeds run elsewhere join a later table
    again = seeds.seeds_table(seeds.rows_of(json.loads(json.dumps(table, allow_nan=True))))
    assert json.dumps(again, allow_nan=True, sort_keys=True) == json.dumps(table, allow_nan=True, sort_keys=True)
