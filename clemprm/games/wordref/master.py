"""wordref: one player describes a target word, the other picks it out of three candidate words.

Two players, self-play by the same model in both roles, written with clemcore's CURRENT game API
(``_parse_response`` raising ``ParseError``, ``_advance_game``, ``_on_parse_error``, ``state.succeed/failed/abort``).

One round:
1. the "Describer" sees the three candidate words and which one is the target, and answers
   ``DESCRIPTION: <text>``. The description must not contain ANY of the three candidate words (nor their plural
   with -s/-es; case-insensitive, whole words): naming the target gives the answer away, naming a distractor
   ("not the dog") sidesteps describing. Such a description is a violation, like a missing tag (strict) or an
   empty description;
2. the "Guesser" sees the three words (in another, per-instance shuffled order) and the description, and answers
   ``ANSWER: <word>``; an answer naming none of the three words is a violation.

A violation is answered with one reprompt of the same player; a second consecutive violation aborts.
Success when the guess is the target, lose otherwise. Main Score: 100 success, 0 lose, NaN abort.
"""

from __future__ import annotations

import re

import numpy as np

from clemcore.clemgame import DialogueGameMaster, GameBenchmark, GameScorer, GameSpec, ParseError, Player
from clemcore.clemgame.master import Outcome
from clemcore.clemgame.metrics import BENCH_SCORE, METRIC_ABORTED, METRIC_SUCCESS

from clemprm.games.common import (first_tagged_value, format_line, get_parse_mode, handle_violation, log_outcome,
                                  mentions_word, options_reason, parse_free_text, parse_option, reprompt_text)

DESCRIPTION_TAG = "DESCRIPTION"
ANSWER_TAG = "ANSWER"
DESCRIPTION_FORMAT = format_line(DESCRIPTION_TAG, "your description")
ANSWER_FORMAT = format_line(ANSWER_TAG, "word")
MAX_DESCRIPTION_CHARS = 300
"""Longer descriptions are cut (at a word boundary) before the check and before the Guesser sees them."""

DESCRIBER_PROMPT = (
    "Let's play a word game. The words are: {words}. Your target word is {target}. "
    "Describe the target so that another player can pick it out. "
    "Do not say any of the three words. For example, for kite, lamp and river with target lamp, a good answer "
    "is:\nDESCRIPTION: it gives light in a dark room\n"
    "Answer with one line in this format:\n{answer_format}"
)
GUESSER_PROMPT = (
    "Let's play a word game. Another player described one of three words:\n"
    "\"{description}\"\n"
    "The three words are {options}. Which word was described? Answer with one line in this format:\n{answer_format}"
)

KEY_TARGET = "Target"
KEY_DESCRIPTION = "Description"
KEY_GUESS = "Guess"


def describer_prompt(words: list[str], target: str) -> str:
    return DESCRIBER_PROMPT.format(words=", ".join(words), target=target, answer_format=DESCRIPTION_FORMAT)


def guesser_prompt(words: list[str], description: str) -> str:
    options = ", ".join(words[:-1]) + " and " + words[-1]
    return GUESSER_PROMPT.format(options=options, description=description, answer_format=ANSWER_FORMAT)


def parse_description(response, mode: str, candidates: list[str]) -> str:
    """The description of a Describer answer; raises ParseError (with the reason) when it is a violation."""
    description = parse_free_text(response, DESCRIPTION_TAG, mode, MAX_DESCRIPTION_CHARS)
    if description is None:
        if mode == "strict" and first_tagged_value(response, DESCRIPTION_TAG) is None:
            raise ParseError(f"no line starts with {DESCRIPTION_TAG}", response, "MISSING_TAG")
        raise ParseError("the description is empty", response, "EMPTY")
    leaked = [word for word in candidates if mentions_word(description, word)]
    if leaked:
        raise ParseError(f"do not say {', '.join(leaked)}", response, "MENTIONS_CANDIDATE")
    return description


def parse_guess(response, mode: str, candidates: list[str]) -> str:
    """The guessed word of a Guesser answer; raises ParseError when it names none of the candidates."""
    guess = parse_option(response, ANSWER_TAG, candidates, mode)
    if guess is None:
        raise ParseError(options_reason(candidates), response, "NO_CANDIDATE")
    return guess


class Describer(Player):
    """Programmatic play: names the category, the first two letters and the length of the target."""

    def __init__(self, model, target: str, category_label: str):
        super().__init__(model, game_role="Describer")
        self.target = target
        self.category_label = category_label

    def _custom_response(self, context) -> str:
        return (f"{DESCRIPTION_TAG}: It is {self.category_label}. Its name starts with "
                f"'{self.target[:2]}' and has {len(self.target)} letters.")


class Guesser(Player):
    """Programmatic play: picks the word matching the prefix and length the description gives, else the first."""

    def __init__(self, model, words: list[str]):
        super().__init__(model, game_role="Guesser")
        self.words = list(words)

    def _custom_response(self, context) -> str:
        content = (context or {}).get("content", "")
        match = re.search(r"starts with '(\w+)' and has (\d+) letters", content)
        guess = self.words[0]
        if match is not None:
            fitting = [w for w in self.words if w.startswith(match.group(1)) and len(w) == int(match.group(2))]
            guess = fitting[0] if fitting else guess
        return f"{ANSWER_TAG}: {guess}"


class WordRef(DialogueGameMaster):

    def __init__(self, game_spec: GameSpec, experiment: dict, player_models: list):
        super().__init__(game_spec, experiment, player_models)
        self.parse_mode = get_parse_mode(experiment)

    def _on_setup(self, **game_instance):
        self.target: str = game_instance["target"]
        self.words: list[str] = list(game_instance["words"])
        self.guesser_words: list[str] = list(game_instance["guesser_words"])
        if self.target not in self.words or sorted(self.words) != sorted(self.guesser_words):
            raise ValueError(f"inconsistent wordref instance {game_instance}")
        self.description: str | None = None
        self.guess: str | None = None
        self.consecutive_violations = 0
        self.reprompted = False
        self.describer = Describer(self.player_models[0], self.target, game_instance["target_label"])
        self.guesser = Guesser(self.player_models[1], self.guesser_words)
        self.add_player(self.describer, initial_context=describer_prompt(self.words, self.target))
        self.add_player(self.guesser)

    def _parse_response(self, player: Player, response: str) -> str:
        if player is self.describer:
            return parse_description(response, self.parse_mode, self.words)
        return parse_guess(response, self.parse_mode, self.guesser_words)

    def _on_parse_error(self, error: ParseError):
        answer_format = DESCRIPTION_FORMAT if self.current_player is self.describer else ANSWER_FORMAT
        handle_violation(self, self.current_player, error, reprompt_text(error.reason, answer_format))

    def _advance_game(self, player: Player, parsed_response: str):
        self.consecutive_violations = 0
        self.reprompted = False
        self.info["parse_ok"] = True
        if player is self.describer:
            self.description = parsed_response
            self.log_to_self("description", parsed_response)
            self.set_context_for(self.guesser, guesser_prompt(self.guesser_words, parsed_response))
            return
        self.guess = parsed_response
        correct = parsed_response == self.target
        self.log_to_self("guess", {"guess": parsed_response, "target": self.target, "correct": correct})
        if correct:
            self.log_to_self("game_result", "SUCCESS")
            self.state.succeed()
        else:
            self.log_to_self("game_result", "LOSE")
            self.state.failed()

    def _should_pass_turn(self) -> bool:
        return not self.reprompted

    def _start_next_round(self) -> bool:
        # one round: describe, then guess (reprompts stay in the round)
        return not self.reprompted and self._current_player_idx == 0

    def _on_after_game(self):
        log_outcome(self, aborted=self.state.outcome is Outcome.ABORTED, success=self.state.outcome is Outcome.SUCCESS)
        self.log_key(KEY_TARGET, self.target)
        self.log_key(KEY_DESCRIPTION, self.description)
        self.log_key(KEY_GUESS, self.guess)


class WordRefScorer(GameScorer):

    def compute_round_score(self, round_idx, round_events: list[dict]) -> None:
        for event in round_events:
            action = event["action"]
            if action["type"] == "guess":
                self.log_round_score(round_idx, "Correct Guess", int(action["content"]["correct"]))
            elif action["type"] == "description":
                self.log_round_score(round_idx, "Description Length", len(action["content"].split()))

    def compute_episode_scores(self, interactions: dict):
        if interactions[METRIC_ABORTED]:
            score = np.nan
        elif interactions[METRIC_SUCCESS]:
            score = 100
        else:
            score = 0
        self.log_episode_score(BENCH_SCORE, score)


class WordRefBenchmark(GameBenchmark):

    def create_game_master(self, experiment: dict, player_models: list) -> DialogueGameMaster:
        return WordRef(self.game_spec, experiment, player_models)

    def create_game_scorer(self, experiment: dict, game_instance: dict) -> GameScorer:
        return WordRefScorer(self.game_name, experiment, game_instance)
