"""Hanabi's text protocol (no clemcore): the prompt a player sees each turn, the answer format and its parsing,
and the deduction score.

Answer format (two lines)::

    DEDUCTION: R? ?2 ??
    MOVE: hint red

``DEDUCTION`` gives one entry per card of the player's own hand, slot 1 first: a colour letter or ``?``, then a
rank or ``?`` (``R3`` red 3, ``R?`` red of unknown rank, ``?2``, ``??``). ``MOVE`` is ``play N``, ``discard N``
(N a slot), ``hint COLOUR`` or ``hint RANK`` (the partner is the only one to hint).

Parse modes (as the other built-in games, :mod:`clemprm.games.common`):

* ``strict``: both lines are required; the first line starting with ``DEDUCTION:`` must hold exactly one valid entry
  per card and nothing else; the first line starting with ``MOVE:`` must start with a valid move;
* ``lenient``: a valid tagged move wins, else the first valid move phrase anywhere in the answer (``play 2``,
  ``discard the card in slot 1``, ``hint red``, ``hint rank 3``); the deduction is optional: the valid entries of
  the first ``DEDUCTION:`` line, in order (missing entries count as wrong).

A move is valid when its slot, colour or rank exists; whether it is legal now (tokens, a hint touching a card)
is the game's check. An answer without a valid move (or, strict, without a valid deduction) is a violation.

Deduction score (per turn, in [0, 1]): each card is scored against its truth on what is knowable from the hints
the player received (told values and the values hints ruled out; card counting is not required) and on what the
player claims:

* an attribute (colour or rank) the hints determine is scored: 1 when the entry names the true value, 0 otherwise
  (``?`` included: it is knowable);
* an attribute the hints leave open is scored only when the entry names a value (a claim): 1 when it is true (a
  correct card-counting deduction is not punished), 0 when not (a guess); ``?`` there is not scored.

A card's credit is the mean of its scored attributes (a card with none is left out); a card without an entry
scores 0. The deduction score is the mean over the hand's scored cards: 1 when nothing is knowable and nothing
is claimed. No deduction at all scores 0. Exact deduction is 1 when the deduction gives every card and every scored
attribute is right. The ideal answer names exactly what the hints determine and ``?`` elsewhere; answering ``?``
everywhere scores 0 as soon as the hints determine anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clemprm.games.common import as_text, first_tagged_value
from clemprm.games.hanabi.rules import DeckConfig, HanabiState, Move

DEDUCTION_TAG = "DEDUCTION"
MOVE_TAG = "MOVE"
ANSWER_FORMAT = (f"Answer with two lines: {DEDUCTION_TAG}, what you know of your cards, slot 1 first (colour letter "
                 f"or ?, then rank or ?), and {MOVE_TAG}, your move.")

_DECORATION = " \t*_`'\"<>()[]{}.:,;"
_MOVE = re.compile(
    r"(?<![\w-])(?:(?P<kind>play|discard)(?:s|ing|ed)?\s+(?:(?:the|my|your|card|cards|in|at|from|slot|position|"
    r"number|no\.?|#)\s*)*(?P<slot>\d+)(?!\w)"
    r"|(?:hint|clue|tell)(?:s|ing|ed)?\s+(?:(?:the|my|your|partner|about|colou?r|rank|number)\s+)*"
    r"(?P<value>[a-z]+|\d+)(?![\w-]))", re.IGNORECASE)
_ENTRY = re.compile(r"(?<![\w?])([a-z?])([0-9?])(?![\w?])", re.IGNORECASE)


@dataclass(frozen=True)
class Answer:
    """A parsed answer: the move (None when none was found), the deduction entries (None when no deduction line),
    and why the answer is a violation (None when it is not)."""
    move: Move | None
    deduction: tuple[tuple[str | None, int | None], ...] | None
    reason: str | None


def _move_of(match: re.Match, config: DeckConfig, hand_len: int) -> Move | None:
    if match.group("kind"):
        slot = int(match.group("slot")) if len(match.group("slot")) <= 2 else 0
        return Move(match.group("kind").lower(), slot - 1) if 1 <= slot <= hand_len else None
    value = match.group("value").lower()
    if value.isdigit():
        return Move("hint_rank", int(value)) if len(value) == 1 and 1 <= int(value) <= config.ranks else None
    return Move("hint_colour", value) if value in config.colours else None


def parse_move(text, config: DeckConfig, hand_len: int, mode: str) -> Move | None:
    """The answer's move (see the module doc for the modes), or None."""
    text = as_text(text)
    value = first_tagged_value(text, MOVE_TAG)
    if value is not None:
        match = _MOVE.match(value.lstrip(_DECORATION))
        move = _move_of(match, config, hand_len) if match else None
        if move is not None:
            return move
    if mode == "strict":
        return None
    for match in _MOVE.finditer(text):
        move = _move_of(match, config, hand_len)
        if move is not None:
            return move
    return None


def _entry(letter: str, digit: str, config: DeckConfig) -> tuple[str | None, int | None] | None:
    colour = None if letter == "?" else config.colour_of_letter(letter)
    rank = None if digit == "?" else int(digit)
    if (letter != "?" and colour is None) or (rank is not None and not 1 <= rank <= config.ranks):
        return None
    return colour, rank


def parse_deduction(text, config: DeckConfig, hand_len: int, mode: str):
    """The deduction entries (a tuple of (colour | None, rank | None)), or None when there is no valid one."""
    value = first_tagged_value(as_text(text), DEDUCTION_TAG)
    if value is None:
        return None
    if mode == "strict":
        tokens = [token for token in re.split(r"[\s,;|]+", value.strip(_DECORATION)) if token]
        entries = [_entry(t[0], t[1], config) if len(t) == 2 else None for t in tokens]
        if len(entries) != hand_len or any(entry is None for entry in entries):
            return None
        return tuple(entries)
    entries = [_entry(m.group(1), m.group(2), config) for m in _ENTRY.finditer(value)]
    return tuple(entry for entry in entries if entry is not None)[:hand_len]


def parse_answer(text, config: DeckConfig, hand_len: int, mode: str) -> Answer:
    move = parse_move(text, config, hand_len, mode)
    deduction = parse_deduction(text, config, hand_len, mode)
    reason = None
    if move is None:
        reason = (f"give a move: play N or discard N (N from 1 to {hand_len}), hint a colour "
                  f"({', '.join(config.colours)}) or hint a rank (1 to {config.ranks})")
        if mode == "strict":
            reason = f"start a line with {MOVE_TAG}: and {reason}"
    elif deduction is None and mode == "strict":
        reason = (f"start a line with {DEDUCTION_TAG}: and give {hand_len} cards, each a colour letter or ?, "
                  f"then a rank or ?")
    return Answer(move, deduction, reason)


def deduction_credit(entry, hand_card, config: DeckConfig) -> float | None:
    """One card's deduction credit (see the module doc); None when the card has no scored attribute."""
    if entry is None:
        return 0.0
    known_colour, known_rank = hand_card.knowable(config)
    credits = [float(stated == true) for stated, known, true in
               ((entry[0], known_colour, hand_card.card.colour), (entry[1], known_rank, hand_card.card.rank))
               if known is not None or stated is not None]
    return sum(credits) / len(credits) if credits else None


def deduction_scores(deduction, state: HanabiState, player: int) -> tuple[float, int]:
    """``(deduction score, exact deduction)`` of a deduction of ``player``'s hand (None: no deduction, 0)."""
    if deduction is None:
        return 0.0, 0
    hand = state.hands[player]
    entries = list(deduction) + [None] * (len(hand) - len(deduction))
    credits = [credit for entry, hc in zip(entries, hand)
               if (credit := deduction_credit(entry, hc, state.config)) is not None]
    score = sum(credits) / len(credits) if credits else 1.0
    return score, int(all(credit == 1.0 for credit in credits))


def deduction_text(entries, config: DeckConfig) -> str:
    return " ".join(f"{'?' if c is None else config.letter(c)}{'?' if r is None else r}" for c, r in entries)


def answer_text(deduction, move: Move, config: DeckConfig) -> str:
    """An answer in the strict format (what programmatic players write)."""
    return f"{DEDUCTION_TAG}: {deduction_text(deduction, config)}\n{MOVE_TAG}: {move.text()}"


# ---------------------------------------------------------------------------------------------------------
# prompts

RULES = (
    "Hanabi, a card game with a partner. Colours: {colours}; ranks 1 to {ranks}. Build each colour's stack from 1 "
    "to {ranks} in order. You see your partner's cards, not yours.\n"
    "Moves: play N (your card in slot N goes on its stack; a wrong card costs a fuse token), discard N (gives a "
    "hint token back; not with all {hints}), hint COLOUR or hint RANK (costs a hint token; tells your partner all "
    "their cards of it, at least one). You draw into your last slot."
)


def _knowledge(hc, config: DeckConfig, negatives: bool) -> str:
    """What hints told about a card: ``red, rank 2`` (and, with ``negatives``, ``not yellow, not rank 1``)."""
    told = [hc.told_colour] if hc.told_colour else []
    told += [f"rank {hc.told_rank}"] if hc.told_rank else []
    if negatives:
        told += [f"not {c}" for c in config.colours if c in hc.not_colours and not hc.told_colour]
        told += [f"not rank {r}" for r in range(1, config.ranks + 1) if r in hc.not_ranks and not hc.told_rank]
    return ", ".join(told)


def state_prompt(state: HanabiState, player: int) -> str:
    """What ``player`` sees at its turn: the rules, the table, the partner's cards, its hints, the answer format."""
    config = state.config
    partner = (player + 1) % len(state.hands)
    stacks = " ".join(f"{config.letter(c)}{h}" for c, h in state.fireworks.items())
    discards = " ".join(config.card_text(card) for card in sorted(state.discards)) or "none"
    partner_cards = []
    for slot, hc in enumerate(state.hands[partner]):
        told = _knowledge(hc, config, negatives=False)
        partner_cards.append(f"slot {slot + 1}: {config.card_text(hc.card)}" + (f" (told: {told})" if told else ""))
    own = [f"slot {slot + 1}: {_knowledge(hc, config, negatives=True) or 'no hints'}"
           for slot, hc in enumerate(state.hands[player])]
    lines = [
        RULES.format(colours=", ".join(f"{c} {config.letter(c)}" for c in config.colours), ranks=config.ranks,
                     hints=config.hint_tokens),
        f"Stacks: {stacks}. Hint tokens: {state.hint_tokens} of {config.hint_tokens}. Fuse tokens: "
        f"{state.fuse_tokens}. Deck: {state.deck_left} cards." + (" Last round!" if state.final_turns_left else ""),
        f"Discarded: {discards}.",
        f"Partner's cards: {'; '.join(partner_cards) or 'none'}.",
        f"Your cards (what hints told you): {'; '.join(own)}.",
    ]
    if state.last_move[partner]:
        lines.append(f"Partner's last move: {state.last_move[partner]}.")
    lines.append(answer_instructions(config, len(state.hands[player])))
    return "\n".join(lines)


def answer_instructions(config: DeckConfig, hand_len: int) -> str:
    """The answer format with an example answer for a hand of ``hand_len`` cards (SmolLM2 rarely keeps a format
    it is not shown)."""
    entries = ["??", f"{config.letter(config.colours[0])}?", "?1"]
    example = " ".join(entries[slot % len(entries)] for slot in range(hand_len))
    return f"{ANSWER_FORMAT} For example:\n{DEDUCTION_TAG}: {example}\n{MOVE_TAG}: play 1"


def reprompt(reason: str, config: DeckConfig, hand_len: int) -> str:
    """The one reprompt after a violation: why, and the format again."""
    return f"Invalid answer: {reason}. Try again. {answer_instructions(config, hand_len)}"
