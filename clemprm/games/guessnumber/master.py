"""guessnumber: guess a secret integer in 1..N within M guesses, told "higher" or "lower" after each wrong guess.

Single player ("Guesser"), multi-turn, written with clemcore's LEGACY game API (as most clembench games are):
``_validate_player_response`` / ``_parse_response`` / ``_on_valid_player_response``, own outcome flags (the game
never sets ``state.outcome``), and its own request counts logged as ints at the end of the game.

Rules:
* a valid answer is a guess in 1..N (parse mode: see :mod:`clemprm.games.common`); repeated guesses count;
* an invalid answer is a violation (``count_request_violation``): the Guesser is reprompted once; a second
  consecutive violation aborts. Violations do not use up guesses;
* success when the guess is the secret number; lose after M wrong guesses.

Main Score (BENCH_SCORE): 100 / number of guesses used on success, 0 on lose, NaN on abort.
"""

from __future__ import annotations

import re

import numpy as np

from clemcore.clemgame import GameBenchmark, GameSpec, Player
from clemcore.clemgame.legacy.master import DialogueGameMaster
from clemcore.clemgame.legacy.scorer import GameScorer
from clemcore.clemgame.metrics import (BENCH_SCORE, METRIC_ABORTED, METRIC_REQUEST_COUNT,
                                       METRIC_REQUEST_COUNT_PARSED, METRIC_REQUEST_COUNT_VIOLATED, METRIC_SUCCESS)

from clemprm.games.common import (MAX_CONSECUTIVE_VIOLATIONS, format_line, get_parse_mode, log_outcome,
                                  parse_integer, reprompt_text)

TAG = "GUESS"
ANSWER_FORMAT = format_line(TAG, "number")

INITIAL_PROMPT = (
    "Let's play a guessing game. I picked a secret number from 1 to {max_number}. "
    "You have {max_guesses} guesses. After each wrong guess I tell you if the secret number "
    "is higher or lower. Answer with one line in this format:\n{answer_format}"
)
FEEDBACK = (
    "{direction}. The secret number is {direction_lower} than {guess}. "
    "You have {left} {guesses_word} left. Reply in this format:\n{answer_format}"
)

# keys logged into the interactions (read by the scorer)
KEY_TARGET = "Target"
KEY_GUESSES = "Guesses"
KEY_MAX_GUESSES = "Max Guesses"
KEY_MAX_NUMBER = "Max Number"


def initial_prompt(max_number: int, max_guesses: int) -> str:
    return INITIAL_PROMPT.format(max_number=max_number, max_guesses=max_guesses, answer_format=ANSWER_FORMAT)


def feedback_prompt(guess: int, target: int, left: int) -> str:
    direction = "Higher" if target > guess else "Lower"
    return FEEDBACK.format(direction=direction, direction_lower=direction.lower(), guess=guess, left=left,
                           guesses_word="guess" if left == 1 else "guesses", answer_format=ANSWER_FORMAT)


class Guesser(Player):
    """Programmatic play (CustomResponseModel): binary search on the game master's feedback."""

    def __init__(self, model, max_number: int):
        super().__init__(model, game_role="Guesser")
        self.low, self.high = 1, max_number

    def _custom_response(self, context) -> str:
        content = (context or {}).get("content", "")
        match = re.search(r"is (higher|lower) than (\d+)", content)
        if match is not None:
            guess = int(match.group(2))
            if match.group(1) == "higher":
                self.low = max(self.low, guess + 1)
            else:
                self.high = min(self.high, guess - 1)
        return f"{TAG}: {(self.low + max(self.low, self.high)) // 2}"


class GuessNumber(DialogueGameMaster):

    def __init__(self, game_spec: GameSpec, experiment: dict, player_models: list):
        super().__init__(game_spec, experiment, player_models)
        self.parse_mode = get_parse_mode(experiment)
        self.max_number = int(experiment["max_number"])
        self.max_guesses = int(experiment["max_guesses"])
        self.target: int | None = None
        self.guesses: list[int] = []
        self.success = self.lose = self.aborted = False
        self.consecutive_violations = 0
        self.reprompted = False
        self.request_count = self.parsed_request_count = self.violated_request_count = 0

    def _on_setup(self, **game_instance):
        self.target = int(game_instance["target"])
        if not 1 <= self.target <= self.max_number:
            raise ValueError(f"target {self.target} outside 1..{self.max_number}")
        self.guesser = Guesser(self.player_models[0], self.max_number)
        self.add_player(self.guesser, initial_context=initial_prompt(self.max_number, self.max_guesses))

    def _does_game_proceed(self) -> bool:
        return not (self.success or self.lose or self.aborted)

    def _validate_player_response(self, player: Player, response: str) -> bool:
        self.count_request()
        self.request_count += 1
        guess = parse_integer(response, TAG, 1, self.max_number, self.parse_mode)
        if guess is None:
            self.count_request_violation()
            self.violated_request_count += 1
            self.consecutive_violations += 1
            self.info["parse_ok"] = False
            self.log_to_self("invalid format", f"no guess from 1 to {self.max_number} found")
            if self.consecutive_violations >= MAX_CONSECUTIVE_VIOLATIONS:
                self.aborted = True
                self.reprompted = False
                self.log_to_self("game_result", "ABORT")
            else:
                self.reprompted = True
                self.set_context_for(player, reprompt_text(
                    f"give one number from 1 to {self.max_number}", ANSWER_FORMAT))
            return False
        self.parsed_request_count += 1
        self.consecutive_violations = 0
        self.reprompted = False
        self.info["parse_ok"] = True
        return True

    def _parse_response(self, player: Player, response: str) -> str:
        return str(parse_integer(response, TAG, 1, self.max_number, self.parse_mode))

    def _on_valid_player_response(self, player: Player, parsed_response: str):
        guess = int(parsed_response)
        self.guesses.append(guess)
        left = self.max_guesses - len(self.guesses)
        correct = guess == self.target
        self.log_to_self("guess", {"guess": guess, "correct": correct,
                                   "distance": abs(guess - self.target), "guesses_left": left})
        if correct:
            self.success = True
            self.log_to_self("game_result", "SUCCESS")
        elif left <= 0:
            self.lose = True
            self.log_to_self("game_result", "LOSE")
        else:
            self.set_context_for(player, feedback_prompt(guess, self.target, left))

    def _should_pass_turn(self) -> bool:
        return not self.reprompted

    def _start_next_round(self) -> bool:
        # a round is one guess, together with the reprompt before it (if any)
        return not self.reprompted

    def partial_bench_score(self) -> float:
        """The BENCH_SCORE an unfinished game is worth (a label continuation stopped at its round cap): the
        expected score of one more guess drawn uniformly from the numbers the feedback still allows."""
        if self.success or self.aborted or len(self.guesses) >= self.max_guesses:
            return 100 / len(self.guesses) if self.success else 0.0
        low, high = 1, self.max_number
        for guess in self.guesses:
            if guess < self.target:
                low = max(low, guess + 1)
            elif guess > self.target:
                high = min(high, guess - 1)
        return 100 / (len(self.guesses) + 1) / (high - low + 1)

    def _on_after_game(self):
        log_outcome(self, aborted=self.aborted, success=self.success, lose=self.lose)
        self.log_key(METRIC_REQUEST_COUNT, self.request_count)
        self.log_key(METRIC_REQUEST_COUNT_PARSED, self.parsed_request_count)
        self.log_key(METRIC_REQUEST_COUNT_VIOLATED, self.violated_request_count)
        self.log_key(KEY_TARGET, self.target)
        self.log_key(KEY_GUESSES, list(self.guesses))
        self.log_key(KEY_MAX_GUESSES, self.max_guesses)
        self.log_key(KEY_MAX_NUMBER, self.max_number)


class GuessNumberScorer(GameScorer):

    def score_turns(self, episode_interactions: dict) -> None:
        for turn_idx, turn in enumerate(episode_interactions["turns"]):
            for event in turn:
                action = event["action"]
                if action["type"] == "guess":
                    self.log_turn_score(turn_idx, "Correct Guess", int(action["content"]["correct"]))
                    self.log_turn_score(turn_idx, "Distance", action["content"]["distance"])

    def log_main_score(self, episode_interactions: dict):
        aborted = int(episode_interactions[METRIC_ABORTED])
        success = int(episode_interactions[METRIC_SUCCESS])
        guesses = episode_interactions[KEY_GUESSES]
        self.log_episode_score("Guesses Used", len(guesses))
        if aborted:
            score = np.nan
        elif success:
            score = 100 / len(guesses)
        else:
            score = 0
        self.log_episode_score(BENCH_SCORE, score)


class GuessNumberBenchmark(GameBenchmark):

    def create_game_master(self, experiment: dict, player_models: list) -> DialogueGameMaster:
        return GuessNumber(self.game_spec, experiment, player_models)

    def create_game_scorer(self, experiment: dict, game_instance: dict) -> GameScorer:
        return GuessNumberScorer(self.game_name, experiment, game_instance)
