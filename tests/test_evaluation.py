"""The eval stage on real built-in games (scripted policies, a scripted PRM): per-mode parquet, the bootstrap
summary in prm_eval.json and its schema, and the report figures."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clemprm import records
from clemprm.evaluation import evaluate, report
from clemprm.config import sections
from clemprm.modes import MODES
from tests.conftest import binary_search_answer, tiny_config
from tests.test_search import JUNK, ScriptedPRM

SETTINGS = sections(tiny_config(games={"max_instances": {"validation": 4}},
                                eval={"bootstrap_samples": 200, "n": 3, "num_beam_iterations": 8}),
                    "seed", "model", "games", "eval")


def mixed_answer(messages, seed=0):
    """Sometimes perfect, sometimes rule-breaking, sometimes valid but wrong: every outcome occurs."""
    first = messages[0]["content"]
    if "GUESS" in first:
        return [binary_search_answer(messages), JUNK, "GUESS: 1"][seed % 3]
    return "DESCRIPTION: something you can hold" if "DESCRIPTION" in first else ["ANSWER: apple", JUNK][seed % 2]


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, scripted_policy):
    """Every mode evaluated once (same scripted policy for base and SFT), then the summary."""
    from clemprm.play.contract import Generation

    class SeededPolicy(scripted_policy):
        def generate(self, perspectives, seeds=None, **kwargs):
            self.calls.append(len(perspectives))
            texts = [mixed_answer(messages, seed) for messages, seed in zip(perspectives, seeds)]
            return [Generation(text=t, raw_text=t, prompt_tokens=1, new_tokens=len(t.split())) for t in texts]

    folder = tmp_path_factory.mktemp("eval")
    prm = ScriptedPRM(lambda messages, candidate: 0.1 if candidate == JUNK else 0.5 + 0.4 * ("GUESS: 1" != candidate))
    paths, policies = {}, {}
    with recording_answers() as answers:
        for mode in evaluate.episode_modes():
            paths[mode] = str(folder / f"{mode}.parquet")
            policies[mode] = SeededPolicy(None, name=f"scripted-{mode}")
            answers.mode = mode
            evaluate.evaluate_mode(mode, SETTINGS, paths[mode], policy=policies[mode], prm=prm)
    summary = evaluate.summarize_eval(SETTINGS, list(paths.values()), str(folder / "prm_eval.json"))
    return paths, summary, folder / "prm_eval.json", policies, answers


class AnswersByTurn(dict):
    """mode -> (the played game, the answers it had received before) -> how many answers it then received: 1 at
    every turn when the game saw only the chosen answer."""

    mode = None


@contextlib.contextmanager
def recording_answers():
    """Every game records every answer it receives: a game started by ``reset`` gets its own key, and its forks
    (deep copies) keep it, so the answers a search tried in forks count against the game they were tried for."""
    from clemcore.clemgame.envs.pettingzoo.master import GameMasterEnv

    answers, games = AnswersByTurn(), itertools.count()
    reset, step = GameMasterEnv.reset, GameMasterEnv.step

    def recording_reset(self, *args, **kwargs):
        self.recorded_game, self.recorded_answers = next(games), 0
        return reset(self, *args, **kwargs)

    def recording_step(self, action, *args, **kwargs):
        counts = answers.setdefault(answers.mode, collections.Counter())
        counts[(self.recorded_game, self.recorded_answers)] += 1
        self.recorded_answers += 1
        return step(self, action, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GameMasterEnv, "reset", recording_reset)
        patch.setattr(GameMasterEnv, "step", recording_step)
        yield answers


def test_blind_modes_show_the_game_one_answer_per_turn_and_lookahead_modes_more(eval_run):
    *_, answers = eval_run
    for mode in evaluate.episode_modes():
        counts = answers[mode]
        assert counts, mode
        if MODES[mode].regime == "blind":
            assert set(counts.values()) == {1}, mode
        else:
            assert max(counts.values()) > 1, mode


def test_each_mode_writes_eval_episodes_with_costs(eval_run):
    paths, summary, _, policies, _ = eval_run
    rows = {mode: records.read_records(path, records.EVAL_EPISODES) for mode, path in paths.items()}
    keys = {mode: [(r["game"], r["experiment"], r["game_id"], r["seed"]) for r in mode_rows]
            for mode, mode_rows in rows.items()}
    assert len({tuple(k) for k in keys.values()}) == 1 and len(keys["greedy_base"]) == 3 * 4   # same episodes
    assert {r["game"] for r in rows["greedy_base"]} == {"guessnumber", "wordref", "oddoneout"}
    for mode, mode_rows in rows.items():
        assert {r["mode"] for r in mode_rows} == {mode} and {r["split"] for r in mode_rows} == {"validation"}
        assert all(r["policy_tokens"] >= sum(t["new_tokens"] for t in r["turns"]) for r in mode_rows)
        run = records.read_provenance(paths[mode])["run"]
        assert run["mode"] == mode and run["policy"]["name"] == policies[mode].name and run["wall_seconds"] >= 0
    for r in rows["greedy_sft"]:
        assert r["prm_pairs"] == 0 and r["search_nodes"] == r["n_turns"] and r["temperature"] == 0
    for r in rows["best_of_n"]:
        assert r["search_nodes"] == 3 * r["n_turns"] and 0 < r["prm_pairs"] <= r["search_nodes"]
    assert all(r["search_nodes"] >= r["n_turns"] for r in rows["beam_search"])
    for r in rows["random_of_n"]:
        assert r["search_nodes"] == 3 * r["n_turns"] and r["prm_pairs"] == 0 and r["temperature"] > 0
    # the PRM steers away from rule-breaking answers; a random pick among the same candidates does not
    aborted = {mode: sum(r["aborted"] for r in mode_rows) for mode, mode_rows in rows.items()}
    assert aborted["best_of_n"] < aborted["greedy_sft"] and aborted["beam_search"] < aborted["greedy_sft"]
    assert aborted["best_of_n"] < aborted["random_of_n"]
    assert summary["modes"]["random_of_n"]["prm"] is None


def recompute(rows: list[dict]) -> dict:
    """% played, quality, clemscore, success rate per game and overall (macro), straight from the rows."""
    games = {}
    for game in sorted({r["game"] for r in rows}):
        game_rows = [r for r in rows if r["game"] == game]
        played = [r for r in game_rows if not r["aborted"]]
        quality = sum(r["bench_score"] for r in played) / len(played) if played else math.nan
        percent = 100 * len(played) / len(game_rows)
        games[game] = {"percent_played": percent, "quality": quality,
                       "clemscore": 0.0 if math.isnan(quality) else percent / 100 * quality,
                       "success_rate": 100 * sum(r["success"] for r in game_rows) / len(game_rows)}
    qualities = [g["quality"] for g in games.values() if not math.isnan(g["quality"])]
    percent = sum(g["percent_played"] for g in games.values()) / len(games)
    quality = sum(qualities) / len(qualities) if qualities else math.nan
    games["overall"] = {"percent_played": percent, "quality": quality,
                        "clemscore": 0.0 if math.isnan(quality) else percent / 100 * quality,
                        "success_rate": sum(g["success_rate"] for g in games.values()) / len(games)}
    return games


def test_summary_numbers_match_the_episode_files(eval_run):
    paths, summary, _, _, _ = eval_run
    for mode, path in paths.items():
        rows = records.read_records(path, records.EVAL_EPISODES)
        results = summary["modes"][mode]["results"]
        for group, expected in recompute(rows).items():
            for metric, value in expected.items():
                got = results[group][metric]["value"]
                assert (got is None and math.isnan(value)) or got == pytest.approx(value), (mode, group, metric)
        assert results["overall"]["episodes"] == len(rows)
        assert summary["modes"][mode]["cost"]["policy_tokens"] == sum(r["policy_tokens"] for r in rows)
        assert summary["modes"][mode]["cost"]["prm_pairs"] == sum(r["prm_pairs"] for r in rows)
    best, sft = summary["modes"]["best_of_n"]["results"], summary["modes"]["greedy_sft"]["results"]
    diff = summary["differences"]["greedy_sft"]["best_of_n"]["overall"]
    assert diff["percent_played"]["value"] == pytest.approx(
        best["overall"]["percent_played"]["value"] - sft["overall"]["percent_played"]["value"])
    assert set(summary["differences"]) == set(evaluate.baselines())
    blind = {mode for mode in evaluate.episode_modes() if MODES[mode].regime == "blind"}
    assert set(summary["differences"]["greedy_base"]) == blind - {"greedy_base"}   # within its regime only
    assert set(summary["differences"]["beam_search_rule"]) == set(evaluate.episode_modes()) - blind - {
        "beam_search_rule"}
    assert {mode: entry["regime"] for mode, entry in summary["modes"].items()} == {
        mode: MODES[mode].regime for mode in evaluate.episode_modes()}


def test_records_made_before_the_regimes_are_read_as_lookahead_with_a_warning(eval_run, tmp_path):
    """A search's records without the regime mark played their candidates in forks (the only way then)."""
    paths, *_ = eval_run
    table = pq.read_table(paths["best_of_n"])
    provenance = json.loads(table.schema.metadata[b"clemprm"])
    del provenance["run"]["regime"]
    old = tmp_path / "best_of_n.parquet"
    pq.write_table(table.replace_schema_metadata({b"clemprm": json.dumps(provenance).encode()}), old)
    summary = evaluate.summarize_eval(SETTINGS, [str(old), paths["random_of_n"], paths["greedy_sft"]],
                                      str(tmp_path / "summary.json"))
    assert summary["modes"]["best_of_n"]["regime"] == "lookahead"
    assert summary["modes"]["greedy_sft"]["regime"] == summary["modes"]["random_of_n"]["regime"] == "blind"
    assert "best_of_n" not in summary["differences"]["random_of_n"]   # never compared with a blind control
    assert any("no regime mark" in warning and "best_of_n.parquet" in warning for warning in summary["warnings"])


def estimates_of(node):
    if isinstance(node, dict):
        if set(node) == {"value", "ci_low", "ci_high"}:
            yield node
        for value in node.values():
            yield from estimates_of(value)


def test_bootstrap_intervals_are_seeded_and_contain_the_point_estimate(eval_run, tmp_path):
    paths, summary, _, _, _ = eval_run
    again = evaluate.summarize_eval(SETTINGS, list(paths.values()), str(tmp_path / "again.json"))
    assert again["modes"] == summary["modes"] and again["differences"] == summary["differences"]
    other_seed = evaluate.summarize_eval({**SETTINGS, "seed": SETTINGS["seed"] + 1}, list(paths.values()),
                                         str(tmp_path / "other.json"))
    assert other_seed["modes"] != summary["modes"]
    intervals = [e for e in estimates_of(summary) if e["value"] is not None]
    assert len(intervals) > 50
    for e in intervals:
        assert e["ci_low"] - 1e-9 <= e["value"] <= e["ci_high"] + 1e-9, e
    assert any(e["ci_low"] < e["ci_high"] for e in intervals)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation between the sorted values (numpy's default), by hand."""
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@pytest.mark.parametrize("ci", [0.5, 0.9])
def test_bootstrap_interval_is_the_percentile_interval_of_instance_draws(eval_run, tmp_path, ci):
    """% played per game and overall, recomputed draw by draw from the episode rows: each draw takes a game's
    instances with replacement (the documented seeding: one generator per game and size), the interval is the
    central ``ci`` share of the draws."""
    import numpy as np

    from clemprm.stats import derive_seed

    paths, _, _, _, _ = eval_run
    settings = {**SETTINGS, "eval": {**SETTINGS["eval"], "ci": ci}}
    results = evaluate.summarize_eval(settings, [paths["best_of_n"]], str(tmp_path / "summary.json"))[
        "modes"]["best_of_n"]["results"]
    rows = records.read_records(paths["best_of_n"], records.EVAL_EPISODES)
    samples = settings["eval"]["bootstrap_samples"]
    per_game = {}
    for game in sorted({row["game"] for row in rows}):
        instances = sorted({(row["experiment"], row["game_id"]) for row in rows if row["game"] == game})
        episodes = [[row for row in rows if (row["game"], row["experiment"], row["game_id"]) == (game, *key)]
                    for key in instances]
        rng = np.random.default_rng(derive_seed(settings["seed"], "bootstrap", game, len(instances)))
        draws = rng.multinomial(len(instances), [1 / len(instances)] * len(instances), size=samples)
        per_game[game] = [100 * sum(int(n) * sum(not row["aborted"] for row in group)
                                    for n, group in zip(draw, episodes))
                          / sum(int(n) * len(group) for n, group in zip(draw, episodes)) for draw in draws]
    per_game["overall"] = [sum(values[d] for values in per_game.values()) / len(per_game) for d in range(samples)]
    for group, values in per_game.items():
        estimate = results[group]["percent_played"]
        assert estimate["ci_low"] == pytest.approx(percentile(values, 50 * (1 - ci))), group
        assert estimate["ci_high"] == pytest.approx(percentile(values, 50 * (1 + ci))), group
        inside = sum(estimate["ci_low"] <= v <= estimate["ci_high"] for v in values) / samples
        assert inside >= ci, group
    assert any(results[group]["percent_played"]["ci_low"] < results[group]["percent_played"]["ci_high"]
               for group in per_game)


def test_identical_modes_differ_by_exactly_zero_with_a_paired_interval(eval_run):
    _, summary, _, _, _ = eval_run
    diff = summary["differences"]["greedy_sft"]["greedy_base"]   # the same scripted policy plays both
    for group in diff.values():
        for metric in ("percent_played", "quality", "clemscore", "success_rate"):
            assert group[metric]["value"] in (0.0, None)
            assert group[metric]["ci_low"] == group[metric]["ci_high"] == group[metric]["value"]
    single = summary["modes"]["greedy_sft"]["results"]["overall"]["percent_played"]
    assert single["ci_low"] < single["ci_high"]   # unpaired, the same data has a wide interval


def test_a_difference_covers_the_games_both_modes_played_and_says_how_many(tmp_path, scripted_policy):
    """greedy_base breaks wordref's rules at every turn, so it plays none of its episodes and has no quality there:
    greedy_sft - greedy_base in quality is the mean of the per-game differences over guessnumber and oddoneout, and
    the summary, the results table and the report say it covers 2 of 3 games. The difference of the two overall
    qualities would set greedy_sft's mean over three games against greedy_base's over two."""
    from clemprm.evaluation import console
    from clemprm.play.contract import Generation

    def answers(perspectives, seeds, wordref: bool):
        """Valid answers in wordref and oddoneout (the first word offered; a description without the words),
        mixed_answer in guessnumber; without ``wordref``, a describer that says the three words it must not say (two
        violations abort the game)."""
        texts = []
        for messages, seed in zip(perspectives, seeds):
            first = messages[0]["content"]
            words = re.search(r"(?:The words are:|The three words are) ([^.]+)\.", first)
            if "Describe the target" in first:
                texts.append("DESCRIPTION: something you can hold" if wordref else f"DESCRIPTION: {words.group(1)}")
            elif words:
                texts.append(f"ANSWER: {re.split(r', | and ', words.group(1))[0]}")
            else:
                texts.append(mixed_answer(messages, seed))
        return [Generation(text=t, raw_text=t, prompt_tokens=1, new_tokens=len(t.split())) for t in texts]

    class Playing(scripted_policy):
        wordref = True

        def generate(self, perspectives, seeds=None, **kwargs):
            return answers(perspectives, seeds, self.wordref)

    class NoWordref(Playing):
        wordref = False

    paths = {mode: str(tmp_path / f"{mode}.parquet") for mode in ("greedy_sft", "greedy_base")}
    evaluate.evaluate_mode("greedy_sft", SETTINGS, paths["greedy_sft"], policy=Playing(None, name="playing"))
    evaluate.evaluate_mode("greedy_base", SETTINGS, paths["greedy_base"], policy=NoWordref(None, name="no-wordref"))
    summary = evaluate.summarize_eval(SETTINGS, list(paths.values()), str(tmp_path / "prm_eval.json"))
    sft, unplayed = (summary["modes"][mode]["results"] for mode in ("greedy_sft", "greedy_base"))
    assert unplayed["wordref"]["percent_played"]["value"] == 0 and unplayed["wordref"]["quality"]["value"] is None
    assert sft["wordref"]["quality"]["value"] is not None
    difference = summary["differences"]["greedy_base"]["greedy_sft"]
    shared = ("guessnumber", "oddoneout")
    assert difference["wordref"]["quality"]["value"] is None
    assert difference["overall"]["games"] == {"percent_played": 3, "quality": 2, "clemscore": 3, "success_rate": 3}
    assert difference["overall"]["quality"]["value"] == pytest.approx(
        sum(difference[game]["quality"]["value"] for game in shared) / 2)
    over_different_games = sft["overall"]["quality"]["value"] - unplayed["overall"]["quality"]["value"]
    assert difference["overall"]["quality"]["value"] != pytest.approx(over_different_games)
    assert difference["overall"]["clemscore"]["value"] == pytest.approx(   # defined everywhere: as it was
        sft["overall"]["clemscore"]["value"] - unplayed["overall"]["clemscore"]["value"])
    assert report.partial_differences(summary) == [   # both are baselines: each is reported minus the other
        "greedy_sft - greedy_base: quality over 2 of 3 games", "greedy_base - greedy_sft: quality over 2 of 3 games"]
    report.write_warnings_page(summary, tmp_path / "warnings.html")
    assert "greedy_sft - greedy_base: quality over 2 of 3 games" in (tmp_path / "warnings.html").read_text()
    with_search = {**summary, "modes": {**summary["modes"], "best_of_n": {**summary["modes"]["greedy_sft"]}},
                   "differences": {"random_of_n": {"best_of_n": difference}}}
    row = next(line for line in console.summary_table(with_search).splitlines() if "best_of_n - random_of_n" in line)
    detectable = difference["overall"]["clemscore"]["detectable"]
    assert detectable > 0 and row.split()[-4:] == ["2", "of", "3", f"{detectable:.1f}"]   # games; detectable


def test_prm_eval_json_validates_against_its_schema(eval_run):
    _, summary, path, _, _ = eval_run
    schema = evaluate.summary_schema()
    written = json.loads(path.read_text())
    jsonschema.validate(written, schema)
    assert written["config"]["eval"]["split"] == "validation" and "clemcore" in written["versions"]
    assert written["bootstrap"]["unit"].startswith("instance")
    broken = {**written, "modes": {"greedy_sft": {**written["modes"]["greedy_sft"], "cost": {}}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_report_figures_are_written_also_when_inputs_lack_data(eval_run, tmp_path):
    _, _, summary_path, _, _ = eval_run
    labels = tmp_path / "soft_labels.parquet"
    pq.write_table(pa.table({"game": ["guessnumber"] * 5 + ["wordref"] * 3,
                             "label": [0.0, 0.25, 0.5, 1.0, 1.0, 0.0, 0.0, 1.0]}), labels)
    prm_metrics = tmp_path / "prm.json"
    prm_metrics.write_text(json.dumps({
        "history": [{"epoch": 0, "eval_loss": 0.7}, {"epoch": 1, "train_loss": 0.69, "eval_loss": 0.65}],
        "evaluation": {"validation": {"calibration": [
            {"bin": [0, 0.1], "count": 0, "mean_prediction": None, "mean_label": None},
            {"bin": [0.4, 0.5], "count": 4, "mean_prediction": 0.45, "mean_label": 0.3}]}}}))
    outputs = {name: str(tmp_path / "figures" / f"{name}.png")
               for name in ("scores", "soft_labels", "calibration", "training", "sibling_picks")}
    report.report_figures(str(summary_path), str(labels), str(prm_metrics), str(tmp_path / "missing.json"), outputs)
    for path in outputs.values():
        with open(path, "rb") as file:
            assert file.read(8) == b"\x89PNG\r\n\x1a\n"
    assert report.calibration_bins(json.loads(prm_metrics.read_text()))[0] == "validation"
    # what each figure was drawn from
    assert report.figure_data(outputs["soft_labels"])["counts"] == {"guessnumber": [1, 0, 1, 0, 0, 1, 0, 0, 0, 2],
                                                                   "wordref": [2] + [0] * 8 + [1]}
    assert report.figure_data(outputs["calibration"]) == {"side": "validation", "points": [[0.45, 0.3, 4.0]]}
    assert report.figure_data(outputs["training"]) == {
        "SFT adapter": {"train_loss": [], "eval_loss": []},
        "PRM adapter": {"train_loss": [[1, 0.69]], "eval_loss": [[0, 0.7], [1, 0.65]]}}
    scores = report.figure_data(outputs["scores"])
    summary = json.loads(summary_path.read_text())
    assert set(scores["modes"]) == set(summary["modes"]) and scores["groups"][-1] == "overall"
    assert scores["modes"]["best_of_n"]["percent_played"]["values"][-1] == pytest.approx(
        summary["modes"]["best_of_n"]["results"]["overall"]["percent_played"]["value"])
    empty = {name: str(tmp_path / "empty" / f"{name}.png") for name in outputs}
    report.report_figures(*(str(tmp_path / "missing") for _ in range(4)), empty)
    assert all((tmp_path / "empty" / f"{name}.png").stat().st_size > 0 for name in outputs)
    assert report.figure_data(empty["scores"])["modes"] == {}
    assert report.figure_data(empty["soft_labels"])["counts"] == {}
    assert report.figure_data(empty["calibration"])["points"] == []
    assert report.figure_data(empty["sibling_picks"]) == {"groups": [], "bars": {}}


def test_the_real_policy_plays_greedy_and_best_of_n(tmp_path, test_cache_dir):
    """The tiny model through the stage's own loader (greedy_base), then as the best-of-N policy."""
    settings = sections(tiny_config(games={"max_instances": {"validation": 1}}, eval={"max_new_tokens": 6, "n": 2}),
                        "seed", "model", "games", "eval")
    greedy = evaluate.evaluate_mode("greedy_base", settings, str(tmp_path / "greedy_base.parquet"),
                                    test_cache_dir)
    run = records.read_provenance(tmp_path / "greedy_base.parquet")["run"]
    assert run["policy"]["spec"] == "tiny:0" and run["policy"]["stats"]["new_tokens"] > 0
    assert [r["policy_tokens"] for r in greedy] == [sum(t["new_tokens"] for t in r["turns"]) for r in greedy]
    with pytest.raises(ValueError, match="needs its sft_adapter"):
        evaluate.evaluate_mode("greedy_sft", settings, str(tmp_path / "greedy_sft.parquet"), test_cache_dir)

    from clemprm.models.generation import load_policy
    prm = ScriptedPRM(lambda messages, candidate: len(candidate))   # prefers the longer answer
    rows = evaluate.evaluate_mode("best_of_n", settings, str(tmp_path / "best_of_n.parquet"),
                                  policy=load_policy(settings["model"], test_cache_dir), prm=prm)
    assert len(rows) == len(greedy) and all(r["search_nodes"] == 2 * r["n_turns"] for r in rows)
    logprob_rows = evaluate.evaluate_mode("best_of_n_logprob", settings, str(tmp_path / "logprob.parquet"),
                                          policy=load_policy(settings["model"], test_cache_dir))
    logprob_run = records.read_provenance(tmp_path / "logprob.parquet")["run"]
    assert sum(r["prm_pairs"] for r in logprob_rows) == logprob_run["prm"]["stats"]["pairs"] > 0
    scored = {}
    for pairs in prm.calls:
        for pair in pairs:
            scored.setdefault(str(pair.perspective), []).append(pair.candidate)
    for row in rows:
        for turn in row["turns"]:
            assert len(turn["response"]) == max(map(len, scored[str(turn["messages"])]))


def test_the_summary_refuses_episodes_of_another_split(eval_run, tmp_path):
    paths, _, _, _, _ = eval_run
    other = {**SETTINGS, "eval": {**SETTINGS["eval"], "split": "test"}}
    with pytest.raises(records.RecordFileError, match=r"greedy_base.parquet holds \d+ validation rows .* only test"):
        evaluate.summarize_eval(other, [paths["greedy_base"]], str(tmp_path / "prm_eval.json"))


def test_a_summary_older_than_the_episodes_it_is_made_from_is_named_stale(eval_run, tmp_path, capsys):
    """``clemprm summary`` on a real prm_eval.json beside its modes' episodes (results/eval/): the table alone; once a
    mode's episodes are newer (remade since, the summary not), a STALE warning that names them comes first."""
    import os
    import shutil

    from clemprm.cli import main

    paths, _, summary_path, _, _ = eval_run
    results = tmp_path / "results"
    (results / "eval").mkdir(parents=True)
    for mode, path in paths.items():   # copy2 keeps the mtimes: each mode's episodes older than the summary
        shutil.copy2(path, results / "eval" / f"{mode}.parquet")
    shutil.copy2(summary_path, results / "prm_eval.json")
    assert main(["summary", str(results / "prm_eval.json")]) == 0
    assert capsys.readouterr().out.startswith("clemprm results: validation split")
    made = (results / "prm_eval.json").stat().st_mtime
    os.utime(results / "eval" / "best_of_n.parquet", (made + 60, made + 60))
    assert main(["summary", str(results / "prm_eval.json")]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith(f"WARNING: the table below is STALE: {results / 'prm_eval.json'}, made ")
    assert first.endswith(f"(validation split, seed {SETTINGS['seed']}), is older than 1 of the files it is made from "
                          f"({results / 'eval' / 'best_of_n.parquet'}); snakemake results/prm_eval.json remakes it")
    assert second.startswith("clemprm results: validation split")


def test_the_table_says_in_words_why_a_zero_or_an_n_a_is_there():
    """A first run printed quality 0.0 everywhere and ranking n/a, and nothing said why."""
    from clemprm.evaluation import console

    zero = {"value": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    won = {"value": 25.0, "ci_low": 10.0, "ci_high": 40.0}

    def entry(success):
        return {"regime": "blind", "results": {"overall": {"percent_played": won, "quality": zero, "clemscore": zero,
                                                           "success_rate": success}}}

    summary = {"split": "validation", "bootstrap": {"ci": 0.95},
               "modes": {"greedy_sft": entry(zero), "random_of_n": entry(zero), "best_of_n": entry(won)},
               "prm": {"ranking": {"prefixes": 9, "pairs_with_different_labels": 0}, "gate": {"status": "not_judged"}}}
    table = console.summary_table(summary)
    assert "greedy_sft, random_of_n won no episode: their quality and clemscore are 0" in table
    assert "the PRM's ranking is n/a: its held-out siblings all carry the same label" in table
    assert table.count("configs/learning.yaml") == 2
    summary["modes"] = {"best_of_n": entry(won)}
    summary["prm"]["ranking"]["pairs_with_different_labels"] = 12
    assert "reading this table" not in console.summary_table(summary)


def test_eval_max_instances_plays_the_first_of_the_splits_draw(tmp_path, scripted_policy):
    """``eval.max_instances: 2`` of a validation split capped at 4: every mode plays the first 2 instances per game
    of the draw the held-out branch points take their first ones from (clemprm.play.catalog), not another 2."""
    from clemprm.play.catalog import GameCatalog

    settings = sections(tiny_config(games={"max_instances": {"validation": 4}}, eval={"max_instances": 2}),
                        "seed", "model", "games", "eval")
    rows = evaluate.evaluate_mode("greedy_sft", settings, str(tmp_path / "greedy_sft.parquet"),
                                  policy=scripted_policy(mixed_answer, name="scripted"))
    catalog = GameCatalog(settings["games"], settings["seed"])
    played = collections.defaultdict(list)
    for row in rows:
        played[row["game"]].append((row["game"], row["experiment"], int(row["game_id"])))
    assert played == {game: [instance.key for instance in catalog.instances(game, "validation")[:2]]
                      for game in catalog.games}
    assert all(len(catalog.instances(game, "validation")) == 4 for game in catalog.games)
