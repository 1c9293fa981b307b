"""clembench results trees (clemprm.play.clembench_tree), checked by clemcore's own command line: real episodes of the
built-in games (a scripted policy with every outcome: won, lost, aborted, failed), two eval modes written as trees,
then the real `clem eval` (its results.csv against the pipeline's summary), `clem transcribe` (a transcript per
episode showing the player's answers) and `clem score` (recomputed scores.json equal ours)."""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from clemprm import records
from clemprm.config import deep_merge, eval_mode_params, sections
from clemprm.evaluation import evaluate
from clemprm.modes import MODES
from clemprm.play.clembench_tree import run_dir_name
from clemprm.play.contract import Scorer
from clemprm.stats import OVERALL
from tests.conftest import binary_search_answer, tiny_config

GAMES_DIR = Path(__file__).resolve().parent.parent / "clemprm" / "games"
CLEM = shutil.which("clem", path=str(Path(sys.executable).parent)) or shutil.which("clem")
CLEM_TIMEOUT = 600   # seconds per command: importing clemcore's CLI alone takes 10-20 s on a loaded machine
JUNK = "I have no idea."
HANABI_MOVES = ["play 1", "hint 1", "discard 1", "play 2", "hint R"]

# greedy_base plays each instance once (clemcore's own layout: instance_<id>); beam_search twice
# (instance_<id>_episode_<repeat>); both in one tree, as results/clembench holds every mode
BASE = tiny_config(games={"builtin": ["guessnumber", "wordref", "oddoneout", "hanabi"],
                          "experiments": {"hanabi": ["small"]}, "max_instances": {"validation": 4}},
                   eval={"bootstrap_samples": 50, "n": 2, "beam_width": 2, "num_beam_iterations": 40})
SETTINGS = {"greedy_base": sections(BASE, "seed", "model", "games", "eval"),
            "beam_search": sections(deep_merge(BASE, {"eval": {"episodes_per_instance": 2}}),
                                    "seed", "model", "games", "eval")}


def mixed_answer(messages, seed):
    """Every outcome occurs: won, lost, aborted (rule-breaking answers), failed (a generation error)."""
    first = messages[0]["content"]
    if "DEDUCTION" in first:   # hanabi (both players)
        return "nonsense" if seed % 10 == 0 else f"DEDUCTION: ?? ?? ??\nMOVE: {HANABI_MOVES[seed % 5]}"
    if "GUESS" in first:
        return [binary_search_answer(messages), JUNK, "GUESS: 1"][seed % 3]
    if "DESCRIPTION" in first:   # wordref's describer
        return "DESCRIPTION: something you can hold"
    words = re.search(r"The (?:three )?words are:? ([^.]+)\.", first).group(1).replace(" and ", ", ").split(", ")
    if "does not belong" in first:   # oddoneout
        return None if seed % 8 == 3 else [f"ANSWER: {words[seed % 4]}", JUNK][seed % 7 == 0]   # None: fails
    return [f"ANSWER: {words[seed % 3]}", JUNK][seed % 5 == 0]   # wordref's guesser


class ScriptedPRM(Scorer):
    def score(self, pairs):
        return [0.1 if pair.candidate == JUNK else 0.5 + 0.4 * (pair.candidate != "GUESS: 1") for pair in pairs]


def clem(*args: str, cwd: Path, games: Path = GAMES_DIR) -> subprocess.CompletedProcess:
    """The pinned clemcore's CLI; games are found through CLEMBENCH_HOME, ``games`` (cwd holds no game folder)."""
    assert CLEM, f"no clem command beside {sys.executable} or on PATH"
    cwd.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([CLEM, *args], cwd=cwd, capture_output=True, text=True, timeout=CLEM_TIMEOUT,
                            env={**os.environ, "CLEMBENCH_HOME": str(games)})
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "exceptions occurred" not in output, output[-4000:]
    return result


@pytest.fixture(scope="module")
def trees(tmp_path_factory, scripted_policy):
    """Both modes played and written as trees under one results folder, their parquets and the summary."""
    from clemprm.play.contract import Generation

    class SeededPolicy(scripted_policy):
        def generate(self, perspectives, seeds=None, **kwargs):
            texts = [mixed_answer(messages, seed) for messages, seed in zip(perspectives, seeds)]
            return [Generation(text=t, raw_text=t, prompt_tokens=1, new_tokens=len(t.split())) if t is not None
                    else Generation("", "", 0, 0, error="scripted failure", finish_reason="error") for t in texts]

    folder = tmp_path_factory.mktemp("clembench")
    paths, runs = {}, {}
    for mode, settings in SETTINGS.items():
        paths[mode] = str(folder / f"{mode}.parquet")
        policy = SeededPolicy(None, name="scripted")
        evaluate.evaluate_mode(mode, settings, paths[mode], policy=policy, prm=ScriptedPRM(), on_failure="continue",
                               clembench_dir=str(folder / "clembench" / mode))
        runs[mode] = folder / "clembench" / mode / run_dir_name(policy.name, mode, MODES[mode].regime)
    summary = evaluate.summarize_eval(SETTINGS["greedy_base"], list(paths.values()), str(folder / "prm_eval.json"))
    rows = {mode: records.read_records(path, records.EVAL_EPISODES) for mode, path in paths.items()}
    return folder, runs, rows, summary


def episode_folders(run: Path) -> list[Path]:
    return sorted(path.parent for path in run.rglob("instance.json"))


def tree_copy(trees, tmp_path) -> Path:
    """A copy of the results folder holding both modes' trees (clem writes into the folder it reads)."""
    shutil.copytree(trees[0] / "clembench", tmp_path / "clembench")
    return tmp_path / "clembench"


def player_answers(interactions: dict) -> list[str]:
    """What the players said, in order: the recorder's "get message" events from a player to the game master."""
    return [event["action"]["content"] for turn in interactions["turns"] for event in turn
            if event["from"].startswith("Player") and event["action"]["type"] == "get message"]


def canonical(data) -> str:
    return json.dumps(data, sort_keys=True)   # NaN as NaN: equal when both are NaN


# ------------------------------------------------------------------------------------------------ the layout


def test_tree_layout_holds_every_episode_as_played(trees):
    folder, runs, rows, _ = trees
    assert sorted(path.name for path in (folder / "clembench").iterdir()) == ["beam_search", "greedy_base"]
    assert runs["greedy_base"].name == "scripted-greedy_base" and runs["greedy_base"].is_dir()
    # beam search's candidates were played in forks: its run name and info say so (clem eval shows the name)
    assert runs["beam_search"].name == "scripted-beam_search-lookahead"
    outcomes = set()
    for mode, run in runs.items():
        by_id = {row["episode_id"]: row for row in rows[mode]}
        folders = episode_folders(run)
        assert len(folders) == len(rows[mode]) and (run / "run.json").is_file()
        run_info = json.loads((run / "run.json").read_text())
        assert run_info["clem_version"] == "3.7.2" and run_info["clemprm"]["mode"] == mode
        assert run_info["clemprm"]["regime"] == MODES[mode].regime
        assert sum(game["num_instances"] for game in run_info["games"].values()) == len(rows[mode])
        for episode in folders:
            # <run_dir>/<game>/<experiment>/<episode>: the last parts clem eval names an episode by
            assert episode.parent.parent.parent == run and (episode.parent / "experiment.json").is_file()
            instance = json.loads((episode / "instance.json").read_text())
            signal = episode / ("completed.json" if (episode / "completed.json").exists() else "error.json")
            row = by_id[json.loads(signal.read_text())["episode_id"]]
            game, experiment, game_id = row["game"], row["experiment"], row["game_id"]
            assert (episode.parent.parent.name, episode.parent.name, instance["game_id"]) == (game, experiment, game_id)
            repeat = int(row["episode_id"].rsplit("/", 1)[1])
            assert episode.name == (f"instance_{game_id:05d}" if mode == "greedy_base"
                                    else f"instance_{game_id:05d}_episode_{repeat:05d}")
            scores = json.loads((episode / "scores.json").read_text())
            if signal.name == "error.json":   # failed: no interactions, counted as not played
                assert row["error"] and row["aborted"] and not (episode / "interactions.json").exists()
                assert scores["episode scores"]["Aborted"] == 1 and math.isnan(scores["episode scores"]["Main Score"])
                outcomes.add("failed")
                continue
            assert row["error"] is None
            assert canonical(scores["episode scores"]) == canonical(json.loads(row["episode_scores"]))
            assert {"Aborted", "Lose", "Success", "Main Score"} <= set(scores["episode scores"])
            interactions = json.loads((episode / "interactions.json").read_text())
            assert interactions["meta"]["results_folder"] == run.name and interactions["meta"]["completed"]
            assert interactions["meta"]["game_id"] == game_id and "Request Count" in interactions
            # the episode the mode finally played (for beam search: the chosen beam): the row's answers
            assert player_answers(interactions) == [turn["response"] for turn in row["turns"]]
            outcomes.add("aborted" if row["aborted"] else "won" if row["success"] else "lost")
    assert outcomes == {"won", "lost", "aborted", "failed"}


def test_self_correct_writes_one_run_folder_per_policy_and_attempt(scripted_policy, tmp_path):
    policies = {"sft": scripted_policy(lambda m: "GUESS: 5", name="sft"),
                "score": scripted_policy(binary_search_answer, name="score")}
    config = tiny_config(games={"max_instances": {"validation": 2}})
    settings = {**eval_mode_params(config, "self_correct"), "score": config["score"]}
    from clemprm.evaluation.self_correct import evaluate_self_correct

    evaluate_self_correct(settings, str(tmp_path / "self_correct.parquet"), sft_adapter=None, score_adapter=None,
                          policies=policies, clembench_dir=str(tmp_path / "self_correct"))
    runs = sorted(path.name for path in (tmp_path / "self_correct").iterdir())
    assert runs == ["score-self_correct_score_attempt1", "score-self_correct_score_attempt2",
                    "sft-self_correct_sft_attempt1", "sft-self_correct_sft_attempt2"]
    for run in runs:
        assert len(episode_folders(tmp_path / "self_correct" / run)) == 2


def test_base_rollouts_write_a_tree_with_their_config_key(scripted_policy, tmp_path):
    """``base_rollouts.clembench_tree``: the base policy's train episodes as a run folder ``<policy>-base_rollouts``,
    one episode folder per record (repeats numbered), the game's own scores, and `clem transcribe` reads it."""
    from clemprm.stages import rollouts

    config = tiny_config(games={"builtin": ["guessnumber", "oddoneout"]})
    policy = scripted_policy(lambda messages: mixed_answer(messages, 2), name="base")   # guesses 1, names a word
    rows = rollouts.base_rollouts(sections(config, "seed", "model", "games", "base_rollouts"),
                                  str(tmp_path / "base_train.parquet"), policy=policy,
                                  clembench_dir=str(tmp_path / "clembench"))
    run = tmp_path / "clembench" / "base-base_rollouts"
    folders = episode_folders(run)
    assert len(folders) == len(rows) == 2 * config["games"]["max_instances"]["train"] * 2
    assert json.loads((run / "run.json").read_text())["clemprm"] == {"stage": "base_rollouts", "split": "train"}
    by_id = {row["episode_id"]: row for row in rows}
    for episode in folders:
        row = by_id[json.loads((episode / "completed.json").read_text())["episode_id"]]
        repeat = int(row["episode_id"].rsplit("/", 1)[1])
        assert episode.name == f"instance_{row['game_id']:05d}_episode_{repeat:05d}"
        scores = json.loads((episode / "scores.json").read_text())["episode scores"]
        assert canonical(scores) == canonical(json.loads(row["episode_scores"]))
    clem("transcribe", "-r", str(tmp_path / "clembench"), cwd=tmp_path / "cwd")
    assert len(list(run.rglob("transcript.html"))) == len(rows)


# ------------------------------------------------------------------------------------------------ clemcore reads it


def test_clem_eval_agrees_with_the_summary(trees, tmp_path):
    """clem eval rounds each game's % played and quality to two decimals, averages those over games and rounds
    again, and computes clemscore from the rounded averages; the summary keeps full precision. So: equal up to
    0.005 per game, 0.01 for the averages, and 0.026 for clemscore (the rounded averages' error x at most 100)."""
    _, runs, rows, summary = trees
    results = tree_copy(trees, tmp_path)
    clem("eval", "-r", str(results), cwd=tmp_path / "cwd")
    table = pd.read_csv(results / "results.csv", index_col=0)
    raw = pd.read_csv(results / "raw.csv", index_col=0)
    assert sorted(table.index) == sorted(run.name for run in runs.values())
    for mode, run in runs.items():
        ours, theirs = summary["modes"][mode]["results"], table.loc[run.name]
        games = sorted({row["game"] for row in rows[mode]})
        for game in games:
            episodes = raw[(raw.model == run.name) & (raw.game == game) & (raw.metric == "Aborted")]
            assert len(episodes) == ours[game]["episodes"]   # no episode dropped, none counted twice
            assert theirs[f"{game}, % Played"] == pytest.approx(ours[game]["percent_played"]["value"], abs=0.0051)
            quality = ours[game]["quality"]["value"]
            if quality is None:   # nothing played: no quality in either
                assert math.isnan(theirs[f"{game}, Quality Score"])
            else:
                assert theirs[f"{game}, Quality Score"] == pytest.approx(quality, abs=0.0051)
        overall = ours[OVERALL]
        assert theirs["all, Average % Played"] == pytest.approx(overall["percent_played"]["value"], abs=0.0101)
        assert theirs["all, Average Quality Score"] == pytest.approx(overall["quality"]["value"], abs=0.0101)
        assert theirs["-, clemscore"] == pytest.approx(overall["clemscore"]["value"], abs=0.026)


def test_clem_transcribe_shows_the_players_answers(trees, tmp_path):
    _, runs, rows, _ = trees
    results = tree_copy(trees, tmp_path)
    clem("transcribe", "-r", str(results), cwd=tmp_path / "cwd")
    transcribed = 0
    for mode, run in runs.items():
        by_id = {row["episode_id"]: row for row in rows[mode]}
        for episode in episode_folders(results / mode / run.name):
            if not (episode / "interactions.json").exists():   # a failed episode: nothing to transcribe
                assert not (episode / "transcript.html").exists()
                continue
            page = (episode / "transcript.html").read_text()
            row = by_id[json.loads((episode / "completed.json").read_text())["episode_id"]]
            for turn in row["turns"]:
                assert html.escape(turn["response"]).replace("\n", "<br/>") in page
            transcribed += 1
    assert transcribed == sum(not row["error"] for mode_rows in rows.values() for row in mode_rows)


def test_clem_score_recomputes_our_scores(trees, tmp_path):
    results = tree_copy(trees, tmp_path)
    ours = {}
    for interactions in results.rglob("interactions.json"):
        scores = interactions.with_name("scores.json")
        ours[scores] = json.loads(scores.read_text())
        scores.unlink()
    assert {path.parts[-4] for path in ours} >= {"guessnumber", "wordref", "oddoneout", "hanabi"}
    clem("score", "-r", str(results), cwd=tmp_path / "cwd")
    for path, scores in ours.items():
        assert path.exists(), f"clem score wrote no {path}"
        assert canonical(json.loads(path.read_text())) == canonical(scores), path
