"""hanabi: rules, the rule-based player, the per-turn scores (deduction, move rating, format), parsing, outcomes
through clemcore, the engine's per-turn rewards, the states prompt set and replay, instance files. Offline, no model."""

from __future__ import annotations

import json
import math
import random

import pytest

from clemprm import records
from clemprm.play.catalog import GameCatalog
from clemprm.config import load_config
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.games import SPLITS, builtin_game_dir, instance_generator
from clemprm.games.hanabi import bot, protocol
from clemprm.games.hanabi.rewards import REWARD_KEYS, ROUND_SCORE_NAMES, turn_rewards
from clemprm.games.hanabi.rules import Card, DeckConfig, HandCard, HanabiConfigError, HanabiState, Move
from clemprm.stages.rl_states import replay_state, self_play_states, state_instance, write_states
from tests.test_games import _import_clemcore, drive, new_env, score

SMALL = {"name": "small", "colours": ["red", "yellow"], "ranks": 3, "rank_counts": [3, 2, 1], "hand_size": 3,
         "hint_tokens": 4, "fuse_tokens": 3}
SMALL_CONFIG = DeckConfig.from_experiment(SMALL)
# two cards: Player A holds R1, Player B holds R2; one fuse token
TWO_CARDS = {"name": "two_cards", "colours": ["red"], "ranks": 2, "rank_counts": [1, 1], "hand_size": 1,
             "hint_tokens": 2, "fuse_tokens": 1, "parse_mode": "lenient"}


def hanabi_games(**overrides) -> dict:
    return load_config(overrides={"games": {"builtin": ["hanabi"], **overrides}})["games"]


def train_experiments() -> list[dict]:
    return json.loads((builtin_game_dir("hanabi") / "in" / "instances_train.json").read_text())["experiments"]


def new_state(config: DeckConfig, deck: str) -> HanabiState:
    return HanabiState(config, config.parse_deck(deck))


def deal(state: HanabiState, player: int, cards: list[HandCard]) -> None:
    state.hands[player] = list(cards)


# ---------------------------------------------------------------------------------------------------------
# rules


def test_deck_config_errors_name_the_key():
    with pytest.raises(HanabiConfigError, match="'bad'.*rank_counts"):
        DeckConfig.from_experiment({**SMALL, "name": "bad", "rank_counts": [3, 2]})
    with pytest.raises(HanabiConfigError, match="colours .*first letters"):
        DeckConfig.from_experiment({**SMALL, "colours": ["red", "rose"]})
    with pytest.raises(HanabiConfigError, match="hand_size"):
        DeckConfig.from_experiment({**SMALL, "hand_size": 7})
    with pytest.raises(HanabiConfigError, match="lacks keys .*fuse_tokens"):
        DeckConfig.from_experiment({k: v for k, v in SMALL.items() if k != "fuse_tokens"})
    with pytest.raises(HanabiConfigError, match="not a permutation"):
        SMALL_CONFIG.parse_deck("R1 R1 R1 R2 R2 R3 Y1 Y1 Y1 Y2 Y2 Y2")
    with pytest.raises(HanabiConfigError, match="'B1' is not a card"):
        SMALL_CONFIG.parse_deck("B1 R1 R1 R2 R2 R3 Y1 Y1 Y1 Y2 Y2 Y3")


def test_rules_on_a_hand_built_game():
    state = new_state(SMALL_CONFIG, "R1 Y1 R2 Y2 R3 R1 Y1 Y2 R1 Y3 R2 Y1")
    assert [hc.card for hc in state.hands[0]] == [Card("red", 1), Card("red", 2), Card("red", 3)]  # dealt in turn
    assert [hc.card for hc in state.hands[1]] == [Card("yellow", 1), Card("yellow", 2), Card("red", 1)]
    assert state.illegal_reason(Move("discard", 0)).startswith("all 4 hint tokens")
    assert state.illegal_reason(Move("hint_colour", "yellow")) is None
    assert state.illegal_reason(Move("hint_rank", 3)) == (
        "your partner has no 3 card: a hint must touch at least one card")
    assert state.apply(Move("hint_colour", "yellow")) == "hinted yellow: your slots 1, 2"
    told = state.hands[1]
    assert [hc.told_colour for hc in told] == ["yellow", "yellow", None] and told[2].not_colours == {"yellow"}
    assert told[2].knowable(SMALL_CONFIG) == ("red", None)  # the negative information determines the colour
    assert state.hint_tokens == 3 and state.current == 1
    assert state.apply(Move("play", 0)) == "played Y1 from slot 1"  # B plays Y1, draws Y1 (card 7)
    assert state.fireworks == {"red": 0, "yellow": 1} and state.hands[1][-1].card == Card("yellow", 1)
    assert state.hands[1][0].told_colour == "yellow"  # the others moved up, keeping their hints
    assert "misplayed R2" in state.apply(Move("play", 1))  # A plays R2 on an empty red stack
    assert state.fuse_tokens == 2 and state.discards == [Card("red", 2)]
    assert state.apply(Move("discard", 2)) == "discarded Y1 from slot 3"
    assert state.hint_tokens == 4 and state.deck_left == 3
    assert set(state.legal_moves()) >= {Move("play", 0), Move("hint_rank", 1)}
    assert not any(move.kind == "discard" for move in state.legal_moves())  # all hint tokens are there


def test_last_round_completed_stack_and_last_fuse():
    state = new_state(DeckConfig.from_experiment(TWO_CARDS), "R1 R2")
    assert state.final_turns_left == 2  # the deck is empty from the start
    state.apply(Move("play", 0))
    state.hint_tokens = 1
    state.apply(Move("play", 0))  # R2 completes the stack: a hint token comes back, perfect score
    assert state.over and state.score() == 2 and state.hint_tokens == 2
    bombed = new_state(DeckConfig.from_experiment(TWO_CARDS), "R2 R1")
    bombed.apply(Move("play", 0))
    assert bombed.over and bombed.fuse_tokens == 0 and bombed.score() == 0
    state = new_state(SMALL_CONFIG, "R1 Y1 R2 Y2 R3 R1 Y1 Y2 R1 Y3 R2 Y1")
    while state.deck_left:  # hint and discard the deck empty
        state.apply(state.legal_moves()[-1] if state.hint_tokens == 4 else Move("discard", 0))
    assert state.final_turns_left == 2 and not state.over  # both play once more after the last card is drawn
    state.apply(state.legal_moves()[-1])
    assert not state.over
    state.apply(state.legal_moves()[-1])
    assert state.over and state.deck_left == 0


# ---------------------------------------------------------------------------------------------------------
# deduction score and move rating on hand-built states


def test_deduction_score_partial_credit_given_what_is_knowable():
    state = new_state(SMALL_CONFIG, "R1 Y1 R2 Y2 R3 R1 Y1 Y2 R1 Y3 R2 Y1")
    deal(state, 0, [HandCard(Card("red", 2), told_colour="red"),                 # colour known, rank open
                    HandCard(Card("yellow", 3), not_colours=frozenset({"red"}), not_ranks=frozenset({1, 2})),  # Y3
                    HandCard(Card("yellow", 1))])                                  # nothing known
    assert bot.ideal_deduction(state, 0) == [("red", None), ("yellow", 3), (None, None)]
    cases = {
        "R? Y3 ??": (1.0, 1),       # the ideal answer (card 3: nothing knowable, nothing claimed: not scored)
        "R2 Y3 Y1": (1.0, 1),       # true claims on open attributes are not punished
        "R1 Y3 ??": (0.75, 0),      # card 1: colour right, a wrong guess of its open rank
        "?? ?? ??": (0.0, 0),       # every knowable attribute left open
        "Y? Y? ??": (0.25, 0),      # card 1: wrong colour; card 2: colour right, its known rank left open
        "R?": (1 / 3, 0),           # missing entries score 0
    }
    for text, expected in cases.items():
        entries = protocol.parse_deduction(f"DEDUCTION: {text}", SMALL_CONFIG, 3, "lenient")
        got = protocol.deduction_scores(entries, state, 0)
        assert got[0] == pytest.approx(expected[0]) and got[1] == expected[1], text
    assert protocol.deduction_scores(None, state, 0) == (0.0, 0)


def test_move_rating_on_a_hand_built_state():
    # A holds R1 R2 Y3 (the only yellow 3), B holds Y1 Y2 R1; A hints B's 1s, B hints A's 1: A knows slot 1 plays
    state = new_state(SMALL_CONFIG, "R1 Y1 R2 Y2 Y3 R1 R1 Y1 Y2 R2 R3 Y1")
    state.apply(Move("hint_rank", 1))
    state.apply(Move("hint_rank", 1))
    assert state.hands[0][0].knowable(SMALL_CONFIG) == (None, 1) and state.hint_tokens == 2
    assert bot.bot_move(state) == Move("play", 0)  # certainly playable
    values = bot.move_values(state)
    assert set(values) == set(state.legal_moves())
    best, worst = max(values.values()), min(values.values())
    assert values[Move("play", 0)] == best > worst
    assert bot.move_rating(values, Move("play", 0)) == 1.0
    assert bot.move_rating(values, Move("discard", 1)) < 1.0  # throws away the only yellow 3
    worst_moves = [move for move, value in values.items() if value == worst]
    assert all(bot.move_rating(values, move) == 0.0 for move in worst_moves)
    assert all(0.0 <= bot.move_rating(values, move) <= 1.0 for move in values)
    # a continuation value is the final score of the rule-based player's play from there
    after = state.copy()
    after.apply(Move("play", 0))
    while not after.over:
        after.apply(bot.bot_move(after))
    assert values[Move("play", 0)] == after.score()
    assert bot.move_rating({Move("play", 0): 3, Move("play", 1): 3}, Move("play", 1)) == 1.0  # all equal


# ---------------------------------------------------------------------------------------------------------
# the rule-based player


def play_out(config: DeckConfig, deck: str, choose) -> int:
    state = new_state(config, deck)
    while not state.over:
        move = choose(state)
        assert state.illegal_reason(move) is None, (move, deck)
        state.apply(move)
    return state.score()


@pytest.mark.parametrize("experiment", ["small", "full"])
def test_rule_based_player_never_breaks_a_rule_and_beats_random_play(experiment):
    spec = next(exp for exp in train_experiments() if exp["name"] == experiment)
    config = DeckConfig.from_experiment(spec)
    decks = [instance["deck"] for instance in spec["game_instances"]]
    bot_scores = [play_out(config, deck, bot.bot_move) for deck in decks]
    random_scores = [play_out(config, deck, lambda s, rng=random.Random(seed): bot.random_move(s, rng))
                     for seed, deck in enumerate(decks)]
    bot_mean, random_mean = sum(bot_scores) / len(decks), sum(random_scores) / len(decks)
    assert bot_mean >= random_mean + 0.3 * config.max_score, (bot_mean, random_mean)
    assert sum(b > r for b, r in zip(bot_scores, random_scores)) >= 0.8 * len(decks)


# ---------------------------------------------------------------------------------------------------------
# parsing


@pytest.mark.parametrize("text, mode, move", [
    ("DEDUCTION: ?? ?? ??\nMOVE: play 2", "strict", Move("play", 1)),
    ("deduction: r? ?2 ??\nmove: Discard 3.", "strict", Move("discard", 2)),
    ("DEDUCTION: ?? ?? ??\nMOVE: hint red", "strict", Move("hint_colour", "red")),
    ("DEDUCTION: ?? ?? ??\nMOVE: **hint 3**", "strict", Move("hint_rank", 3)),
    ("DEDUCTION: ?? ?? ??\nMOVE: hint rank 2", "strict", Move("hint_rank", 2)),
    ("DEDUCTION: ?? ?? ??\nI will play 1", "strict", None),
    ("DEDUCTION: ?? ?? ??\nI will play 1", "lenient", Move("play", 0)),
    ("I play the card in slot 3", "lenient", Move("play", 2)),
    ("Let me give a hint about the yellow cards: hint yellow", "lenient", Move("hint_colour", "yellow")),
    ("MOVE: play 4", "strict", None),                      # no slot 4 in a hand of 3
    ("MOVE: hint blue", "lenient", None),                  # no blue in this deck
    ("MOVE: hint 4\nor maybe discard 1", "lenient", Move("discard", 0)),
    ("MOVE: <play N | discard N | hint COLOUR | hint RANK>", "lenient", None),  # the format echoed
    ("play N plays your card", "lenient", None),
    ("", "lenient", None),
    (None, "strict", None),
])
def test_parse_move(text, mode, move):
    assert protocol.parse_move(text, SMALL_CONFIG, 3, mode) == move


@pytest.mark.parametrize("text, mode, entries", [
    ("DEDUCTION: R? ?2 ??\nMOVE: play 1", "strict", (("red", None), (None, 2), (None, None))),
    ("DEDUCTION: r1, y3, ??", "strict", (("red", 1), ("yellow", 3), (None, None))),
    ("DEDUCTION: R? ?2", "strict", None),                  # one entry per card
    ("DEDUCTION: R? ?2 ?? ??", "strict", None),
    ("DEDUCTION: R? ?4 ??", "strict", None),               # no rank 4
    ("DEDUCTION: slot 1 R?, slot 2 ?2", "strict", None),
    ("DEDUCTION: slot 1 R?, slot 2 ?2", "lenient", (("red", None), (None, 2))),
    ("DEDUCTION: R? B2 ?? ?? ??", "lenient", (("red", None), (None, None), (None, None))),
    ("R? ?2 ??", "lenient", None),                         # no tag: no deduction
])
def test_parse_deduction(text, mode, entries):
    assert protocol.parse_deduction(text, SMALL_CONFIG, 3, mode) == entries


def test_parse_answer_reasons():
    assert protocol.parse_answer("MOVE: play 1", SMALL_CONFIG, 3, "lenient").reason is None
    strict = protocol.parse_answer("MOVE: play 1", SMALL_CONFIG, 3, "strict")
    assert strict.move == Move("play", 0) and "DEDUCTION" in strict.reason
    assert "MOVE" in protocol.parse_answer("DEDUCTION: ?? ?? ??", SMALL_CONFIG, 3, "strict").reason
    answer = protocol.answer_text([("red", None), (None, 2), (None, None)], Move("hint_colour", "red"), SMALL_CONFIG)
    assert answer == "DEDUCTION: R? ?2 ??\nMOVE: hint red"
    parsed = protocol.parse_answer(answer, SMALL_CONFIG, 3, "strict")
    assert parsed.reason is None and parsed.move == Move("hint_colour", "red")


# ---------------------------------------------------------------------------------------------------------
# the game through clemcore


@pytest.fixture(scope="module")
def clem():
    return _import_clemcore()


@pytest.fixture(scope="module")
def gb(clem):
    spec = clem[0].GameSpec.from_directory(str(builtin_game_dir("hanabi")))[0]
    return clem[0].GameBenchmark.load_from_spec(spec)


def hplay(clem, gb, experiment, instance, answers):
    env, holder = new_env(clem, gb, experiment, instance)
    turns = []
    left = drive(env, answers, turns)
    assert not left, f"game ended with unused answers {left}"
    result = score(gb, experiment, instance, holder["recorder"], turns)
    scorer = gb.create_game_scorer(experiment, instance)
    scorer.compute_scores(holder["recorder"].interactions)
    return result, scorer.scores["round scores"]


def test_outcomes_success_lose_abort(clem, gb):
    two = {"game_id": 0, "deck": "R1 R2"}
    success, rounds = hplay(clem, gb, TWO_CARDS, two, ["DEDUCTION: ?1\nMOVE: play 1", "MOVE: play 1"])
    assert success.outcome == "Success" and success.main_score == 100 and success.scores["Fireworks Score"] == 2
    # one colour: it is knowable, so ? earns 0 for it; the open rank earns 1 as it is true; no deduction: 0
    assert [rounds[i]["Deduction Score"] for i in sorted(rounds)] == [0.5, 0.0]
    assert success.turns[0][0] == "Player A" and success.turns[1][0] == "Player B"
    lose, _ = hplay(clem, gb, TWO_CARDS, {"game_id": 1, "deck": "R2 R1"}, ["MOVE: play 1"])  # the last fuse
    assert lose.outcome == "Lose" and lose.main_score == 0
    partial, _ = hplay(clem, gb, {**TWO_CARDS, "fuse_tokens": 2}, {"game_id": 1, "deck": "R2 R1"},
                       ["MOVE: play 1", "MOVE: play 1"])  # A misplays R2, B plays R1: the game ends at 1 of 2
    assert partial.outcome == "Lose" and partial.main_score == 50
    aborted, rounds = hplay(clem, gb, TWO_CARDS, two, ["no idea", "MOVE: discard 1"])  # full tokens: illegal
    assert aborted.outcome == "Aborted" and math.isnan(aborted.main_score) and aborted.violations == 2
    assert math.isnan(aborted.scores["Mean Move Rating"])
    assert [rounds[i]["Format"] for i in sorted(rounds)] == [0, 0]
    assert aborted.turns[1][1].startswith("Invalid answer: give a move")
    reasons = [event["action"]["content"] for round_events in aborted.interactions["turns"] for event in round_events
               if event["action"]["type"] == "invalid format"]
    assert reasons[1] == "all 2 hint tokens are there: you cannot discard"
    recovered, rounds = hplay(clem, gb, TWO_CARDS, two, ["no idea", "MOVE: play 1", "MOVE: play 1"])
    assert recovered.outcome == "Success" and recovered.violations == 1
    assert [rounds[i]["Format"] for i in sorted(rounds)] == [0, 1, 1]
    assert recovered.turns[1][1].startswith("Invalid answer: give a move")


def test_prompt_shows_what_hanabi_lets_a_player_see(clem, gb):
    experiment = {**SMALL, "parse_mode": "strict"}
    instance = {"game_id": 0, "deck": "R1 Y1 R2 Y2 R3 R1 Y1 Y2 R1 Y3 R2 Y1"}
    env, holder = new_env(clem, gb, experiment, instance)
    turns = []
    drive(env, ["DEDUCTION: ?? ?? ??\nMOVE: hint yellow", "DEDUCTION: Y? Y? R?\nMOVE: play 1"], turns, max_steps=2)
    first, second = turns[0][1], turns[1][1]
    assert "Partner's cards: slot 1: Y1; slot 2: Y2; slot 3: R1." in first
    assert "R1 Y1 R2" not in first and "slot 1: R1" not in first  # never its own cards
    assert "Your cards (what hints told you): slot 1: yellow; slot 2: yellow; slot 3: not yellow." in second
    assert "Partner's last move: hinted yellow: your slots 1, 2." in second
    assert "Hint tokens: 3 of 4" in second and "Stacks: R0 Y0" in second and "Discarded: none" in second
    observation, *_ = env.last()
    assert "Partner's cards: slot 1: Y2 (told: yellow); slot 2: R1; slot 3: Y1." in observation["content"]
    assert "Partner's last move: played Y1 from slot 1." in observation["content"]
    player = env.player_by_agent_id[env.agent_selection]
    assert len(player.perceive_context(observation)) == 1  # a fresh single-turn prompt each turn
    assert len(first.split()) <= 230


def test_strict_mode_requires_the_deduction(clem, gb):
    two = {"game_id": 0, "deck": "R1 R2"}
    strict = {**TWO_CARDS, "parse_mode": "strict"}
    result, rounds = hplay(clem, gb, strict, two, ["MOVE: play 1", "DEDUCTION: R?\nMOVE: play 1", "I play 1",
                                                   "DEDUCTION: R2\nMOVE: play 1"])
    assert result.outcome == "Success" and result.violations == 2
    assert [rounds[i]["Format"] for i in sorted(rounds)] == [0, 1, 0, 1]
    assert [rounds[i]["Exact Deduction"] for i in sorted(rounds)] == [0, 1, 0, 1]


def test_programmatic_play_is_the_rule_based_player(clem, gb):
    """clemcore's programmatic players play the rule-based player's moves: the same scores as in pure Python."""
    for spec in train_experiments():
        experiment = {k: v for k, v in spec.items() if k != "game_instances"}
        config = DeckConfig.from_experiment(experiment)
        for instance in spec["game_instances"][:3 if spec["name"] == "small" else 1]:  # a full game: ~4 s of ratings
            env, holder = new_env(clem, gb, experiment, instance)
            drive(env, [None] * 500, [])
            result = score(gb, experiment, instance, holder["recorder"], [])
            expected = play_out(config, instance["deck"], bot.bot_move)
            assert result.outcome != "Aborted" and result.main_score == pytest.approx(100 * expected / config.max_score)
            assert result.scores["Mean Exact Deduction"] == 1.0 and result.scores["Mean Format"] == 1.0


# ---------------------------------------------------------------------------------------------------------
# engine: per-turn rewards, states, replay


@pytest.fixture(scope="module")
def catalog():
    return GameCatalog(hanabi_games(experiments={"hanabi": ["small"]}, max_instances={"train": 3, "validation": 2,
                                                                                       "test": 2}))


def test_turn_rewards_match_the_round_scores_and_work_mid_game(catalog, scripted_policy):
    answers = iter(["DEDUCTION: ?? ?? ??\nMOVE: play 1", "nonsense", "DEDUCTION: ?? R? ??\nMOVE: hint 1"] * 40)
    policy = scripted_policy(lambda messages: next(answers))
    engine = RolloutEngine(catalog, Sampling())
    episode = engine.start(catalog.instances("hanabi", "validation")[0], [policy], "e", 1)
    engine.run([episode], max_turns=4)
    partial = turn_rewards(episode)  # unfinished game
    game_master = episode.env.game_master  # a label continuation capped here scores the stacks so far
    assert game_master.partial_bench_score() == 100 * game_master.game.score() / 6
    assert len(partial) == 4 and partial[1] == {"deduction": 0.0, "exact_deduction": 0, "move_rating": 0.0, "format": 0}
    engine.run([episode])
    assert episode.done and episode.error is None
    rewards = turn_rewards(episode)
    assert len(rewards) == len(episode.turns) and rewards[:4] == partial
    assert [r["format"] for r in rewards] == [int(turn["parse_ok"]) for turn in episode.turns]
    scorer = episode.benchmark.create_game_scorer(episode.instance.experiment, episode.instance.instance)
    scorer.compute_scores(episode.recorder.interactions)
    rounds = scorer.scores["round scores"]
    assert sorted(rounds) == list(range(len(episode.turns)))  # one round per answer
    for index, reward in enumerate(rewards):
        assert {key: rounds[index][ROUND_SCORE_NAMES[key]] for key in REWARD_KEYS} == reward
    row = episode.record(policy.name, engine.sampling)
    assert json.loads(row["episode_scores"])["Mean Move Rating"] == pytest.approx(
        sum(r["move_rating"] for r in rewards) / len(rewards))
    wordref = GameCatalog(load_config()["games"])
    wordref_engine = RolloutEngine(wordref, Sampling())
    other = wordref_engine.replay(wordref_engine.start(wordref.instances("wordref", "train")[0], [policy], "w", 1),
                                  ["DESCRIPTION: a thing"])
    with pytest.raises(ValueError, match="only hanabi"):
        turn_rewards(other)


def test_states_replay_to_the_same_prompt_deterministically(catalog, scripted_policy, tmp_path):
    rows = self_play_states(catalog, "train")
    assert rows == self_play_states(catalog, "train")
    assert {row["turn_idx"] for row in rows} >= {0, 1, 2} and all(row["split"] == "train" for row in rows)
    engine = RolloutEngine(catalog, Sampling())
    policy = scripted_policy(lambda messages: "unused")
    for row in rows[::5]:
        episode = replay_state(engine, state_instance(catalog, row), row["history"], [policy], row["state_id"], 0)
        player, messages = engine.waiting(episode)
        assert messages == row["messages"] and player.name == row["player"]
        assert len(messages) == 1 and messages[0]["role"] == "user"
        engine.replay(episode, [row["reference"]])
        reward = turn_rewards(episode)[-1]
        assert reward["format"] == 1 and reward["exact_deduction"] == 1
    twice = replay_state(engine, state_instance(catalog, rows[7]), rows[7]["history"], [policy], "a", 0)
    again = replay_state(engine, state_instance(catalog, rows[7]), rows[7]["history"], [policy], "b", 0)
    assert engine.waiting(twice)[1] == engine.waiting(again)[1]
    with pytest.raises(ValueError, match="did not reach a waiting player"):
        replay_state(engine, state_instance(catalog, rows[7]), rows[7]["history"] + ["junk", "junk"], [policy], "c", 0)
    out = tmp_path / "states.parquet"
    written = write_states(catalog.config, str(out), 0, "train", max_per_episode=4)
    assert records.read_records(out, records.STATES) == written
    assert len(written) == 3 * 4 and records.read_provenance(out)["config"]["states"]["max_per_episode"] == 4


def test_experiments_filter(catalog):
    assert {i.experiment["name"] for i in catalog.all_instances("train")} == {"small"}
    both = GameCatalog(hanabi_games())
    assert {i.experiment["name"] for i in both.instances("hanabi", "train")} == {"small", "full"}
    with pytest.raises(ValueError, match=r"games.experiments.hanabi: no experiment \['tiny'\]"):
        GameCatalog(hanabi_games(experiments={"hanabi": ["tiny"]})).instances("hanabi", "train")
    assert load_config()["games"]["builtin"] == ["guessnumber", "wordref", "oddoneout"]  # the default stays


# ---------------------------------------------------------------------------------------------------------
# instance files


def test_instance_files_are_disjoint_permutations():
    by_split = {split: json.loads((builtin_game_dir("hanabi") / "in" / f"instances_{split}.json").read_text())
                for split in SPLITS}
    assert by_split == instance_generator("hanabi").build_instances(42)
    decks = {}
    for split, data in by_split.items():
        for experiment in data["experiments"]:
            config = DeckConfig.from_experiment(experiment)
            for instance in experiment["game_instances"]:
                config.parse_deck(instance["deck"], experiment["name"])  # a permutation of the experiment's deck
                decks.setdefault(split, []).append((experiment["name"], instance["deck"]))
    assert {split: len(d) for split, d in decks.items()} == {"train": 100, "validation": 20, "test": 20}
    for i, first in enumerate(SPLITS):
        assert len(set(decks[first])) == len(decks[first])
        for second in SPLITS[i + 1:]:
            assert not set(decks[first]) & set(decks[second]), (first, second)
    assert instance_generator("hanabi").build_instances(7) != by_split
