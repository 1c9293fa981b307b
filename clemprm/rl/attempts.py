"""SCoRe's attempts for dialogue games: attempt 2 is a new episode of the same instance that starts from attempt 1.

Attempt 1 is an episode as usual through the rollout engine. Attempt 2 (:func:`start_second_attempt`) is a new episode
of the same instance, with the same game-side random draws (its game seed is attempt 1's), whose first prompt starts
with :func:`attempt_prefix`: attempt 1's transcript (each of the player's answers and the game's reply to it), its
outcome, and the self-correction instruction (``score.instruction``). Then it plays normally: the game never sees the
prefix, the model sees it at the start of its first user message on every turn (the engine's
:attr:`clemprm.play.episode.Episode.context_prefix`), and the turn records hold it (the perspective exactly as the
model got it).

Why a new episode rather than a continuation of attempt 1's dialogue (the paper's ``x, y1, instruction -> y2``, which
is one answer each): a game episode ends when it is won, lost or aborted, and a finished clemcore game takes no
further answers. Replaying the instance from its start with attempt 1 in view is the multi-turn counterpart: y2 is a
whole second episode, judged by the game exactly as y1 was.

The transcript leaves out the game's first prompt (attempt 2's own first prompt repeats it right after the prefix) and
the game's last message (after the final answer the game is over; the outcome line says how it ended). Only
single-player games (checked at parse time, :func:`clemprm.checks.game_inputs.single_player_problems`): in
self-play, whose attempt would the transcript be, and who would correct it?
"""

from __future__ import annotations

import math

from clemprm.play.catalog import Instance
from clemprm.play.engine import RolloutEngine
from clemprm.play.episode import Episode

TRANSCRIPT_HEADER = "Your previous attempt at this game went as follows."
ANSWER_LABEL = "Your answer"
GAME_LABEL = "Game"


def replies(turns: list[dict]) -> list[str]:
    """Per answer but the last, the game's reply to it: the user messages after the last assistant message of the
    next turn's perspective (a reprompt, feedback, or for games that prompt afresh each turn the whole new prompt)."""
    texts = []
    for turn in turns[1:]:
        messages = turn["messages"]
        last_answer = max((i for i, message in enumerate(messages) if message["role"] == "assistant"), default=-1)
        texts.append("\n".join(message["content"] for message in messages[last_answer + 1:]
                               if message["role"] == "user"))
    return texts


def outcome_text(row: dict) -> str:
    """How an attempt ended, from its episode record."""
    if row["aborted"]:
        return "aborted: the game ended early because an answer broke its rules or format"
    score = row["bench_score"]
    scored = "" if score is None or math.isnan(score) else f" (score {score:.0f} of 100)"
    return f"you won{scored}" if row["success"] else f"you lost{scored}"


def attempt_transcript(row: dict) -> str:
    """Attempt 1's answers and the game's reply to each, one labelled block each, in order."""
    turns = row["turns"]
    lines = []
    for turn, reply in zip(turns, replies(turns) + [None]):
        lines.append(f"{ANSWER_LABEL}: {turn['response']}")
        if reply:
            lines.append(f"{GAME_LABEL}: {reply}")
    return "\n".join(lines) if lines else "(no answer was given)"


def attempt_prefix(row: dict, instruction: str) -> str:
    """What attempt 2's first prompt starts with: attempt 1's transcript, its outcome, the instruction."""
    return (f"{TRANSCRIPT_HEADER}\n{attempt_transcript(row)}\nOutcome of that attempt: {outcome_text(row)}.\n"
            f"{instruction}\n\n")


def start_second_attempt(engine: RolloutEngine, instance: Instance, models: list, first: dict, episode_id: str,
                         seed: int, instruction: str) -> Episode:
    """Attempt 2 of the instance whose attempt 1 is the record ``first``: a new episode with attempt 1's game seed
    (the same game-side draws), sampled with ``seed``, its perspectives prefixed by :func:`attempt_prefix`."""
    episode = engine.start(instance, models, episode_id, seed, game_seed=first["seed"])
    episode.context_prefix = attempt_prefix(first, instruction)
    return episode


def score_games_config(games: dict, score_games: list[str]) -> dict:
    """The ``games`` section restricted to ``score.games`` (the catalog SCoRe trains and evaluates on)."""
    return {**games, "builtin": [name for name in games["builtin"] if name in score_games],
            "clembench_games": [name for name in games.get("clembench_games") or [] if name in score_games],
            "instances_files": {name: file for name, file in (games.get("instances_files") or {}).items()
                                if name in score_games}}
