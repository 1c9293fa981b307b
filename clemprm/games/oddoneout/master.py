"""oddoneout: four words, three share a category; name the one that does not belong.

Single player ("Guesser"), written with clemcore's CURRENT game API. The Guesser answers ``ANSWER: <word>`` and
has ``max_attempts`` (2) attempts; after a wrong first attempt the game master says "Wrong, try again".
A wrong word among the four is a valid move; an answer naming none of the four words is a violation, answered
with one reprompt; a second consecutive violation aborts. Violations do not use up attempts.

Main Score: 100 / attempts used on success (100 at the first attempt, 50 at the second), 0 lose, NaN abort.
"""

from __future__ import annotations

import numpy as np

from clemcore.clemgame import DialogueGameMaster, GameBenchmark, GameScorer, GameSpec, ParseError, Player
from clemcore.clemgame.master import Outcome
from clemcore.clemgame.metrics import BENCH_SCORE, METRIC_ABORTED, METRIC_SUCCESS

from clemprm.games.common import (format_line, get_parse_mode, handle_violation, log_outcome, options_reason,
                                  parse_option, reprompt_text)

TAG = "ANSWER"
ANSWER_FORMAT = format_line(TAG, "word")

INITIAL_PROMPT = (
    "Which word does not belong with the others? The words are: {words}. "
    "Three of them share a category, one does not. You have {attempts} attempts. "
    "Answer with one line in this format:\n{answer_format}"
)
FEEDBACK = "Wrong, try again. The odd one out is not {guess}. Answer with one line in this format:\n{answer_format}"

KEY_TARGET = "Target"
KEY_ANSWERS = "Answers"


def initial_prompt(words: list[str], attempts: int) -> str:
    return INITIAL_PROMPT.format(words=", ".join(words), attempts=attempts, answer_format=ANSWER_FORMAT)


def feedback_prompt(guess: str) -> str:
    return FEEDBACK.format(guess=guess, answer_format=ANSWER_FORMAT)


def parse_answer(response, mode: str, words: list[str]) -> str:
    """The chosen word; raises ParseError when the answer names none of the words."""
    answer = parse_option(response, TAG, words, mode)
    if answer is None:
        raise ParseError(options_reason(words), response, "NO_WORD")
    return answer


class Guesser(Player):
    """Programmatic play: the right answer."""

    def __init__(self, model, odd_word: str):
        super().__init__(model, game_role="Guesser")
        self.odd_word = odd_word

    def _custom_response(self, context) -> str:
        return f"{TAG}: {self.odd_word}"


class OddOneOut(DialogueGameMaster):

    def __init__(self, game_spec: GameSpec, experiment: dict, player_models: list):
        super().__init__(game_spec, experiment, player_models)
        self.parse_mode = get_parse_mode(experiment)
        self.max_attempts = int(experiment.get("max_attempts", 2))

    def _on_setup(self, **game_instance):
        self.words: list[str] = list(game_instance["words"])
        self.odd_word: str = game_instance["odd_word"]
        if self.odd_word not in self.words:
            raise ValueError(f"inconsistent oddoneout instance {game_instance}")
        self.answers: list[str] = []
        self.consecutive_violations = 0
        self.reprompted = False
        self.guesser = Guesser(self.player_models[0], self.odd_word)
        self.add_player(self.guesser, initial_context=initial_prompt(self.words, self.max_attempts))

    def _parse_response(self, player: Player, response: str) -> str:
        return parse_answer(response, self.parse_mode, self.words)

    def _on_parse_error(self, error: ParseError):
        handle_violation(self, self.guesser, error, reprompt_text(error.reason, ANSWER_FORMAT))

    def _advance_game(self, player: Player, parsed_response: str):
        self.consecutive_violations = 0
        self.reprompted = False
        self.info["parse_ok"] = True
        self.answers.append(parsed_response)
        correct = parsed_response == self.odd_word
        self.log_to_self("answer", {"answer": parsed_response, "correct": correct, "attempt": len(self.answers)})
        if correct:
            self.log_to_self("game_result", "SUCCESS")
            self.state.succeed()
        elif len(self.answers) >= self.max_attempts:
            self.log_to_self("game_result", "LOSE")
            self.state.failed()
        else:
            self.set_context_for(self.guesser, feedback_prompt(parsed_response))

    def _should_pass_turn(self) -> bool:
        return not self.reprompted

    def _start_next_round(self) -> bool:
        # a round is one attempt, together with the reprompt before it (if any)
        return not self.reprompted

    def _on_after_game(self):
        log_outcome(self, aborted=self.state.outcome is Outcome.ABORTED, success=self.state.outcome is Outcome.SUCCESS)
        self.log_key(KEY_TARGET, self.odd_word)
        self.log_key(KEY_ANSWERS, list(self.answers))


class OddOneOutScorer(GameScorer):

    def compute_round_score(self, round_idx, round_events: list[dict]) -> None:
        for event in round_events:
            action = event["action"]
            if action["type"] == "answer":
                self.log_round_score(round_idx, "Correct Answer", int(action["content"]["correct"]))

    def compute_episode_scores(self, interactions: dict):
        attempts = len(interactions[KEY_ANSWERS])
        self.log_episode_score("Attempts Used", attempts)
        if interactions[METRIC_ABORTED]:
            score = np.nan
        elif interactions[METRIC_SUCCESS]:
            score = 100 / attempts
        else:
            score = 0
        self.log_episode_score(BENCH_SCORE, score)


class OddOneOutBenchmark(GameBenchmark):

    def create_game_master(self, experiment: dict, player_models: list) -> DialogueGameMaster:
        return OddOneOut(self.game_spec, experiment, player_models)

    def create_game_scorer(self, experiment: dict, game_instance: dict) -> GameScorer:
        return OddOneOutScorer(self.game_name, experiment, game_instance)
