"""The rule-based Hanabi player, random play, and the move rating built on the rule-based player.

The rule-based player (:func:`bot_move`) uses only what its seat may know: the partner's cards, the stacks, the
discard pile, the tokens and what hints told each player (public). For its own cards it combines the hints with
card counting: a card may be any identity the hints allow of which a copy is still unseen (not on a stack, not
discarded, not in the partner's hand). Its rules, the first that applies wins:

1. play a card that is certainly playable (every identity it may have is the next rank of its stack);
2. with a hint token: if the partner holds a playable card it does not know to be playable (from the hints alone),
   hint it (the lowest rank first, then the lowest slot): its rank when the partner does not know the rank,
   else its colour;
3. in the last round (the deck is empty) with more than one fuse token left: play the card most likely playable
   when that chance is above 0 (a misplay there costs nothing but a fuse token);
4. with fewer than all hint tokens: discard a card that is certainly useless (every identity it may have is on
   its stack already, or can never be played because all copies of a lower rank are discarded);
5. with fewer than all hint tokens: discard the card no hint touched that is least likely critical (the last copy
   of a card still needed; likelihood by the unseen copies of the identities it may have), the oldest of equals;
   when hints touched every card, the oldest card;
6. give the hint that tells the partner the most (the most of its cards whose possible colours or ranks shrink);
7. play the card most likely to be playable (only when no other move is legal).

It only ever picks legal moves; it never misplays by rule 1 (its knowledge is always true), only by rule 3's
end-game gamble. Ties break by slot and deck order, so it is deterministic. :func:`random_move` plays a uniformly
random legal move.

Move rating: the value of a move is the final score when the rule-based player plays both seats from the state
after it to the end of the game (the instance fixes the deck, so this is deterministic). A move's rating is its
value relative to the other legal moves, ``(value - worst) / (best - worst)``, 1 when all legal moves are worth
the same: 1 = as good as the best move under the rule-based player's continuation, 0 = as bad as the worst.
"""

from __future__ import annotations

import random
from collections import Counter

from clemprm.games.hanabi.rules import Card, HanabiState, HandCard, Move


def unseen_counts(state: HanabiState, viewer: int) -> Counter:
    """Copies of each card identity ``viewer`` cannot see (its own cards and the deck)."""
    unseen = state.config.deck_counts.copy()
    cards = state.config.cards
    for colour, height in state.fireworks.items():
        for rank in range(1, height + 1):
            unseen[cards[colour][rank]] -= 1
    unseen.subtract(state.discards)
    for player, hand in enumerate(state.hands):
        if player != viewer:
            unseen.subtract(hc.card for hc in hand)
    return unseen


def possible_identities(hand_card: HandCard, state: HanabiState, unseen: Counter | None) -> list[Card]:
    """The identities ``hand_card`` may have for its holder: allowed by the hints (and unseen, when given)."""
    config, cards = state.config, state.config.cards
    ranks = hand_card.possible_ranks(config)
    return [cards[c][r] for c in hand_card.possible_colours(config) for r in ranks
            if unseen is None or unseen[cards[c][r]] > 0]


def reachable_ranks(state: HanabiState) -> dict[str, int]:
    """Per colour, the highest rank that can still be played (all copies of the next rank discarded: blocked)."""
    discarded = Counter(state.discards)
    reachable = {}
    for colour, height in state.fireworks.items():
        top = height
        for rank in range(height + 1, state.config.ranks + 1):
            if discarded[Card(colour, rank)] >= state.config.rank_counts[rank - 1]:
                break
            top = rank
        reachable[colour] = top
    return reachable


def _hint_news(state: HanabiState, move: Move) -> int:
    """How many of the partner's cards would learn something from the hint ``move``."""
    news = 0
    for hc in state.hands[state.partner]:
        if move.kind == "hint_colour":
            news += hc.told_colour is None and (hc.card.colour == move.value or move.value not in hc.not_colours)
        else:
            news += hc.told_rank is None and (hc.card.rank == move.value or move.value not in hc.not_ranks)
    return news


def bot_move(state: HanabiState) -> Move:
    """The rule-based player's move for the current player (see the module doc)."""
    me, config = state.current, state.config
    hand = state.hands[me]
    unseen = unseen_counts(state, me)
    identities = [possible_identities(hc, state, unseen) for hc in hand]
    # 1. a certainly playable card
    for slot, cards in enumerate(identities):
        if cards and all(state.playable(card) for card in cards):
            return Move("play", slot)
    # 2. hint a playable card the partner does not know to be playable
    if state.hint_tokens > 0:
        best = None
        for slot, hc in enumerate(state.hands[state.partner]):
            if not state.playable(hc.card):
                continue
            if all(state.playable(card) for card in possible_identities(hc, state, None)):
                continue  # the partner knows already
            key = (hc.card.rank, slot)
            if best is None or key < best[0]:
                hint = Move("hint_rank", hc.card.rank) if hc.told_rank is None else Move("hint_colour", hc.card.colour)
                best = key, hint
        if best is not None:
            return best[1]
    # 3. the last round: gamble on the most probably playable card
    if state.final_turns_left is not None and state.fuse_tokens > 1:
        slot = max(range(len(hand)), key=lambda slot: _chance(identities[slot], unseen, state.playable))
        if _chance(identities[slot], unseen, state.playable) > 0:
            return Move("play", slot)
    can_discard = state.hint_tokens < config.hint_tokens
    if can_discard:
        # 4. a certainly useless card
        reachable = reachable_ranks(state)
        for slot, cards in enumerate(identities):
            if cards and all(card.rank <= state.fireworks[card.colour] or card.rank > reachable[card.colour]
                             for card in cards):
                return Move("discard", slot)
        # 5. the card without hints least likely critical (the oldest of equals), else the oldest card
        untouched = [slot for slot, hc in enumerate(hand) if hc.told_colour is None and hc.told_rank is None]
        discarded = Counter(state.discards)

        def critical(card: Card) -> bool:
            needed = state.fireworks[card.colour] < card.rank <= reachable[card.colour]
            return needed and config.rank_counts[card.rank - 1] - discarded[card] == 1

        if untouched:
            return Move("discard", min(untouched, key=lambda slot: (_chance(identities[slot], unseen, critical), slot)))
        if hand:
            return Move("discard", 0)
    # 6. the most informative hint
    hints = [move for move in state.legal_moves() if move.kind.startswith("hint")]
    if hints:
        return max(hints, key=lambda move: _hint_news(state, move))  # max keeps the first of equals
    # 7. no hint and no discard possible: the most probably playable card
    return Move("play", max(range(len(hand)), key=lambda slot: _chance(identities[slot], unseen, state.playable)))


def _chance(cards: list[Card], unseen: Counter, condition) -> float:
    """The share of the unseen copies of ``cards`` (a card's possible identities) that meet ``condition``."""
    total = sum(unseen[card] for card in cards)
    return sum(unseen[card] for card in cards if condition(card)) / max(1, total)


def random_move(state: HanabiState, rng: random.Random) -> Move:
    """A uniformly random legal move."""
    return rng.choice(state.legal_moves())


def ideal_deduction(state: HanabiState, player: int) -> list[tuple[str | None, int | None]]:
    """What the hints determine about ``player``'s cards (None where they leave more than one value): the
    deduction that scores 1 (exact) at every state."""
    return [hc.knowable(state.config) for hc in state.hands[player]]


def continuation_value(state: HanabiState, move: Move) -> int:
    """The final score when ``move`` is played and then the rule-based player plays both seats to the end."""
    state = state.copy()
    state.apply(move)
    while not state.over:
        state.apply(bot_move(state))
    return state.score()


def move_values(state: HanabiState) -> dict[Move, int]:
    """:func:`continuation_value` of every legal move."""
    return {move: continuation_value(state, move) for move in state.legal_moves()}


def move_rating(values: dict[Move, int], move: Move) -> float:
    """``move``'s value between the worst (0) and the best (1) legal move's; 1 when all are worth the same."""
    best, worst = max(values.values()), min(values.values())
    return 1.0 if best == worst else (values[move] - worst) / (best - worst)
