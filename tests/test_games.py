"""The built-in games (clemprm/games): parsing, outcomes and scores, instance files, loading. Offline, no model.

Games are played through clemcore's ``GameMasterEnv`` with scripted answers (see :func:`play`), and scored as
the pipeline does: ``create_game_scorer(...).compute_scores(recorder.interactions)``.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field

import pytest

from clemprm.games import BUILTIN_GAMES, SPLITS, builtin_game_dir, generate_all_instances, instance_generator
from clemprm.games import common
from clemprm.games.common import get_parse_mode, mentions_word, parse_free_text, parse_integer, parse_option
from clemprm.play.clemcore_setup import import_clemcore

WORD_GAMES = tuple(game for game in BUILTIN_GAMES if game != "hanabi")  # hanabi's own tests: tests/test_hanabi.py


def _import_clemcore():
    """clemcore as the engine imports it (without its logging side effects: dictConfig + ./clembench.log)."""
    import_clemcore()
    import clemcore.clemgame as clemgame
    from clemcore.backends import CustomResponseModel
    from clemcore.clemgame.envs.pettingzoo.master import GameMasterEnv
    return clemgame, CustomResponseModel, GameMasterEnv


@pytest.fixture(scope="module")
def clem():
    return _import_clemcore()


@pytest.fixture(scope="module")
def benchmarks(clem):
    clemgame = clem[0]
    loaded = {}
    for name in BUILTIN_GAMES:
        spec = clemgame.GameSpec.from_directory(str(builtin_game_dir(name)))[0]
        loaded[name] = clemgame.GameBenchmark.load_from_spec(spec)
    return loaded


def read_split(game: str, split: str) -> dict:
    return json.loads((builtin_game_dir(game) / "in" / f"instances_{split}.json").read_text())


def experiment_of(game: str, name: str, parse_mode: str = "lenient", split: str = "train") -> dict:
    for experiment in read_split(game, split)["experiments"]:
        if experiment["name"] == name:
            experiment = {k: v for k, v in experiment.items() if k != "game_instances"}
            experiment["parse_mode"] = parse_mode
            return experiment
    raise KeyError(name)


@dataclass
class Played:
    scores: dict
    interactions: dict
    turns: list = field(default_factory=list)  # (game_role, context content, answer)
    violations: int = 0

    @property
    def main_score(self):
        return self.scores["Main Score"]

    @property
    def outcome(self) -> str:
        flags = [key for key in ("Aborted", "Lose", "Success") if self.scores[key] == 1]
        assert len(flags) == 1, self.scores
        return flags[0]


def new_env(clem, gb, experiment: dict, instance: dict, models=None):
    """A reset GameMasterEnv with an interactions recorder registered on game start; returns (env, holder)."""
    clemgame, CustomResponseModel, GameMasterEnv = clem
    holder = {}

    class RecorderCallback(clemgame.GameBenchmarkCallback):
        def on_game_start(self, game_master, game_instance):
            recorder = clemgame.GameInteractionsRecorder(
                game_master.game_spec.game_name, game_master.experiment["name"], game_instance["game_id"],
                "test", None)
            for player in game_master.get_players():
                recorder.log_player(player.name, player.game_role, player.model.name)
            game_master.register(recorder)
            holder["recorder"] = recorder

    env = GameMasterEnv(gb, callbacks=clemgame.GameBenchmarkCallbackList([RecorderCallback()]))
    env.reset(options={"player_models": models or [CustomResponseModel()], "experiment": experiment,
                       "game_instance": instance})
    return env, holder


def drive(env, answers, turns: list, max_steps: int | None = None) -> list:
    """Steps the env with scripted answers (None: the player's programmatic answer) until no agent is left
    (or ``max_steps`` answers were given); returns the unused answers."""
    answers = list(answers)
    while env.agents and (max_steps is None or len(turns) < max_steps):
        agent = env.agent_selection
        observation, _, terminated, truncated, _ = env.last()
        if terminated or truncated:
            env.step(None)
            continue
        player = env.player_by_agent_id[agent]
        assert answers, f"script ran out; the game asked {player.game_role}: {observation['content']!r}"
        answer = answers.pop(0)
        if answer is None:
            answer = player._custom_response(observation)
        player.perceive_context(observation)
        env.step(answer)
        player.perceive_response(answer)
        turns.append((player.game_role, observation["content"], answer))
    return answers


def score(gb, experiment, instance, recorder, turns) -> Played:
    scorer = gb.create_game_scorer(experiment, instance)
    scorer.compute_scores(recorder.interactions)
    return Played(scorer.scores["episode scores"], recorder.interactions, turns,
                  sum(recorder.violated_requests_counts))


def play(clem, benchmarks, game: str, experiment: dict, instance: dict, answers) -> Played:
    """Plays one instance with the scripted answers (all must be used) and scores it."""
    gb = benchmarks[game]
    env, holder = new_env(clem, gb, experiment, instance)
    turns = []
    left = drive(env, answers, turns)
    assert not left, f"game ended with unused answers {left}"
    return score(gb, experiment, instance, holder["recorder"], turns)


def assert_nan(value):
    assert isinstance(value, float) and math.isnan(value), value


# ---------------------------------------------------------------------------------------------------------
# common parsing


@pytest.mark.parametrize("text, mode, expected", [
    ("GUESS: 5", "strict", 5),
    ("guess:5.", "strict", 5),
    ("  GUESS: <7> because it is the middle", "strict", 7),
    ("I think 5", "strict", None),
    ("I think 5", "lenient", 5),
    ("GUESS: 11", "strict", None),
    ("GUESS: 11", "lenient", None),
    ("From 1 to 10 I pick the middle.\nGUESS: 6\nDone.", "strict", 6),
    ("From 1 to 10 I pick the middle.\nGUESS: 6\nDone.", "lenient", 6),
    ("**GUESS:** 4", "strict", None),
    ("**GUESS:** 4", "lenient", 4),
    ("My guess is GUESS: 4", "strict", None),
    ("GUESS: five", "lenient", None),
    ("GUESS: 3.5", "lenient", None),
    ("GUESS: -3", "lenient", None),
    ("GUESS: 12345678901234567890123", "lenient", None),
    ("9" * 5000, "lenient", None),
    ("", "strict", None),
    ("", "lenient", None),
    (None, "lenient", None),
    ("GUESS:", "lenient", None),
])
def test_parse_integer(text, mode, expected):
    assert parse_integer(text, "GUESS", 1, 10, mode) == expected


OPTIONS = ["apple", "pear", "hammer", "plum"]


@pytest.mark.parametrize("text, mode, expected", [
    ("ANSWER: hammer", "strict", "hammer"),
    ("answer: Hammer.", "strict", "hammer"),
    ("ANSWER: \"hammer\" because it is a tool", "strict", "hammer"),
    ("The odd one is hammer", "strict", None),
    ("The odd one is hammer", "lenient", "hammer"),
    ("Not the pear.\nANSWER: hammer", "lenient", "hammer"),
    ("ANSWER: banana", "strict", None),
    ("ANSWER: banana, or maybe plum", "lenient", "plum"),
    ("ANSWER: apples", "strict", None),
    ("pineapple", "lenient", None),
    ("PLUM", "lenient", "plum"),
    ("", "lenient", None),
    ("\n\n\n", "strict", None),
])
def test_parse_option(text, mode, expected):
    assert parse_option(text, "ANSWER", OPTIONS, mode) == expected


def test_parse_free_text_and_mentions():
    assert parse_free_text("DESCRIPTION: a  red\tfruit", "DESCRIPTION", "strict", 300) == "a red fruit"
    assert parse_free_text("DESCRIPTION:\n\n  a red fruit\nmore", "DESCRIPTION", "strict", 300) == "a red fruit"
    assert parse_free_text("a red fruit", "DESCRIPTION", "strict", 300) is None
    assert parse_free_text("a red\nfruit", "DESCRIPTION", "lenient", 300) == "a red fruit"
    assert parse_free_text("DESCRIPTION:   ", "DESCRIPTION", "lenient", 300) is None
    assert parse_free_text("", "DESCRIPTION", "lenient", 300) is None
    assert parse_free_text("word " * 100, "DESCRIPTION", "lenient", 20) == "word word word word"
    assert mentions_word("Two Apples", "apple") and mentions_word("buses", "bus") and mentions_word("BUS.", "bus")
    assert not mentions_word("pineapple", "apple") and not mentions_word("cupboard", "cup")


def test_parse_mode_from_experiment():
    assert get_parse_mode({}) == "lenient"
    assert get_parse_mode({"parse_mode": None}) == "lenient"
    assert get_parse_mode({"parse_mode": "strict"}) == "strict"
    with pytest.raises(ValueError, match="parse_mode"):
        get_parse_mode({"parse_mode": "fuzzy"})


# ---------------------------------------------------------------------------------------------------------
# guessnumber (legacy API)

GN_INSTANCE = {"game_id": 0, "target": 7}


def gn(clem, benchmarks, answers, parse_mode="lenient"):
    return play(clem, benchmarks, "guessnumber", experiment_of("guessnumber", "range10", parse_mode),
                GN_INSTANCE, answers)


@pytest.mark.parametrize("answers, score", [
    (["GUESS: 7"], 100),
    (["GUESS: 5", "GUESS: 8", "GUESS: 7"], 100 / 3),
    (["GUESS: 1", "GUESS: 2", "GUESS: 3", "GUESS: 7"], 25),
])
def test_guessnumber_success_speed(clem, benchmarks, answers, score):
    result = gn(clem, benchmarks, answers)
    assert result.outcome == "Success"
    assert result.main_score == pytest.approx(score)
    assert result.scores["Request Count"] == len(answers) and result.scores["Violated Request Count"] == 0


def test_guessnumber_feedback_and_lose(clem, benchmarks):
    result = gn(clem, benchmarks, ["GUESS: 5", "GUESS: 9", "GUESS: 5", "GUESS: 8"])
    assert result.outcome == "Lose" and result.main_score == 0
    contexts = [context for _, context, _ in result.turns]
    assert "GUESS: <number>" in contexts[0] and "1 to 10" in contexts[0] and "4 guesses" in contexts[0]
    assert contexts[1].startswith("Higher") and "higher than 5" in contexts[1] and "3 guesses left" in contexts[1]
    assert contexts[2].startswith("Lower") and "lower than 9" in contexts[2]
    assert "1 guess left" in contexts[3]
    assert result.interactions["Guesses"] == [5, 9, 5, 8]


def test_guessnumber_abort_after_two_violations(clem, benchmarks):
    result = gn(clem, benchmarks, ["I have no idea", ""])
    assert result.outcome == "Aborted"
    assert_nan(result.main_score)
    assert result.violations == 2  # count_request_violation events reached the recorder
    assert result.scores["Violated Request Count"] == 2 and result.scores["Parsed Request Count"] == 0
    assert "Invalid answer" in result.turns[1][1] and "GUESS: <number>" in result.turns[1][1]


def test_guessnumber_reprompt_then_recover(clem, benchmarks):
    result = gn(clem, benchmarks, ["no idea", "GUESS: 7"])
    assert result.outcome == "Success" and result.main_score == 100  # violations use up no guesses
    assert result.violations == 1 and result.scores["Request Count"] == 2
    # non-consecutive violations never abort
    result = gn(clem, benchmarks, ["x", "GUESS: 5", "GUESS: 99", "GUESS: 7"])
    assert result.outcome == "Success" and result.main_score == 50 and result.violations == 2


def test_guessnumber_parse_modes(clem, benchmarks):
    assert gn(clem, benchmarks, ["I guess 7"], "lenient").main_score == 100
    strict = gn(clem, benchmarks, ["I guess 7", "GUESS: 7"], "strict")
    assert strict.violations == 1 and strict.outcome == "Success"
    assert gn(clem, benchmarks, ["I guess 7", "7"], "strict").outcome == "Aborted"
    long = "Let me think step by step.\nThe range is 1 to 10, so the middle is 5.\nGUESS: 7\nThat is all."
    for mode in ("strict", "lenient"):
        assert gn(clem, benchmarks, [long], mode).main_score == 100


def test_guessnumber_round_scores_and_legacy_keys(clem, benchmarks):
    result = gn(clem, benchmarks, ["bla", "GUESS: 5", "GUESS: 7"])
    assert isinstance(result.interactions["Request Count"], int)
    assert result.interactions["Request Count"] == 3 and result.interactions["Violated Request Count"] == 1
    assert len(result.interactions["turns"]) == 2  # a round is one guess, with its reprompt


def test_guessnumber_programmatic_play(clem, benchmarks):
    """CustomResponseModel play (Player.__call__): the built-in Guesser finds every test target."""
    gb = benchmarks["guessnumber"]
    for experiment in read_split("guessnumber", "test")["experiments"]:
        exp = {k: v for k, v in experiment.items() if k != "game_instances"}
        for instance in experiment["game_instances"]:
            env, holder = new_env(clem, gb, exp, instance)
            while env.agents:
                observation, _, terminated, truncated, _ = env.last()
                if terminated or truncated:
                    env.step(None)
                    continue
                env.step(env.player_by_agent_id[env.agent_selection](observation))
            result = score(gb, exp, instance, holder["recorder"], [])
            assert result.outcome == "Success", (exp["name"], instance)


# ---------------------------------------------------------------------------------------------------------
# wordref (current API, two players)

WR_INSTANCE = {"game_id": 0, "target": "tiger", "target_category": "animal", "target_label": "an animal",
               "words": ["apple", "tiger", "chair"], "categories": ["fruit", "animal", "furniture"],
               "guesser_words": ["chair", "apple", "tiger"]}


def wr(clem, benchmarks, answers, parse_mode="lenient"):
    return play(clem, benchmarks, "wordref", experiment_of("wordref", "different_category", parse_mode),
                WR_INSTANCE, answers)


def test_wordref_success_and_lose(clem, benchmarks):
    result = wr(clem, benchmarks, ["DESCRIPTION: a big striped cat", "ANSWER: tiger"])
    assert result.outcome == "Success" and result.main_score == 100
    (role1, describer_context, _), (role2, guesser_context, _) = result.turns
    assert (role1, role2) == ("Describer", "Guesser")
    assert "apple, tiger, chair" in describer_context and "target word is tiger" in describer_context
    assert "DESCRIPTION: <your description>" in describer_context
    assert "The three words are chair, apple and tiger." in guesser_context
    assert '"a big striped cat"' in guesser_context and "ANSWER: <word>" in guesser_context
    assert result.interactions["players"]["Player 1"]["game_role"] == "Describer"
    lose = wr(clem, benchmarks, ["DESCRIPTION: a big striped cat", "ANSWER: apple"])
    assert lose.outcome == "Lose" and lose.main_score == 0


def test_wordref_prompt_example_names_no_lexicon_word(clem, benchmarks):
    """The Describer's prompt shows an example answer; its words must not be words an instance can use."""
    describer_context = wr(clem, benchmarks, ["DESCRIPTION: a big striped cat", "ANSWER: tiger"]).turns[0][1]
    assert "For example" in describer_context
    lexicon = json.loads((builtin_game_dir("wordref") / "resources" / "lexicon.json").read_text())["categories"]
    named = {word for words in lexicon.values() for word in words if mentions_word(describer_context, word)}
    assert named <= set(WR_INSTANCE["words"]), named


@pytest.mark.parametrize("leak", ["DESCRIPTION: like a Tiger", "DESCRIPTION: not apples, not chairs", ""])
def test_wordref_describer_violation_reprompt(clem, benchmarks, leak):
    result = wr(clem, benchmarks, [leak, "DESCRIPTION: a big striped cat", "ANSWER: tiger"])
    assert result.outcome == "Success" and result.violations == 1
    assert "Invalid answer" in result.turns[1][1] and result.turns[1][0] == "Describer"


def test_wordref_aborts(clem, benchmarks):
    describer = wr(clem, benchmarks, ["DESCRIPTION: a tiger", "DESCRIPTION: TIGERS!"])  # guesser never plays
    assert describer.outcome == "Aborted" and describer.violations == 2
    assert_nan(describer.main_score)
    guesser = wr(clem, benchmarks, ["DESCRIPTION: a big striped cat", "ANSWER: banana", "I don't know"])
    assert guesser.outcome == "Aborted"
    assert_nan(guesser.main_score)
    recovered = wr(clem, benchmarks, ["DESCRIPTION: a big striped cat", "ANSWER: banana", "ANSWER: tiger"])
    assert recovered.outcome == "Success" and recovered.violations == 1


def test_wordref_parse_modes(clem, benchmarks):
    lenient = wr(clem, benchmarks, ["A big striped cat.\nIt lives in the jungle.", "I think it is the tiger."])
    assert lenient.outcome == "Success" and lenient.violations == 0
    assert '"A big striped cat. It lives in the jungle."' in lenient.turns[1][1]
    strict = wr(clem, benchmarks, ["A big striped cat.", "DESCRIPTION: a big striped cat",
                                   "It is the tiger.", "ANSWER: tiger"], "strict")
    assert strict.outcome == "Success" and strict.violations == 2
    next_line = wr(clem, benchmarks, ["DESCRIPTION:\na big striped cat", "ANSWER:   Tiger."], "strict")
    assert next_line.outcome == "Success"
    long = wr(clem, benchmarks, ["DESCRIPTION: " + "very " * 200 + "big cat", "ANSWER: tiger"])
    assert long.outcome == "Success" and len(long.interactions["Description"]) <= 300


def test_wordref_programmatic_play(clem, benchmarks):
    gb = benchmarks["wordref"]
    outcomes = []
    for experiment in read_split("wordref", "test")["experiments"]:
        exp = {k: v for k, v in experiment.items() if k != "game_instances"}
        for instance in experiment["game_instances"]:
            env, holder = new_env(clem, gb, exp, instance)
            turns = []
            drive(env, [None, None], turns)
            outcomes.append(score(gb, exp, instance, holder["recorder"], turns).outcome)
    assert "Aborted" not in outcomes and outcomes.count("Success") >= len(outcomes) * 0.8


# ---------------------------------------------------------------------------------------------------------
# oddoneout (current API)

OO_INSTANCE = {"game_id": 0, "words": ["apple", "pear", "hammer", "plum"], "odd_word": "hammer",
               "category": "fruit", "category_label": "fruits", "odd_category": "tool"}


def oo(clem, benchmarks, answers, parse_mode="lenient"):
    return play(clem, benchmarks, "oddoneout", experiment_of("oddoneout", "different_domain", parse_mode),
                OO_INSTANCE, answers)


@pytest.mark.parametrize("answers, outcome, score", [
    (["ANSWER: hammer"], "Success", 100),
    (["ANSWER: pear", "ANSWER: hammer"], "Success", 50),
    (["ANSWER: pear", "ANSWER: pear"], "Lose", 0),
    (["ANSWER: banana", "ANSWER: hammer"], "Success", 100),
    (["ANSWER: pear", "", "ANSWER: hammer"], "Success", 50),
])
def test_oddoneout_outcomes(clem, benchmarks, answers, outcome, score):
    result = oo(clem, benchmarks, answers)
    assert result.outcome == outcome and result.main_score == score


def test_oddoneout_feedback_and_abort(clem, benchmarks):
    result = oo(clem, benchmarks, ["ANSWER: pear", "ANSWER: hammer"])
    assert "apple, pear, hammer, plum" in result.turns[0][1] and "2 attempts" in result.turns[0][1]
    assert result.turns[1][1].startswith("Wrong, try again") and "not pear" in result.turns[1][1]
    aborted = oo(clem, benchmarks, ["ANSWER: banana", "no idea"])
    assert aborted.outcome == "Aborted" and aborted.violations == 2
    assert_nan(aborted.main_score)
    late = oo(clem, benchmarks, ["ANSWER: pear", "ANSWER: kiwi", "ANSWER: kiwi"])
    assert late.outcome == "Aborted"
    assert_nan(late.main_score)


def test_oddoneout_parse_modes(clem, benchmarks):
    assert oo(clem, benchmarks, ["The odd one is the hammer."], "lenient").main_score == 100
    strict = oo(clem, benchmarks, ["The odd one is the hammer.", "ANSWER: Hammer"], "strict")
    assert strict.main_score == 100 and strict.violations == 1
    multi = "Apple, pear and plum are fruits.\nThe hammer is a tool.\n\nANSWER: hammer"
    for mode in ("strict", "lenient"):
        assert oo(clem, benchmarks, [multi], mode).main_score == 100


def test_oddoneout_round_scores(clem, benchmarks):
    gb = benchmarks["oddoneout"]
    experiment = experiment_of("oddoneout", "different_domain")
    env, holder = new_env(clem, gb, experiment, OO_INSTANCE)
    drive(env, ["ANSWER: pear", "bla", "ANSWER: hammer"], [])
    scorer = gb.create_game_scorer(experiment, OO_INSTANCE)
    scorer.compute_scores(holder["recorder"].interactions)
    rounds = scorer.scores["round scores"]
    assert [rounds[i]["Correct Answer"] for i in sorted(rounds)] == [0, 1]
    assert rounds[1]["Violated Request Count"] == 1


def test_oddoneout_programmatic_play(clem, benchmarks):
    gb = benchmarks["oddoneout"]
    for experiment in read_split("oddoneout", "test")["experiments"]:
        exp = {k: v for k, v in experiment.items() if k != "game_instances"}
        for instance in experiment["game_instances"]:
            env, holder = new_env(clem, gb, exp, instance)
            drive(env, [None], [])
            assert score(gb, exp, instance, holder["recorder"], []).main_score == 100


# ---------------------------------------------------------------------------------------------------------
# all games: loading, forking, robustness, prompts


def test_load_from_spec(benchmarks):
    expected = {"guessnumber": ("GuessNumberBenchmark", 1), "wordref": ("WordRefBenchmark", 2),
                "hanabi": ("HanabiBenchmark", 2),
                "oddoneout": ("OddOneOutBenchmark", 1)}
    for name, gb in benchmarks.items():
        assert (type(gb).__name__, gb.game_spec.players) == expected[name]
        assert gb.game_spec.game_name == name and gb.game_spec.image == "none"


def test_builtin_game_dir():
    assert builtin_game_dir("wordref").name == "wordref"
    with pytest.raises(ValueError, match=r"nogame.*guessnumber, wordref, oddoneout"):
        builtin_game_dir("nogame")


def test_unknown_parse_mode_fails_loudly(clem, benchmarks):
    clemgame, CustomResponseModel, _ = clem
    for name, gb in benchmarks.items():
        experiment = read_split(name, "test")["experiments"][0]
        experiment = {**{k: v for k, v in experiment.items() if k != "game_instances"}, "parse_mode": "fuzzy"}
        with pytest.raises(ValueError, match="parse_mode"):
            gb.create_game_master(experiment, [CustomResponseModel()])


def test_missing_parse_mode_defaults_to_lenient(clem, benchmarks):
    experiment = experiment_of("oddoneout", "different_domain")
    del experiment["parse_mode"]
    result = play(clem, benchmarks, "oddoneout", experiment, OO_INSTANCE, ["it is the hammer"])
    assert result.main_score == 100


@pytest.mark.parametrize("game", BUILTIN_GAMES)
def test_fork_mid_game(clem, benchmarks, game):
    """A deep-copied env plays on independently (the pipeline forks games at branch points)."""
    gb = benchmarks[game]
    split = read_split(game, "validation")["experiments"][0]
    experiment = {**{k: v for k, v in split.items() if k != "game_instances"}, "parse_mode": "strict"}
    instance = split["game_instances"][0]
    env, holder = new_env(clem, gb, experiment, instance)
    drive(env, ["garbage answer %%%"], [], max_steps=1)  # a violation: the player is reprompted
    fork_env, fork_recorder = copy.deepcopy((env, holder["recorder"]))
    drive(fork_env, ["garbage again"], [])  # the fork aborts (second violation in a row)
    drive(env, [None] * 100, [])  # the original recovers with the programmatic answers
    original = score(gb, experiment, instance, holder["recorder"], [])
    forked = score(gb, experiment, instance, fork_recorder, [])
    assert original.outcome != "Aborted" and forked.outcome == "Aborted"
    assert original.violations == 1 and forked.violations == 2


ODD_ANSWERS = ["", " ", "\n\n", "GUESS:", "ANSWER:", "DESCRIPTION:", "\x00\ufffd\U0001F600",
               "GUESS: " + "9" * 5000, "ANSWER: " * 500, "x" * 20000, "DESCRIPTION: " + "\n" * 50]


@pytest.mark.parametrize("game", BUILTIN_GAMES)
@pytest.mark.parametrize("mode", common.PARSE_MODES)
def test_never_crashes_on_odd_answers(clem, benchmarks, game, mode):
    split = read_split(game, "test")["experiments"][-1]
    experiment = {**{k: v for k, v in split.items() if k != "game_instances"}, "parse_mode": mode}
    gb = benchmarks[game]
    for start in range(len(ODD_ANSWERS)):
        answers = (ODD_ANSWERS[start:] + ODD_ANSWERS[:start]) * 3
        env, holder = new_env(clem, gb, experiment, split["game_instances"][0])
        drive(env, answers[:len(ODD_ANSWERS) * 2], [])
        result = score(gb, experiment, split["game_instances"][0], holder["recorder"], [])
        if result.outcome == "Aborted":
            assert_nan(result.main_score)
        else:  # only wordref's lenient Describer takes any non-empty text as a description
            assert game == "wordref" and mode == "lenient" and result.main_score in (0, 100)


def test_initial_prompts_are_short(clem, benchmarks):
    for game in WORD_GAMES:  # hanabi's prompt holds the rules and the table (bounded in test_hanabi)
        for experiment in read_split(game, "train")["experiments"]:
            exp = {k: v for k, v in experiment.items() if k != "game_instances"}
            env, _ = new_env(clem, benchmarks[game], exp, experiment["game_instances"][0])
            observation, *_ = env.last()
            # ~1.3 tokens per word for English: 70 words stay under ~100 tokens
            assert len(observation["content"].split()) <= 70, observation["content"]


# ---------------------------------------------------------------------------------------------------------
# instance files


def content_keys(game: str, by_split: dict) -> dict[str, set]:
    """Per split: what must not be shared with another split."""
    keys = {}
    for split, data in by_split.items():
        found = set()
        for experiment in data["experiments"]:
            for instance in experiment["game_instances"]:
                if game == "guessnumber":
                    found.add((experiment["name"], instance["target"]))
                elif game == "wordref":
                    found.update(instance["words"])
                else:
                    found.update(instance["words"])
        keys[split] = found
    return keys


@pytest.mark.parametrize("game", WORD_GAMES)
def test_instance_files(game):
    by_split = {split: read_split(game, split) for split in SPLITS}
    # committed files are the seed-42 output
    assert by_split == instance_generator(game).build_instances(42)
    sizes = {split: sum(len(e["game_instances"]) for e in data["experiments"]) for split, data in by_split.items()}
    assert sizes == {"train": 40, "validation": 40, "test": 20}   # 40 held-out instances per game
    keys = content_keys(game, by_split)
    for i, first in enumerate(SPLITS):
        for second in SPLITS[i + 1:]:
            assert not keys[first] & keys[second], (first, second)
    ids = {}
    for split in SPLITS:
        for experiment in by_split[split]["experiments"]:
            assert experiment["parse_mode"] == "lenient"
            for instance in experiment["game_instances"]:
                assert isinstance(instance["game_id"], int)
                ids.setdefault(experiment["name"], []).append(instance["game_id"])
    for name, game_ids in ids.items():  # unique within an experiment, over all splits, from 0
        assert sorted(game_ids) == list(range(len(game_ids))), name


def test_generation_is_deterministic(tmp_path):
    generate_all_instances(42, tmp_path / "a")
    generate_all_instances(42, tmp_path / "b")
    generate_all_instances(7, tmp_path / "c")
    for game in BUILTIN_GAMES:
        for split in SPLITS:
            name = f"instances_{split}.json"
            a = (tmp_path / "a" / game / name).read_text()
            assert a == (tmp_path / "b" / game / name).read_text()
            assert a == (builtin_game_dir(game) / "in" / name).read_text()  # committed files are up to date
        c = [(tmp_path / "c" / game / f"instances_{s}.json").read_text() for s in SPLITS]
        assert c != [(tmp_path / "a" / game / f"instances_{s}.json").read_text() for s in SPLITS]
