"""The lockstep engine plays exactly what clemcore's sequential runner plays: under greedy decoding of the tiny
model, and with a scripted player whose episodes play several turns (reprompts included) and end in every outcome
(won, lost, aborted), so the equivalence is not just "both abort after two violations"."""

from __future__ import annotations

import math
import re

import pytest

from clemprm.play.catalog import GameCatalog
from tests.clemcore_runners import run_clemcore
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from tests.conftest import binary_search_answer, tiny_config

MAX_NEW_TOKENS = 10
GAMES = ["guessnumber", "wordref", "oddoneout"]
INSTANCES = 6   # per game: with these, the scripted player below reaches every outcome in every game


@pytest.fixture(scope="module")
def tiny_policy(test_cache_dir):
    from clemprm.models.loader import ModelConfig
    from clemprm.models.generation import PolicyModel
    return PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir),
                       temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def catalog():
    return GameCatalog(tiny_config(games={"max_instances": {"train": 4, "validation": INSTANCES, "test": 4}})["games"])


def words_in(text: str, pattern: str) -> list[str]:
    return re.search(pattern, text).group(1).replace(" and ", ", ").split(", ")


def mixed_player(messages: list[dict]) -> str:
    """Wins, loses or breaks the rules depending on what the instance shows it; some wins and losses come after a
    rule violation (reprompted). Only the conversation decides the answer, so both runners get the same ones."""
    first, junk = messages[0]["content"], "I am not sure."
    answered = sum(m["role"] == "assistant" for m in messages)
    if "guessing game" in first:   # guessnumber, by range: binary search after a violation / count up / junk
        top = int(re.search(r"from 1 to (\d+)", first).group(1))
        if top == 10:
            return junk if answered == 0 else binary_search_answer(messages)
        if top < 100:
            guesses = re.findall(r"than (\d+)", "\n".join(m["content"] for m in messages))
            return f"GUESS: {int(guesses[-1]) + 1 if guesses else 1}"
        return junk
    if "Your target word is" in first:   # wordref describer: spells the target backwards (the guesser decodes it)
        target = re.search(r"Your target word is (\w+)", first).group(1)
        return f"DESCRIPTION: it reads {target[::-1]} backwards"
    if "Another player described" in first:   # wordref guesser, by where the target is among the options
        options = words_in(first, r"The three words are (.*?)\. ")
        target = next(word for word in options if f" {word[::-1]} " in first)
        where = options.index(target)
        if where == 0:
            return junk if answered == 0 else f"ANSWER: {target}"
        return f"ANSWER: {next(w for w in options if w != target)}" if where == 1 else junk
    # oddoneout, by where the odd word is: right after a violation / junk / wrong, then right / wrong twice
    words = words_in(first, r"The words are: (.*?)\. ")
    odd = next(word for word in words if word in ODD_WORDS)
    where, others = words.index(odd), [w for w in words if w != odd]
    if where == 0:
        return junk if answered == 0 else f"ANSWER: {odd}"
    if where == 1:
        return junk
    return f"ANSWER: {odd if where == 2 and answered == 1 else others[answered]}"


ODD_WORDS: set[str] = set()


def compare(catalog, game: str, policy, sampling: Sampling) -> list[dict]:
    """Play the validation instances with the engine and with clemcore's sequential runner; assert they agree."""
    instances = catalog.instances(game, "validation")
    ours = RolloutEngine(catalog, sampling).play(instances, [policy], repeats=1, base_seed=0, stage="test",
                                                 policy_name=policy.name)
    reference = run_clemcore("sequential", catalog.benchmarks[game], instances, policy)
    assert len(ours) == len(reference) == len(instances)
    for row, ref in zip(ours, reference):
        assert row["error"] is None
        assert [turn["response"] for turn in row["turns"]] == ref.responses
        assert row["aborted"] == bool(ref.scores["Aborted"])
        assert row["success"] == bool(ref.scores["Success"])
        assert row["lost"] == bool(ref.scores["Lose"])
        ref_score = float(ref.scores["Main Score"])
        assert (math.isnan(row["bench_score"]) and math.isnan(ref_score)) or row["bench_score"] == ref_score
    return ours


@pytest.mark.parametrize("game", GAMES)
def test_lockstep_equals_sequential_runner(game, catalog, tiny_policy):
    rows = compare(catalog, game, tiny_policy, Sampling(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS))
    assert all(row["n_turns"] >= 2 for row in rows)   # a random model: reprompted after its first violation


@pytest.mark.parametrize("game", GAMES)
def test_lockstep_equals_sequential_runner_in_every_outcome(game, catalog, scripted_policy):
    ODD_WORDS.update(i.instance["odd_word"] for i in catalog.instances("oddoneout", "validation"))
    rows = compare(catalog, game, scripted_policy(mixed_player), Sampling())
    outcomes = {"aborted" if row["aborted"] else "won" if row["success"] else "lost" for row in rows}
    assert outcomes == {"won", "lost", "aborted"}, [(row["n_turns"], row["bench_score"]) for row in rows]
    assert max(row["n_turns"] for row in rows if not row["aborted"]) >= (2 if game == "oddoneout" else 3)
    # a rule violation that was reprompted, and the game then played on to a win
    assert any(row["success"] and not all(turn["parse_ok"] for turn in row["turns"]) for row in rows)
