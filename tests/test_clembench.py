"""clembench games through the pipeline, on fixture games the tests write into a temporary checkout.

CI cannot reach GitHub, so the layouts of the real clembench games are rebuilt here: a clemgame.json holding a
list of specs with an ``instances`` key, a game one folder deeper sharing a module with its parent folder, two games
with same-named ``utils`` packages, the old state API (a plain state object), legacy game masters (all of them),
a scorer that raises, a ``partial_bench_score`` that raises, an end-of-game hook that logs an event, games that draw
random numbers (from the global generators, and from a source the engine does not seed), a programmatic player, keys
logged during set-up.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import yaml

from clemprm import records
from clemprm.checks.parse_time import ConfigInputError, check_config_inputs
from clemprm.checks.run_time import StageFailure, check_instances, read_failure_marks
from clemprm.config import eval_mode_params, load_config, rl_params, sections
from clemprm.evaluation import evaluate, report
from clemprm.play.catalog import GameCatalog
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.rl import trainer as rl_trainer
from clemprm.stages import branch_points, continuation_scores, labels, rollouts, sft
from tests import test_workflow as workflow
from tests.conftest import tiny_config

# One legacy game master, configured by the flags it is written with. Every round the player answers; an answer
# with INVALID fails validation and aborts the game; a round is won when the answer says WIN (RANDOM: when the
# round's coin, drawn from Python's random, shows heads). Points per won round; Main Score = 100 x points / rounds
# (so a lost game still has a score: the closed-as-lost partial score is points so far / rounds).
MASTER = '''
import math
import random
from dataclasses import dataclass

import numpy as np
from clemcore.backends import CustomResponseModel
from clemcore.clemgame import GameBenchmark, GameSpec, Player
from clemcore.clemgame.legacy.master import DialogueGameMaster
from clemcore.clemgame.legacy.scorer import GameScorer
from clemcore.clemgame.metrics import (BENCH_SCORE, METRIC_ABORTED, METRIC_LOSE, METRIC_REQUEST_COUNT,
                                       METRIC_REQUEST_COUNT_PARSED, METRIC_REQUEST_COUNT_VIOLATED, METRIC_SUCCESS)
{imports}

FLAGS = {flags!r}


@dataclass
class PlainState:  # the old state API: a plain object, not a clemcore GameState
    rounds: int
    round: int = 0
    points: int = 0
    aborted: bool = False
    done: bool = False


class Speaker(Player):
    def _custom_response(self, context):
        return "WIN"


class Referee(Player):
    def _custom_response(self, context):
        return "noted"


def source():
    """The global generator (seeded per episode by the engine), or one the engine cannot seed."""
    return random.SystemRandom() if FLAGS.get("private_random") else random


def coin(generator):
    return "heads" if generator.random() < 0.5 else "tails"


class Fixture(DialogueGameMaster):

    def _on_setup(self, **instance):
        self.state = PlainState(rounds=int(instance["rounds"]))
        if FLAGS.get("broken_setup"):
            math.sqrt(-1)
        self.offset = (source().randint(0, 10 ** 9) if FLAGS.get("private_random")
                       else int(np.random.randint(0, 10 ** 9)) if FLAGS.get("random") else 0)
        self.log_key("setup_info", {{"rounds": self.state.rounds}})  # logged during set-up, read by the scorer
        self.player = Speaker(self.player_models[0], game_role="Player")
        self.add_player(self.player, initial_context=self.prompt())
        if FLAGS.get("referee"):
            self.referee = Referee(CustomResponseModel(), game_role="Referee")
            self.add_player(self.referee, initial_context="Note the answer.")
        self.requests = self.violations = 0

    def prompt(self):
        text = f"{{PROMPT}} Round {{self.state.round + 1}} of {{self.state.rounds}}."
        if FLAGS.get("random") or FLAGS.get("private_random"):
            self.current_coin = coin(source())
            text += f" Offset {{self.offset}}, the coin shows {{self.current_coin}}."
        return text

    def _does_game_proceed(self):
        return not (self.state.done or self.state.aborted)

    def _validate_player_response(self, player, response):
        if player is not self.player:
            return True
        self.requests += 1
        if "INVALID" in response:
            self.violations += 1
            self.state.aborted = True
            return False
        return True

    def _on_valid_player_response(self, player, response):
        if player is not self.player:
            return
        won = self.current_coin == "heads" if FLAGS.get("random") or FLAGS.get("private_random") else "WIN" in response
        self.state.points += int(won)
        self.state.round += 1
        if self.state.round >= self.state.rounds:
            self.state.done = True
        else:
            self.set_context_for(self.player, self.prompt())
        if FLAGS.get("referee"):
            self.set_context_for(self.referee, f"The player said: {{response}}")

    def _on_after_game(self):
        success = not self.state.aborted and self.state.points == self.state.rounds
        self.log_key(METRIC_ABORTED, int(self.state.aborted))
        self.log_key(METRIC_LOSE, int(not self.state.aborted and not success))
        self.log_key(METRIC_SUCCESS, int(success))
        self.log_key("points", self.state.points)
        self.log_key(METRIC_REQUEST_COUNT, self.requests)
        self.log_key(METRIC_REQUEST_COUNT_PARSED, self.requests - self.violations)
        self.log_key(METRIC_REQUEST_COUNT_VIOLATED, self.violations)
        if FLAGS.get("hook_logs_event"):  # an event after the last round (clemcore logs it into that round)
            self.log_to_self("game end", f"{{self.state.points}} points")
{partial}

class FixtureScorer(GameScorer):

    def score_turns(self, episode_interactions):
        pass

    def log_main_score(self, episode_interactions):
        if FLAGS.get("scorer_divides_by_requests"):  # as clemcore's own scorer does, per round
            for events in episode_interactions["turns"]:
                self.log_episode_score("answers per request", 1 / sum(
                    event["action"]["type"] == "get message" for event in events))
        points, rounds = episode_interactions["points"], episode_interactions["setup_info"]["rounds"]
        if FLAGS.get("scorer_raises_on_loss") and points < rounds:
            raise RuntimeError("fixture scorer bug")
        score = np.nan if episode_interactions[METRIC_ABORTED] else 100 * points / rounds
        self.log_episode_score(BENCH_SCORE, score)


class FixtureBenchmark(GameBenchmark):

    def create_game_master(self, experiment, player_models):
        return Fixture(self.game_spec, experiment, player_models)

    def create_game_scorer(self, experiment, game_instance):
        return FixtureScorer(self.game_name, experiment, game_instance)
'''

PARTIAL_RAISES = '''
    def partial_bench_score(self):
        raise ValueError("fixture partial score bug")
'''


def instances(experiments: dict[str, int], rounds: int = 2) -> dict:
    """An instances file: experiments named as given, each with that many instances (game ids 0, 1, ...)."""
    return {"experiments": [{"name": name, "game_instances": [{"game_id": i, "rounds": rounds} for i in range(n)]}
                            for name, n in experiments.items()]}


def write_game(folder: Path, specs, *, flags: dict | None = None, files: dict | None = None, imports: str = "",
               prompt: str = "'Say something.'", partial: str = "", instance_files: dict | None = None) -> Path:
    """A game folder: clemgame.json (one spec or a list), master.py, in/*.json, and any extra files."""
    (folder / "in").mkdir(parents=True, exist_ok=True)
    (folder / "clemgame.json").write_text(json.dumps(specs))
    (folder / "master.py").write_text(MASTER.format(flags=flags or {}, imports=imports + f"\nPROMPT = {prompt}\n",
                                                    partial=partial))
    for name, content in (instance_files or {"instances": instances({"e": 6})}).items():
        (folder / "in" / f"{name}.json").write_text(json.dumps(content))
    for relative, content in (files or {}).items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(content)
    return folder


def spec(name: str, players: int = 1, **extra) -> dict:
    return {"game_name": name, "description": "fixture", "main_game": name, "players": players, "image": "none",
            "languages": ["en"], **extra}


def write_checkout(root: Path) -> Path:
    """A fake clembench checkout with every layout the real one has, in ``root``: this module's games, and those the
    tiny workflow run plays beside the built-in ones (tests/test_workflow.py's ``CLEMBENCH_GAMES``)."""
    # a list of specs; the variant names its own instances file (wordle, wordle_withclue)
    write_game(root / "pair", [spec("pair"), spec("pair_variant", instances="instances_variant")],
               instance_files={"instances": instances({"plain": 6}), "instances_variant": instances({"variant": 6}),
                               "instances_v2": instances({"v2": 2})})
    # one folder deeper, importing a module of the parent folder (textmapworld/textmapworld_main)
    write_game(root / "family" / "family_main", spec("family"), imports="from family_utils import PROMPT_START",
               prompt="PROMPT_START + ' (family)'", files={"../family_utils.py": "PROMPT_START = 'Family game.'\n"})
    # two games with their own package `utils` (wordle, taboo, guesswhat)
    for name in ("alpha", "beta"):
        write_game(root / name, spec(name), imports="from utils.text import WORD",
                   prompt="f'Say {WORD}.'", files={"utils/text.py": f"WORD = '{name}-word'\n"})
    write_game(root / "coins", spec("coins"), flags={"random": True}, instance_files={
        "instances": instances({"e": 6}, rounds=3)})
    write_game(root / "coin", spec("coin"), flags={"random": True}, instance_files={
        "instances": instances({"e": 8}, rounds=1)})
    write_game(root / "triple", spec("triple"), instance_files={"instances": instances({"e": 6}, rounds=3)})
    write_game(root / "private_coins", spec("private_coins"), flags={"private_random": True})
    write_game(root / "refereed", spec("refereed", players=2), flags={"referee": True})
    write_game(root / "fragile_scorer", spec("fragile_scorer"), flags={"scorer_raises_on_loss": True})
    write_game(root / "fragile_partial", spec("fragile_partial"), partial=PARTIAL_RAISES,
               instance_files={"instances": instances({"e": 6}, rounds=3)})
    write_game(root / "broken_setup", spec("broken_setup"), flags={"broken_setup": True})  # ValueError at set-up
    write_game(root / "per_request", spec("per_request"), flags={"scorer_divides_by_requests": True},
               instance_files={"instances": instances({"e": 6}, rounds=3)})
    write_game(root / "fragile_closing", spec("fragile_closing"), flags={"scorer_raises_on_loss": True},
               instance_files={"instances": instances({"e": 6}, rounds=3)})
    write_game(root / "closing_event", spec("closing_event"),
               flags={"scorer_divides_by_requests": True, "hook_logs_event": True},
               instance_files={"instances": instances({"e": 6}, rounds=3)})
    # what a parse-time check must catch (never loaded)
    write_game(root / "needs_package", spec("needs_package"), imports="import clemprm_fixture_missing_package")
    write_game(root / "needs_data", spec("needs_data"), imports="import nltk\nnltk.download('clemprm_fixture_data')")
    write_game(root / "names_missing_file", spec("names_missing_file", instances="instances_gone"))
    # passes the parse-time checks (its imports resolve), raises when clemcore loads it
    write_game(root / "raises_at_import", spec("raises_at_import"), imports="raise RuntimeError('boom at import')")
    (root / "docs" / "hidden").mkdir(parents=True)  # folders clemcore's registry skips
    (root / "docs" / "hidden" / "clemgame.json").write_text(json.dumps(spec("in_docs")))
    return root


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return write_checkout(tmp_path_factory.mktemp("clembench"))


def games_config(checkout: Path, games: list[str], **extra) -> dict:
    return {"builtin": [], "clembench_path": str(checkout), "clembench_games": games,
            "max_instances": {"train": 4, "validation": 4, "test": 4}, **extra}


def config_for(checkout: Path, games: list[str], **extra) -> dict:
    return tiny_config(games=games_config(checkout, games, **extra))


def all_rows(catalog: GameCatalog, game: str) -> list:
    return [instance for split in ("train", "validation", "test") for instance in catalog.instances(game, split)]


def play(catalog: GameCatalog, policy, game: str, seed: int = 1) -> list[dict]:
    engine = RolloutEngine(catalog, Sampling())
    return engine.play(all_rows(catalog, game), [policy], repeats=1, base_seed=seed, stage="test", policy_name="p")


def answer(text):
    return lambda messages: text


# ------------------------------------------------------------------------------------------------ catalog


def test_a_spec_list_with_an_instances_key_and_a_chosen_instances_file(checkout):
    catalog = GameCatalog(games_config(checkout, ["pair", "pair_variant"]))
    assert catalog.game_dirs["pair"] == catalog.game_dirs["pair_variant"] == checkout / "pair"
    assert {i.experiment["name"] for i in all_rows(catalog, "pair")} == {"plain"}
    assert {i.experiment["name"] for i in all_rows(catalog, "pair_variant")} == {"variant"}
    chosen = GameCatalog(games_config(checkout, ["pair_variant"], instances_files={"pair_variant": "instances_v2"}))
    assert {i.experiment["name"] for i in all_rows(chosen, "pair_variant")} == {"v2"}
    assert len(all_rows(chosen, "pair_variant")) == 2


def test_a_nested_game_and_same_named_game_modules(checkout, scripted_policy):
    catalog = GameCatalog(games_config(checkout, ["family", "alpha", "beta"]))
    assert catalog.game_dirs["family"] == checkout / "family" / "family_main"
    policy = scripted_policy(answer("WIN"))
    prompts = {game: play(catalog, policy, game)[0]["turns"][0]["messages"][-1]["content"]
               for game in ("family", "alpha", "beta")}
    assert prompts["family"].startswith("Family game. (family)")
    assert prompts["alpha"].startswith("Say alpha-word.") and prompts["beta"].startswith("Say beta-word.")


def test_a_playpen_instance_list_selects_clembench_instances(checkout, tmp_path):
    listing = tmp_path / "instances.jsonl"
    listing.write_text("".join(json.dumps(row) + "\n" for row in [
        {"game": "pair_variant", "experiment": "variant", "task_id": 2, "split": "validation"},
        {"game": "pair_variant", "experiment": "variant", "task_id": 0, "split": "train"},
        {"game": "other", "experiment": "variant", "task_id": 1, "split": "train"}]))
    catalog = GameCatalog(games_config(checkout, ["pair_variant"], instance_list=str(listing)))
    assert [i.key for i in catalog.instances("pair_variant", "train")] == [("pair_variant", "variant", 0)]
    assert [i.key for i in catalog.instances("pair_variant", "validation")] == [("pair_variant", "variant", 2)]
    assert catalog.instances("pair_variant", "test") == []


# ------------------------------------------------------------------------------------------------ playing


def test_the_old_state_api_legacy_verdicts_and_keys_logged_at_set_up(checkout, scripted_policy):
    catalog = GameCatalog(games_config(checkout, ["pair"]))
    won = play(catalog, scripted_policy(answer("WIN")), "pair")
    assert all(row["error"] is None and row["success"] and row["bench_score"] == 100 for row in won)
    assert all(turn["parse_ok"] for row in won for turn in row["turns"])
    assert json.loads(won[0]["episode_scores"])["Main Score"] == 100  # the scorer read the set-up key
    invalid = play(catalog, scripted_policy(answer("INVALID")), "pair")
    assert all(row["error"] is None and row["aborted"] for row in invalid)
    assert [turn["parse_ok"] for turn in invalid[0]["turns"]] == [False]


def test_a_programmatic_player_answers_itself(checkout, scripted_policy):
    catalog = GameCatalog(games_config(checkout, ["refereed"]))
    policy = scripted_policy(answer("WIN"))
    rows = play(catalog, policy, "refereed")
    assert all(row["error"] is None and row["success"] for row in rows)
    assert {turn["game_role"] for row in rows for turn in row["turns"]} == {"Player"}  # only policy turns
    assert len(rows[0]["turns"]) == 2 and sum(policy.calls) == 2 * len(rows)


def test_game_randomness_is_per_episode_and_replays(checkout, scripted_policy, tmp_path):
    config = config_for(checkout, ["coins"])
    catalog = GameCatalog(config["games"])
    policy = scripted_policy(answer("go"))
    first, again = play(catalog, policy, "coins"), play(catalog, policy, "coins")
    assert [r["turns"] for r in first] == [r["turns"] for r in again]  # a function of the episode alone
    assert len({r["turns"][0]["messages"][-1]["content"] for r in first}) > 1  # the draws differ by episode
    settings = labels_settings(config, k=3)
    bp_path = tmp_path / "bp.parquet"
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=policy)
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet", policy=policy)
    assert len(rows) == len(records.read_records(bp_path)) > 0  # every replay reproduced its branch point
    # the continuations draw their own coins: a branch point's label is a mean over several outcomes
    assert any(0 < row["label"] < 1 for row in rows if not row["terminal"])


def test_a_game_drawing_from_an_unseeded_source_fails_the_shard_naming_it(checkout, scripted_policy, tmp_path):
    config = config_for(checkout, ["private_coins"])
    settings = labels_settings(config)
    bp_path = tmp_path / "bp.parquet"
    policy = scripted_policy(answer("go"))
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=policy)
    with pytest.raises(branch_points.ReplayDivergence,
                       match="game private_coins: replaying branch point private_coins/"):
        labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet", policy=policy)


# ------------------------------------------------------------------------------------------------ scores


def labels_settings(config: dict, **label_overrides) -> dict:
    return {"seed": config["seed"], "model": config["model"], "games": config["games"],
            "branch_points": {**config["branch_points"], "max_per_episode": 8},
            "labels": {**config["labels"], "k": 2, "checkpoint_every": 4, **label_overrides}}


def test_the_partial_score_is_the_games_scorer_on_the_episode_closed_as_lost(checkout, scripted_policy, tmp_path):
    config = config_for(checkout, ["triple"])  # 3 rounds, 100 x won rounds / 3; no partial_bench_score
    settings = labels_settings(config, max_rollout_rounds=1)
    bp_path = tmp_path / "bp.parquet"
    policy = scripted_policy(answer("WIN"))
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=policy)
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet", policy=policy)
    by_turn = {turn: [row for row in rows if row["turn_idx"] == turn] for turn in range(3)}
    assert all(by_turn.values())
    # after round 1 a continuation wins round 2 and is capped: scored as lost with 2 of 3 rounds won
    assert all(row["n_capped"] == 2 and row["rollout_scores"] == [pytest.approx(200 / 3)] * 2 for row in by_turn[0])
    assert all(row["n_capped"] == 0 and row["label"] == 1.0 for row in by_turn[1])  # round 3 ends the game: won
    assert all(row["terminal"] and row["label"] == 1.0 for row in by_turn[2])


def test_a_partial_bench_score_that_raises_is_counted_and_the_shard_survives(checkout, scripted_policy, tmp_path,
                                                                             caplog):
    config = config_for(checkout, ["fragile_partial"])
    settings = labels_settings(config, max_rollout_rounds=1)
    bp_path = tmp_path / "bp.parquet"
    policy = scripted_policy(answer("WIN"))
    bps = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=policy)
    with caplog.at_level(logging.WARNING, logger="clemprm.stages"):
        rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet", policy=policy)
    # 3 rounds, cap 1: continuations from round 1 are capped after round 2 and their partial score raises (those
    # branch points keep no label); from round 2 they finish the game and are scored as usual
    first, labelled = {bp["bp_id"] for bp in bps if bp["turn_idx"] == 0}, {row["bp_id"] for row in rows}
    assert first and first.isdisjoint(labelled) and len(labelled) == len(bps) - len(first)
    assert "fragile_partial: continuation" in caplog.text and "fixture partial score bug" in caplog.text
    assert f"fragile_partial: {2 * len(first)} continuations failed, first:" in caplog.text  # counted per game


def test_a_scorer_that_cannot_score_an_empty_episode_gives_0_one_raising_on_answers_is_an_error(
        checkout, scripted_policy, tmp_path, caplog):
    # per_request's scorer divides by each round's requests, as clemcore's does: an empty episode cannot be scored
    config = config_for(checkout, ["per_request"])
    catalog = GameCatalog(config["games"])
    engine = RolloutEngine(catalog, Sampling())
    fresh = engine.start(catalog.instances("per_request", "train")[0], [scripted_policy(answer("WIN"))], "p/0", 1)
    score, reason = continuation_scores.closed_as_lost_score(fresh)
    assert math.isnan(score) and reason.startswith("no answer yet, ZeroDivisionError")
    assert continuation_scores.partial_score(fresh) == 0.0
    # with answers it scores: the round clemcore opened after the last answer (no request yet) is not scored
    settings = labels_settings(config, max_rollout_rounds=1)
    bp_path = tmp_path / "bp.parquet"
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path,
                                policy=scripted_policy(answer("WIN")))
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet",
                                    policy=scripted_policy(answer("WIN")))
    first = [row for row in rows if row["turn_idx"] == 0]
    assert first and all(row["n_capped"] == 2 and row["n_errors"] == 0 and row["rollout_scores"] == [
        pytest.approx(200 / 3)] * 2 for row in first)

    # fragile_closing's scorer raises on a lost game: closed as lost after answers, that is the game's error
    config = config_for(checkout, ["fragile_closing"])
    settings = labels_settings(config, max_rollout_rounds=1)
    winner, loser = scripted_policy(answer("WIN")), scripted_policy(answer("no"))
    bps = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=winner)
    with caplog.at_level(logging.WARNING, logger="clemprm.stages"):
        rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels2.parquet", policy=loser)
    first = {bp["bp_id"] for bp in bps if bp["turn_idx"] == 0}
    assert first and first.isdisjoint({row["bp_id"] for row in rows})  # every continuation failed: no label
    assert ("the game's end-of-game hook or scorer raised on the episode closed as lost: RuntimeError: fixture scorer "
            "bug") in caplog.text


def test_an_end_of_game_hook_that_logs_an_event_scores_the_closed_copy_as_a_finished_episode(
        checkout, scripted_policy, tmp_path):
    # closing_event's end-of-game hook logs an event; its scorer divides by each round's requests: the event lands
    # in the last played round, as when the game ends, not in the round clemcore opened after it
    config = config_for(checkout, ["closing_event"])
    catalog = GameCatalog(config["games"])
    finished = play(catalog, scripted_policy(answer("WIN")), "closing_event")[0]
    assert finished["error"] is None and finished["bench_score"] == 100
    settings = labels_settings(config, max_rollout_rounds=1)
    bp_path = tmp_path / "bp.parquet"
    bps = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path,
                                      policy=scripted_policy(answer("WIN")))
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet",
                                    policy=scripted_policy(answer("WIN")))
    first = [row for row in rows if row["turn_idx"] == 0]
    assert len(first) == sum(bp["turn_idx"] == 0 for bp in bps) > 0  # every capped branch point is labelled
    assert all(row["n_capped"] == 2 and row["n_errors"] == 0 and row["rollout_scores"] == [
        pytest.approx(200 / 3)] * 2 for row in first)


def test_the_labelling_counts_include_the_failed_continuations_of_branch_points_left_unlabelled(
        checkout, scripted_policy, tmp_path):
    # fragile_closing's scorer raises on a lost game: a loser's continuations all fail, after the first answer
    # (capped, closed as lost) and after the second (the game ends lost); the last answers end the game: terminal
    config = config_for(checkout, ["fragile_closing"])
    settings = labels_settings(config, max_rollout_rounds=1)
    bp_path = tmp_path / "bp.parquet"
    bps = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path,
                                      policy=scripted_policy(answer("WIN")))
    errors = continuation_scores.ErrorCounts()
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet",
                                    policy=scripted_policy(answer("no")), errors=errors)
    terminal = sum(bp["turn_idx"] == 2 for bp in bps)
    assert terminal and len(rows) == terminal and all(row["n_errors"] == 0 for row in rows)  # the rows hold none
    assert labels.labelling_counts(bps, rows, errors) == (
        f"{terminal}/{len(bps)} labelled ({terminal} terminal), 0 continuations scored (0 capped), "
        f"{2 * (len(bps) - terminal)} failed")


def test_a_scorer_that_raises_is_counted_in_labels_and_in_the_eval_summary(checkout, scripted_policy, tmp_path,
                                                                         caplog):
    config = config_for(checkout, ["fragile_scorer", "pair"])  # fragile_scorer's scorer raises on a lost game
    settings = labels_settings(config)
    bp_path = tmp_path / "bp.parquet"
    loser = scripted_policy(answer("no"))
    with pytest.raises(StageFailure, match=r"branch_points: every episode of game fragile_scorer: (\d+) of \1 "
                                           r"episodes failed, first error: fragile_scorer/e/\d/0: RuntimeError: "
                                           r"fixture scorer bug"):
        branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=loser)
    bps = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path,
                                      policy=scripted_policy(answer("WIN")))
    with caplog.at_level(logging.WARNING, logger="clemprm.stages"):
        rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet", policy=loser)
    fragile = [bp for bp in bps if bp["game"] == "fragile_scorer"]
    labelled = {row["bp_id"] for row in rows}
    # from round 1 every continuation loses and fails to be scored: that branch point has no label; the winning
    # last answers keep theirs; the other game is untouched
    assert fragile and {bp["bp_id"] for bp in fragile if bp["turn_idx"] == 0}.isdisjoint(labelled)
    assert {bp["bp_id"] for bp in fragile if bp["turn_idx"] == 1} <= labelled
    assert all(row["n_errors"] == 0 for row in rows)
    assert {bp["bp_id"] for bp in bps if bp["game"] == "pair"} <= labelled
    failed = 2 * sum(bp["turn_idx"] == 0 for bp in fragile)
    assert f"fragile_scorer: {failed} continuations failed, first: fragile_scorer/e/" in caplog.text

    eval_settings = eval_mode_params(config, "greedy_base")
    with pytest.raises(StageFailure, match="eval greedy_base: every episode of game fragile_scorer"):
        evaluate.evaluate_mode("greedy_base", eval_settings, tmp_path / "greedy_base.parquet", policy=loser)
    evaluate.evaluate_mode("greedy_base", eval_settings, tmp_path / "greedy_base.parquet", policy=loser,
                           on_failure="continue")
    summary = evaluate.summarize_eval(sections(config, "seed", "model", "games", "eval"),
                                      [tmp_path / "greedy_base.parquet"], tmp_path / "prm_eval.json")
    results = summary["modes"]["greedy_base"]["results"]
    episodes = results["fragile_scorer"]["episodes"]
    assert results["fragile_scorer"]["errors"] == episodes > 0 and results["pair"]["errors"] == 0
    assert "RuntimeError: fixture scorer bug" in results["fragile_scorer"]["first_error"]
    assert results["overall"]["errors"] == episodes
    assert len(summary["warnings"]) == 1 and "fragile_scorer" in summary["warnings"][0]


# ------------------------------------------------------------------------------------------------ fail fast


def test_a_game_whose_code_raises_at_import_is_named_with_its_file_and_line(checkout):
    """The console showed `RuntimeError: boom at import`, naming neither the game nor the file."""
    from clemprm.play.clemcore_setup import GameCodeError

    check_config_inputs(load_config(overrides={"games": games_config(checkout, ["raises_at_import"])}))
    master = checkout / "raises_at_import" / "master.py"
    line = next(i for i, text in enumerate(master.read_text().splitlines(), 1) if "boom at import" in text)
    with pytest.raises(GameCodeError, match=rf"game 'raises_at_import': its code failed to load \({master}, line "
                                            rf"{line}\): RuntimeError: boom at import"):
        GameCatalog(games_config(checkout, ["raises_at_import"]))


def test_every_episode_of_a_game_failing_stops_base_rollouts(checkout, scripted_policy, tmp_path):
    config = config_for(checkout, ["broken_setup", "pair"])
    settings = {k: config[k] for k in ("seed", "model", "games", "base_rollouts")}
    output = tmp_path / "base.parquet"
    with pytest.raises(StageFailure, match=r"base_rollouts: every episode of game broken_setup: (\d+) of \1 "
                                           r"episodes failed, first error: broken_setup/e/\d/0: ValueError: math "
                                           r"domain error"):
        rollouts.base_rollouts(settings, output, policy=scripted_policy(answer("WIN")))
    assert not output.exists()
    rows = rollouts.base_rollouts(settings, output, policy=scripted_policy(answer("WIN")), on_failure="continue")
    assert output.exists() and {row["game"] for row in rows if row["error"] is not None} == {"broken_setup"}


def test_every_episode_of_a_game_failing_stops_the_rl_stage(checkout, tmp_path, test_cache_dir):
    """A fresh LoRA (no SFT stage needed) on the tiny model: step 0's rollouts of broken_setup all fail."""
    lora = {"r": 2, "alpha": 2, "dropout": 0.0, "target_modules": ["q_proj"]}
    config = config_for(checkout, ["broken_setup", "pair"])
    config["rl"].update(lora=lora, steps=1, group_size=2, max_new_tokens=4)
    settings = rl_params(config, "grpo")
    paths = [str(tmp_path / name) for name in ("adapter", "metrics.json")]
    expected = (r"rl_adapter \(grpo\) step 0: every episode of game broken_setup: "
                r"(\d+) of \1 episodes failed, first error: .*ValueError: math domain error")
    with pytest.raises(StageFailure, match=expected):
        rl_trainer.train_rl(settings, None, *paths, test_cache_dir)
    assert not (tmp_path / "metrics.json").exists()
    metrics = rl_trainer.train_rl(settings, None, *paths, test_cache_dir, on_failure="continue")
    mark, = read_failure_marks(tmp_path / "metrics.json")
    assert (mark["stage"], mark["condition"], mark["game"]) == ("rl_adapter (grpo) step 0", "all_episodes_failed",
                                                                "broken_setup")
    assert metrics["history"][0]["errors"] == mark["count"] > 0


def test_a_game_without_instances_in_a_split_stops_the_stage(checkout, tmp_path):
    listing = tmp_path / "instances.jsonl"
    listing.write_text(json.dumps({"game": "pair", "experiment": "plain", "task_id": 0, "split": "train"}) + "\n")
    catalog = GameCatalog(games_config(checkout, ["pair"], instance_list=str(listing)))
    assert check_instances("base_rollouts", catalog, "train", "stop") == []
    with pytest.raises(StageFailure, match=r"eval greedy_base: game pair has no validation instances \(the instance "
                                           r"list names none; choose them with games.instance_list\)"):
        check_instances("eval greedy_base", catalog, "validation", "stop")
    mark, = check_instances("eval greedy_base", catalog, "test", "continue")
    assert (mark.stage, mark.condition, mark.game, mark.count) == ("eval greedy_base", "no_instances", "pair", 0)
    assert "game pair has no test instances" in mark.message


def test_no_wins_stops_the_sft_stage_before_loading_the_model(tmp_path):
    data = tmp_path / "sft_data.parquet"
    records.write_records(data, [], records.INTERACTIONS, {})
    settings = {"seed": 0, "model": {"spec": "embedded:smollm2-135m-instruct"},  # never loaded
                "sft": {**load_config()["sft"], "extra_data": None}}
    with pytest.raises(StageFailure, match=r"sft_adapter: no wins to fine-tune on \(0 player perspectives of won "
                                           r"episodes in .*sft_data.parquet, 0 successful rows of sft.extra_data\)"):
        sft.train_sft(settings, str(data), str(tmp_path / "adapter"), str(tmp_path / "metrics.json"))


def test_wins_too_long_to_train_on_stop_the_sft_stage(tmp_path, test_cache_dir):
    data = tmp_path / "sft_data.parquet"
    win = {"messages": [{"role": "user", "content": "a long prompt " * 40}, {"role": "assistant", "content": "A"}],
           "meta": {"game": "g", "experiment": "e", "task_id": 0, "player_name": "Player 1", "game_role": "Guesser",
                    "model": "test", "outcome": "success"}}
    records.write_records(data, [win], records.INTERACTIONS, {})
    config = tiny_config(sft={"max_length": 16, "extra_data": None})
    settings = {name: config[name] for name in ("seed", "model", "sft")}
    paths = [str(tmp_path / name) for name in ("adapter", "metrics.json")]
    with pytest.raises(StageFailure, match=r"sft_adapter: no training examples \(1 wins, 1 of them too long for "
                                           r"sft.max_length 16 even shortened\)"):
        sft.train_sft(settings, str(data), *paths, test_cache_dir)
    metrics = sft.train_sft(settings, str(data), *paths, test_cache_dir, on_failure="continue")
    mark, = read_failure_marks(tmp_path / "metrics.json")
    assert mark["condition"] == "no_training_examples" and metrics["status"].startswith("untrained")


def test_on_failure_continue_marks_every_stage_output_and_the_summary_carries_them(checkout, scripted_policy,
                                                                                    tmp_path, test_cache_dir):
    """A game whose episodes all fail and a policy that never wins, played on with on_failure: continue: each stage
    records what it went on despite, and prm_eval.json lists it all (stage, game, condition, count, first error)."""
    config = config_for(checkout, ["broken_setup", "pair"])
    config["cache_dir"] = test_cache_dir
    config["eval"]["split"] = "train"  # the hash split leaves broken_setup without validation instances
    invalid = scripted_policy(answer("INVALID"))  # pair aborts on the first turn: no win, every label 0
    paths = {name: tmp_path / f"{name}.parquet" for name in ("base", "sft_data", "episodes", "bp", "shard", "labels")}
    rollouts.base_rollouts(sections(config, "seed", "model", "games", "base_rollouts"), paths["base"], policy=invalid,
                           on_failure="continue")
    rollouts.win_filter(sections(config, "win_filter"), paths["base"], paths["sft_data"])
    sft_metrics = tmp_path / "sft_metrics.json"
    metrics = sft.train_sft(sections(config, "seed", "model", "sft"), str(paths["sft_data"]),
                            str(tmp_path / "adapter"), str(sft_metrics), test_cache_dir, on_failure="continue")
    assert metrics["status"].startswith("untrained")
    settings = labels_settings(config)
    branch_points.branch_points(settings, None, paths["episodes"], paths["bp"], policy=invalid, on_failure="continue")
    labels.soft_labels_shard(settings, paths["bp"], None, 0, 1, paths["shard"], policy=invalid)
    with pytest.raises(StageFailure, match=r"gather_soft_labels: no soft label with any variance: all \d+ labels are "
                                           r"0\.000, nothing for a PRM to learn"):
        labels.gather_soft_labels(settings, paths["bp"], [paths["shard"]], paths["labels"])
    labels.gather_soft_labels(settings, paths["bp"], [paths["shard"]], paths["labels"], on_failure="continue")
    evaluate.evaluate_mode("greedy_base", eval_mode_params(config, "greedy_base"), tmp_path / "greedy_base.parquet",
                           policy=invalid, on_failure="continue")
    summary = evaluate.summarize_eval(sections(config, "seed", "model", "games", "eval"),
                                      [tmp_path / "greedy_base.parquet"], tmp_path / "prm_eval.json",
                                      upstream_paths=[paths["base"], sft_metrics, paths["bp"], paths["labels"]])

    marks = summary["upstream_warnings"]
    assert [(m["stage"], m["condition"], m["game"]) for m in marks] == [
        ("base_rollouts", "all_episodes_failed", "broken_setup"), ("sft_adapter", "no_wins", None),
        ("branch_points", "all_episodes_failed", "broken_setup"), ("gather_soft_labels", "no_label_variance", None),
        ("eval greedy_base", "all_episodes_failed", "broken_setup")]
    episodes = {mark["stage"]: mark["count"] for mark in marks if mark["game"] == "broken_setup"}
    assert episodes == {"base_rollouts": 4 * 2, "branch_points": 4, "eval greedy_base": 4 * config["eval"][
        "episodes_per_instance"]}  # 4 train instances
    assert all("ValueError: math domain error" in mark["first_error"] for mark in marks if mark["game"])
    assert marks[1]["count"] == 0 and marks[1]["first_error"] is None
    assert marks[3]["count"] == len(records.read_records(paths["labels"])) > 0
    assert summary["warnings"] == [mark["message"] for mark in marks]
    assert json.loads((tmp_path / "prm_eval.json").read_text())["upstream_warnings"] == marks
    # the report's front page starts with them
    page = tmp_path / "warnings.html"
    report.write_warnings_page(summary, page)
    text = page.read_text()
    assert "WARNING: 5 failed stage check(s) went on" in text
    assert all(mark["stage"] in text and mark["condition"] in text for mark in marks)
    report.write_warnings_page({"upstream_warnings": []}, page)
    assert "No stage went on after a failure" in page.read_text()


@pytest.mark.parametrize("games, expected", [
    ({"clembench_path": "/nonexistent/clembench", "clembench_games": ["pair"]},
     "games.clembench_path: /nonexistent/clembench is not a directory"),
    ({"clembench_games": ["nope"]}, "no game 'nope' in clembench checkout"),
    ({"clembench_games": ["in_docs"]}, "no game 'in_docs'"),  # a spec where clemcore never looks
    ({"clembench_games": ["names_missing_file"]}, "instances_gone.json (its clemgame.json) does not exist"),
    ({"clembench_games": ["pair"], "instances_files": {"pair": "instances_v9"}},
     "instances_v9.json (games.instances_files) does not exist (available in"),
    ({"clembench_games": ["pair"], "instances_files": {"alpha": "instances"}}, "games.instances_files names 'alpha'"),
    ({"clembench_games": ["pair"], "instances_files": {"pair": "../../family/in/instances"}},
     "instances file '../../family/in/instances' (games.instances_files) is not a file of"),
    ({"clembench_games": ["pair"], "instances_files": {"pair": "/etc/passwd"}},
     "instances file '/etc/passwd' (games.instances_files) is not a file of"),
    ({"clembench_games": ["needs_package"]}, "game 'needs_package' imports clemprm_fixture_missing_package, not "
                                             "installed here"),
    ({"clembench_games": ["needs_data"]}, "game 'needs_data' needs the NLTK data clemprm_fixture_data, which NLTK "
                                          "does not find here (on a machine with network: python -m nltk.downloader "
                                          "-d DIR clemprm_fixture_data, then set NLTK_DATA=DIR"),
])
def test_parse_time_checks_name_what_is_wrong(checkout, games, expected):
    config = load_config(overrides={"games": {"clembench_path": str(checkout), **games}})
    with pytest.raises(ConfigInputError) as error:
        check_config_inputs(config)
    assert expected in str(error.value)


def test_parse_time_checks_pass_good_games_and_catch_a_bad_model_spec(checkout):
    check_config_inputs(load_config(overrides={"games": games_config(checkout, ["pair", "family", "alpha", "coins"])}))
    with pytest.raises(ConfigInputError, match="model.spec: unknown embedded model 'nope'"):
        check_config_inputs(load_config(overrides={"model": {"spec": "embedded:nope"}}))
    with pytest.raises(ConfigInputError, match="model.spec: model folder /nonexistent/model does not exist"):
        check_config_inputs(load_config(overrides={"model": {"spec": "/nonexistent/model"}}))


# ------------------------------------------------------------------------------------------------ end to end


def test_the_tiny_pipeline_end_to_end_on_clembench_games(completed_run, tmp_path):
    """Snakemake, the tiny model, three clembench layouts (a spec list's variant, a nested game, a random game) and a
    game whose every episode fails, played on under on_failure: continue: prm_eval.json and the report say so.

    The session's completed run plays them beside the built-in games (tests/test_workflow.py's tiny config: this
    module's checkout and a playpen-data instance list in its working directory), so no pipeline runs for them alone."""
    work, results = completed_run.workdir, completed_run.workdir / "results"
    config = yaml.safe_load((work / "tiny.yaml").read_text())
    games = workflow.CLEMBENCH_GAMES   # pair_variant, family, coin, broken_setup
    assert config["games"]["clembench_games"] == games and games[-1] == "broken_setup"
    train, repeats = config["games"]["max_instances"]["train"], config["base_rollouts"]["episodes_per_instance"]
    eval_episodes = load_config()["eval"]["episodes_per_instance"]  # 1 validation instance per game
    episodes = [row for row in records.read_records(results / "rollouts/base_train.parquet") if row["game"] in games]
    assert {row["game"] for row in episodes} == set(games)
    assert all((row["error"] is None) == (row["game"] != "broken_setup") for row in episodes)
    assert {row["experiment"] for row in episodes if row["game"] == "pair_variant"} == {"variant"}
    # the splits come from the instance list: game ids 0-3 are train instances (max_instances.train of them played,
    # drawn by the seed), 4 the validation one
    for game in games:
        ids = collections.Counter(row["game_id"] for row in episodes if row["game"] == game)
        assert set(ids) <= set(range(4)) and len(ids) == train and set(ids.values()) == {repeats}, (game, ids)
    played = records.read_records(results / "eval/greedy_base.parquet")
    assert sorted((row["game"], row["game_id"]) for row in played if row["game"] in games) == sorted(
        (game, 4) for game in games for _ in range(eval_episodes))
    soft = records.read_records(results / "labels/soft_labels.parquet")
    assert {row["game"] for row in soft} >= set(games) - {"broken_setup"}   # broken_setup: no branch points
    assert len({row["label"] for row in soft}) > 1 and all(row["n_errors"] == 0 for row in soft)
    summary = json.loads((results / "prm_eval.json").read_text())
    assert set(summary["modes"]["greedy_base"]["results"]) == set(workflow.GAMES) | {"overall"}
    best_of_n = summary["modes"]["best_of_n"]["results"]
    assert all(best_of_n[game]["errors"] == 0 for game in games[:3])
    assert best_of_n["broken_setup"]["errors"] == best_of_n["broken_setup"]["episodes"] > 0
    # every stage that went on despite broken_setup, earlier stages first: every eval mode but self_correct, which
    # plays score.games (guessnumber) alone
    marks = summary["upstream_warnings"]
    failed_episodes = [m for m in marks if m["condition"] == "all_episodes_failed"]
    assert [(m["stage"], m["condition"], m["game"], m["count"]) for m in failed_episodes] == [
        ("base_rollouts", "all_episodes_failed", "broken_setup", train * repeats),
        ("branch_points", "all_episodes_failed", "broken_setup", train),
        *[(f"eval {mode}", "all_episodes_failed", "broken_setup", eval_episodes)
          for mode in config["eval"]["modes"] if mode != "self_correct"]]
    assert all("ValueError: math domain error" in m["first_error"] for m in failed_episodes)
    # the tiny model's SFT and PRM on a handful of examples may also have learned nothing: marked, never hidden
    assert {(m["stage"], m["condition"]) for m in marks if m not in failed_episodes} <= {
        ("sft_adapter", "adapter_not_trained"), ("prm_adapter", "prm_not_learned")}
    # the report's front page starts with them: this block (tests/test_workflow.py's test_snakemake_report checks
    # that `snakemake --report` puts it there)
    page = (results / "report/warnings.html").read_text()
    assert f"WARNING: {len(marks)} failed stage check(s) went on (on_failure: continue)" in page
    assert page.count("<td>all_episodes_failed</td>") == page.count("<td>broken_setup</td>") == len(failed_episodes)
    assert math.isfinite(summary["modes"]["greedy_base"]["results"]["overall"]["percent_played"]["value"])

    # a wrong checkout fails when the Snakefile is parsed, before any job
    bad = workflow.changed_config(completed_run, tmp_path, games={"clembench_path": str(tmp_path / "none")})
    done = workflow.snakemake(work, "-n", configfile=bad, check=False)
    assert done.returncode != 0 and "is not a directory (a clembench checkout)" in done.stdout + done.stderr


def test_clem_score_recomputes_the_scores_of_the_fixture_games(completed_run, tmp_path):
    """The eval modes' clembench results trees of the completed run, cut to the fixture clembench games (their game
    code is the run's checkout, CLEMBENCH_HOME for clemcore): `clem score` recomputes every scores.json as ours."""
    from tests.test_clembench_tree import canonical, clem

    work = completed_run.workdir
    games = set(workflow.CLEMBENCH_GAMES) - {"broken_setup"}   # its episodes fail at set-up: nothing to score
    results = tmp_path / "clembench"
    shutil.copytree(work / "results/clembench", results)
    for game in [path for path in results.glob("*/*/*") if path.is_dir()]:   # <mode>/<run>/<game>
        if game.name not in games:
            shutil.rmtree(game)
    ours = {}
    for scores in results.rglob("scores.json"):
        ours[scores] = json.loads(scores.read_text())
        scores.unlink()
    assert {path.parts[-4] for path in ours} == games
    clem("score", "-r", str(results), cwd=tmp_path / "cwd", games=work / yaml.safe_load(
        (work / "tiny.yaml").read_text())["games"]["clembench_path"])
    for path, scores in ours.items():
        assert path.exists(), f"clem score wrote no {path}"
        assert canonical(json.loads(path.read_text())) == canonical(scores), path

