"""hanabi: cooperative Hanabi for two players (self-play), with a configurable deck.

Written with clemcore's CURRENT game API. The rules are in :mod:`clemprm.games.hanabi.rules`, the prompts and
answers in :mod:`clemprm.games.hanabi.protocol`. Every turn a player gets one fresh prompt with everything it may
see (the rules, the stacks, tokens, deck size, discard pile, the partner's cards and what the partner was told,
what hints told it about its own cards, the partner's last move): its memory holds the current turn only, so
prompts stay short over long games and every state is a single-turn prompt.

The player answers with its deduction of its own hand and its move. An answer without a valid move (strict: also
without a valid deduction) or with an illegal move (no hint token, discarding with all hint tokens, a hint that
touches no card, an empty slot) is a violation: the player is reprompted once, a second violation in a row aborts.
Every answer is its own round; the game logs the answer's per-turn scores (:mod:`clemprm.games.hanabi.rewards`).

Success: a perfect score (every stack complete); Lose: any other end; Aborted: two violations in a row.
Main Score: the final score as a share of the maximum, 0-100 (0 after the last fuse token), NaN on abort.
"""

from __future__ import annotations

import numpy as np

from clemcore.clemgame import DialogueGameMaster, GameBenchmark, GameScorer, GameSpec, ParseError, Player
from clemcore.clemgame.master import Outcome
from clemcore.clemgame.metrics import BENCH_SCORE, METRIC_ABORTED

from clemprm.games.common import get_parse_mode, handle_violation, log_outcome
from clemprm.games.hanabi.bot import bot_move, ideal_deduction, move_rating, move_values
from clemprm.games.hanabi.protocol import answer_text, deduction_scores, parse_answer, reprompt, state_prompt
from clemprm.games.hanabi.rewards import REWARD_KEYS, ROUND_SCORE_NAMES, TURN_SCORES_EVENT, turn_scores_of
from clemprm.games.hanabi.rules import DeckConfig, HanabiState, Move

ROLES = ("Player A", "Player B")
KEY_SCORE = "Fireworks Score"
KEY_MAX_SCORE = "Max Score"
KEY_MOVES = "Moves"


class HanabiPlayer(Player):
    """One seat. Programmatic play: the rule-based player's move with the deduction the hints determine."""

    def __init__(self, model, seat: int, game: HanabiState):
        super().__init__(model, game_role=ROLES[seat])
        self.seat = seat
        self.game = game

    def forget(self) -> None:
        """Start a new turn with an empty memory (each turn's prompt holds the whole visible state)."""
        self._messages = []

    def _custom_response(self, context) -> str:
        return answer_text(ideal_deduction(self.game, self.seat), bot_move(self.game), self.game.config)


class Hanabi(DialogueGameMaster):

    def __init__(self, game_spec: GameSpec, experiment: dict, player_models: list):
        super().__init__(game_spec, experiment, player_models)
        self.parse_mode = get_parse_mode(experiment)
        self.deck_config = DeckConfig.from_experiment(experiment)

    def _on_setup(self, **game_instance):
        deck = self.deck_config.parse_deck(game_instance["deck"], self.experiment.get("name", "?"))
        self.game = HanabiState(self.deck_config, deck)
        self.moves: list[str] = []
        self.consecutive_violations = 0
        self.reprompted = False
        self.seats = [HanabiPlayer(self.player_models[seat], seat, self.game) for seat in range(len(ROLES))]
        self.add_player(self.seats[0], initial_context=state_prompt(self.game, 0))
        self.add_player(self.seats[1])

    def _parse_response(self, player: Player, response: str) -> Move:
        """The answer's move; logs the answer's turn scores first, then raises ParseError for a violation."""
        game = self.game
        answer = parse_answer(response, self.deck_config, len(game.hands[game.current]), self.parse_mode)
        reason = answer.reason or (game.illegal_reason(answer.move) if answer.move else None)
        deduction, exact = deduction_scores(answer.deduction, game, game.current)
        scores = {"format": int(reason is None), "deduction": deduction, "exact_deduction": exact,
                  "move_rating": 0.0, "move": answer.move.text() if answer.move else None, "move_value": None,
                  "best_value": None, "worst_value": None}
        if reason is None:
            values = move_values(game)
            scores.update(move_rating=move_rating(values, answer.move), move_value=values[answer.move],
                          best_value=max(values.values()), worst_value=min(values.values()))
        self.log_to_self(TURN_SCORES_EVENT, scores)
        if reason is not None:
            raise ParseError(reason, response, "INVALID_ANSWER" if answer.reason else "ILLEGAL_MOVE")
        return answer.move

    def _on_parse_error(self, error: ParseError):
        handle_violation(self, self.current_player, error,
                         reprompt(error.reason, self.deck_config, len(self.game.hands[self.game.current])))

    def _advance_game(self, player: Player, move: Move):
        self.consecutive_violations = 0
        self.reprompted = False
        self.info["parse_ok"] = True
        result = self.game.apply(move)
        self.moves.append(move.text())
        self.log_to_self("move", {"player": player.name, "move": move.text(), "result": result,
                                  "score": self.game.score(), "hint_tokens": self.game.hint_tokens,
                                  "fuse_tokens": self.game.fuse_tokens, "deck": self.game.deck_left})
        if self.game.over:
            perfect = self.game.score() == self.deck_config.max_score
            self.log_to_self("game_result", "SUCCESS" if perfect else "LOSE")
            if perfect:
                self.state.succeed()
            else:
                self.state.failed()
            return
        next_player = self.seats[self.game.current]
        next_player.forget()
        self.set_context_for(next_player, state_prompt(self.game, self.game.current))

    def _should_pass_turn(self) -> bool:
        return not self.reprompted

    def _start_next_round(self) -> bool:
        return True  # every answer is its own round: round scores are per-turn scores

    def partial_bench_score(self) -> float:
        """The BENCH_SCORE of an unfinished game (a label continuation stopped at its round cap): the stacks so far."""
        return 100 * self.game.score() / self.deck_config.max_score

    def _on_after_game(self):
        log_outcome(self, aborted=self.state.outcome is Outcome.ABORTED, success=self.state.outcome is Outcome.SUCCESS)
        self.log_key(KEY_SCORE, self.game.score())
        self.log_key(KEY_MAX_SCORE, self.deck_config.max_score)
        self.log_key(KEY_MOVES, list(self.moves))


class HanabiScorer(GameScorer):

    def compute_round_score(self, round_idx, round_events: list[dict]) -> None:
        for event in round_events:
            if event["action"]["type"] == TURN_SCORES_EVENT:
                for key in REWARD_KEYS:
                    self.log_round_score(round_idx, ROUND_SCORE_NAMES[key], event["action"]["content"][key])

    def compute_episode_scores(self, interactions: dict):
        aborted = bool(interactions[METRIC_ABORTED])
        turns = turn_scores_of(interactions)
        self.log_episode_score(KEY_SCORE, np.nan if aborted else interactions[KEY_SCORE])
        for key in REWARD_KEYS:  # episode means of the per-turn scores (NaN on abort, as clemcore asks)
            mean = float(np.mean([turn[key] for turn in turns])) if turns and not aborted else np.nan
            self.log_episode_score(f"Mean {ROUND_SCORE_NAMES[key]}", mean)
        self.log_episode_score(BENCH_SCORE, np.nan if aborted else
                               100 * interactions[KEY_SCORE] / interactions[KEY_MAX_SCORE])


class HanabiBenchmark(GameBenchmark):

    def create_game_master(self, experiment: dict, player_models: list) -> DialogueGameMaster:
        return Hanabi(self.game_spec, experiment, player_models)

    def create_game_scorer(self, experiment: dict, game_instance: dict) -> GameScorer:
        return HanabiScorer(self.game_name, experiment, game_instance)
