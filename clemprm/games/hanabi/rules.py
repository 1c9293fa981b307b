"""Hanabi's rules as implemented here (pure Python, no clemcore): the deck, the game state, moves and what hints
told each player about its own cards. The game master, the rule-based player and the scores all use this module.

Rules (two players, cooperative):

* The deck holds, per colour, ``rank_counts[r - 1]`` copies of rank ``r`` (standard: 3, 2, 2, 2, 1 of ranks 1-5).
  An instance fixes the deck's order; each player is dealt ``hand_size`` cards, one at a time in turn.
* A player sees the partner's cards, not its own. On its turn it makes one move:

  - ``play N``: its card in slot N goes on the firework (stack) of its colour if its rank is the stack's next one;
    otherwise it is a misplay: the card is discarded and a fuse token is lost. Completing a stack (its top rank)
    gives back a hint token (when fewer than the maximum are left);
  - ``discard N``: the card goes to the discard pile and a hint token comes back; not allowed while all hint
    tokens are there;
  - ``hint COLOUR`` / ``hint RANK``: costs a hint token (not allowed without one) and tells the partner which of its
    cards have that colour or rank; the hint must touch at least one card. The touched cards learn the value; the
    others learn that they do not have it (so hints carry negative information too).

  After a play or a discard the player draws the top card of the deck into its last slot (slots are numbered
  from 1, oldest first; the others move up).
* The game ends when every stack is complete (perfect score), when the last fuse token is lost (score 0), or when
  the deck is empty and every player has had one more turn after the last card was drawn. The score is the sum
  of the stacks' heights (0 after the last fuse).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

PLAYERS = 2


class HanabiConfigError(ValueError):
    """A deck or instance that does not describe a playable Hanabi game; names the experiment key."""


class Card(NamedTuple):
    colour: str
    rank: int


@dataclass(frozen=True)
class DeckConfig:
    """One experiment's deck and tokens (``colours``, ``ranks``, ``rank_counts``, ``hand_size``, ``hint_tokens``,
    ``fuse_tokens``)."""

    colours: tuple[str, ...]
    ranks: int
    rank_counts: tuple[int, ...]
    hand_size: int
    hint_tokens: int
    fuse_tokens: int

    KEYS = ("colours", "ranks", "rank_counts", "hand_size", "hint_tokens", "fuse_tokens")

    @classmethod
    def from_experiment(cls, experiment: dict) -> "DeckConfig":
        name = experiment.get("name", "?")
        missing = [key for key in cls.KEYS if key not in experiment]
        if missing:
            raise HanabiConfigError(f"hanabi experiment {name!r} lacks keys {missing}")
        config = cls(tuple(str(c).lower() for c in experiment["colours"]), int(experiment["ranks"]),
                     tuple(int(n) for n in experiment["rank_counts"]), int(experiment["hand_size"]),
                     int(experiment["hint_tokens"]), int(experiment["fuse_tokens"]))
        config.validate(name)
        return config

    def validate(self, name: str) -> None:
        def fail(key, why):
            raise HanabiConfigError(f"hanabi experiment {name!r}: {key} {why}")

        if not self.colours or len(set(self.colours)) != len(self.colours):
            fail("colours", f"must be distinct names, got {list(self.colours)}")
        if any(not c.isalpha() for c in self.colours) or len({c[0] for c in self.colours}) != len(self.colours):
            fail("colours", f"must be words with distinct first letters, got {list(self.colours)}")
        if not 1 <= self.ranks <= 9:
            fail("ranks", f"must be 1-9 (one digit per card), got {self.ranks}")
        if len(self.rank_counts) != self.ranks or min(self.rank_counts) < 1:
            fail("rank_counts", f"must give one count >= 1 per rank (ranks {self.ranks}), got {list(self.rank_counts)}")
        if self.hand_size < 1 or PLAYERS * self.hand_size > self.deck_size:
            fail("hand_size", f"must be >= 1 and deal at most the deck ({self.deck_size} cards), got {self.hand_size}")
        if self.hint_tokens < 1 or self.fuse_tokens < 1:
            fail("hint_tokens/fuse_tokens", f"must be >= 1, got {self.hint_tokens}/{self.fuse_tokens}")

    @property
    def deck_size(self) -> int:
        return len(self.colours) * sum(self.rank_counts)

    @property
    def max_score(self) -> int:
        return len(self.colours) * self.ranks

    def letter(self, colour: str) -> str:
        return colour[0].upper()

    def colour_of_letter(self, letter: str) -> str | None:
        return next((c for c in self.colours if c[0] == letter.lower()), None)

    def card_text(self, card: Card) -> str:
        return f"{self.letter(card.colour)}{card.rank}"

    def parse_card(self, text: str) -> Card:
        colour = self.colour_of_letter(text[:1]) if len(text) == 2 else None
        if colour is None or not text[1].isdigit() or not 1 <= int(text[1]) <= self.ranks:
            raise HanabiConfigError(f"{text!r} is not a card of this deck ({', '.join(self.colours)}; "
                                    f"ranks 1-{self.ranks})")
        return Card(colour, int(text[1]))

    def full_deck(self) -> list[Card]:
        """Every card of the deck, sorted by colour then rank."""
        return [Card(c, r) for c in self.colours for r in range(1, self.ranks + 1)
                for _ in range(self.rank_counts[r - 1])]

    @cached_property
    def deck_counts(self) -> Counter:
        """Copies of each card identity in the deck."""
        return Counter(self.full_deck())

    @cached_property
    def cards(self) -> dict[str, dict[int, Card]]:
        """``cards[colour][rank]``: one shared Card per identity (the rule-based player looks them up often)."""
        return {c: {r: Card(c, r) for r in range(1, self.ranks + 1)} for c in self.colours}

    def parse_deck(self, text: str, name: str = "?") -> list[Card]:
        """An instance's deck order (``"R1 Y3 ..."``); it must be a permutation of :meth:`full_deck`."""
        try:
            cards = [self.parse_card(token) for token in text.split()]
        except HanabiConfigError as error:
            raise HanabiConfigError(f"hanabi instance of {name!r}: deck: {error}") from None
        if Counter(cards) != self.deck_counts:
            raise HanabiConfigError(f"hanabi instance of {name!r}: the deck is not a permutation of the "
                                    f"experiment's {self.deck_size} cards")
        return cards


class Move(NamedTuple):
    """``kind`` play | discard (``value``: slot index from 0) or hint_colour (a colour) | hint_rank (a rank)."""
    kind: str
    value: object

    def text(self) -> str:
        if self.kind in ("play", "discard"):
            return f"{self.kind} {self.value + 1}"
        return f"hint {self.value}"


class HandCard(NamedTuple):
    """A card in a hand with what hints told its holder: a told colour / rank, and the values hints ruled out."""
    card: Card
    told_colour: str | None = None
    told_rank: int | None = None
    not_colours: frozenset = frozenset()
    not_ranks: frozenset = frozenset()

    def possible_colours(self, config: DeckConfig) -> list[str]:
        if self.told_colour is not None:
            return [self.told_colour]
        return [c for c in config.colours if c not in self.not_colours]

    def possible_ranks(self, config: DeckConfig) -> list[int]:
        if self.told_rank is not None:
            return [self.told_rank]
        return [r for r in range(1, config.ranks + 1) if r not in self.not_ranks]

    def knowable(self, config: DeckConfig) -> tuple[str | None, int | None]:
        """(colour, rank) as far as the hints determine them (None where more than one value remains)."""
        colours, ranks = self.possible_colours(config), self.possible_ranks(config)
        return (colours[0] if len(colours) == 1 else None), (ranks[0] if len(ranks) == 1 else None)


class HanabiState:
    """A game in progress. ``apply`` plays a legal move; ``copy`` is cheap (hands hold immutable cards)."""

    def __init__(self, config: DeckConfig, deck: list[Card]):
        self.config = config
        self.deck = list(deck)
        self.next_card = 0
        self.hands: list[list[HandCard]] = [[] for _ in range(PLAYERS)]
        for index in range(PLAYERS * config.hand_size):
            self.hands[index % PLAYERS].append(HandCard(self.deck[index]))
        self.next_card = PLAYERS * config.hand_size
        self.fireworks = {colour: 0 for colour in config.colours}
        self.discards: list[Card] = []
        self.hint_tokens = config.hint_tokens
        self.fuse_tokens = config.fuse_tokens
        self.current = 0
        self.turns = 0
        self.final_turns_left: int | None = PLAYERS if self.deck_left == 0 else None
        self.last_move: list[str | None] = [None] * PLAYERS  # each player's last move, as told to the partner

    def copy(self) -> "HanabiState":
        clone = HanabiState.__new__(HanabiState)
        clone.__dict__.update(self.__dict__)
        clone.hands = [list(hand) for hand in self.hands]
        clone.fireworks = dict(self.fireworks)
        clone.discards = list(self.discards)
        clone.last_move = list(self.last_move)
        return clone  # the deck list is shared: it is never changed

    @property
    def deck_left(self) -> int:
        return len(self.deck) - self.next_card

    @property
    def partner(self) -> int:
        return (self.current + 1) % PLAYERS

    @property
    def over(self) -> bool:
        return (self.fuse_tokens == 0 or self.final_turns_left == 0
                or sum(self.fireworks.values()) == self.config.max_score)

    def score(self) -> int:
        return 0 if self.fuse_tokens == 0 else sum(self.fireworks.values())

    def playable(self, card: Card) -> bool:
        return self.fireworks[card.colour] + 1 == card.rank

    def illegal_reason(self, move: Move) -> str | None:
        """Why ``move`` breaks a rule now (None when it is legal)."""
        hand = self.hands[self.current]
        if move.kind in ("play", "discard"):
            if not 0 <= move.value < len(hand):
                return f"you have no card in slot {move.value + 1} (slots 1 to {len(hand)})"
            if move.kind == "discard" and self.hint_tokens == self.config.hint_tokens:
                return f"all {self.config.hint_tokens} hint tokens are there: you cannot discard"
            return None
        if self.hint_tokens == 0:
            return "you have no hint token left: play or discard"
        attribute = "colour" if move.kind == "hint_colour" else "rank"
        if not any(getattr(hc.card, attribute) == move.value for hc in self.hands[self.partner]):
            return f"your partner has no {move.value} card: a hint must touch at least one card"
        return None

    def legal_moves(self) -> list[Move]:
        """Every legal move: plays, discards, colour hints, rank hints (in that order)."""
        hand = self.hands[self.current]
        moves = [Move("play", i) for i in range(len(hand))]
        if self.hint_tokens < self.config.hint_tokens:
            moves += [Move("discard", i) for i in range(len(hand))]
        if self.hint_tokens > 0:
            partner_cards = [hc.card for hc in self.hands[self.partner]]
            moves += [Move("hint_colour", c) for c in self.config.colours
                      if any(card.colour == c for card in partner_cards)]
            moves += [Move("hint_rank", r) for r in range(1, self.config.ranks + 1)
                      if any(card.rank == r for card in partner_cards)]
        return moves

    def apply(self, move: Move) -> str:
        """Play a legal move for the current player, pass the turn; returns what happened (for the prompts)."""
        reason = self.illegal_reason(move)
        if reason is not None:
            raise ValueError(f"illegal move {move.text()}: {reason}")
        was_final = self.final_turns_left is not None
        hand = self.hands[self.current]
        text = self.config.card_text
        if move.kind == "play":
            card = hand.pop(move.value).card
            if self.playable(card):
                self.fireworks[card.colour] = card.rank
                if card.rank == self.config.ranks and self.hint_tokens < self.config.hint_tokens:
                    self.hint_tokens += 1
                what = f"played {text(card)} from slot {move.value + 1}"
            else:
                self.fuse_tokens -= 1
                self.discards.append(card)
                what = f"misplayed {text(card)} from slot {move.value + 1} (a fuse token was lost)"
            self._draw(hand)
        elif move.kind == "discard":
            card = hand.pop(move.value).card
            self.discards.append(card)
            self.hint_tokens += 1
            what = f"discarded {text(card)} from slot {move.value + 1}"
            self._draw(hand)
        else:
            self.hint_tokens -= 1
            what = self._hint(move)
        if was_final:
            self.final_turns_left -= 1
        elif self.deck_left == 0:
            self.final_turns_left = PLAYERS  # this move drew the last card: everyone plays once more
        self.last_move[self.current] = what
        self.current = self.partner
        self.turns += 1
        return what

    def _draw(self, hand: list[HandCard]) -> None:
        if self.deck_left > 0:
            hand.append(HandCard(self.deck[self.next_card]))
            self.next_card += 1

    def _hint(self, move: Move) -> str:
        partner_hand = self.hands[self.partner]
        touched = []
        for slot, hc in enumerate(partner_hand):
            if move.kind == "hint_colour":
                hit = hc.card.colour == move.value
                hc = (hc._replace(told_colour=move.value) if hit
                      else hc._replace(not_colours=hc.not_colours | {move.value}))
            else:
                hit = hc.card.rank == move.value
                hc = hc._replace(told_rank=move.value) if hit else hc._replace(not_ranks=hc.not_ranks | {move.value})
            partner_hand[slot] = hc
            if hit:
                touched.append(str(slot + 1))
        slots = ("slot " if len(touched) == 1 else "slots ") + ", ".join(touched)
        return f"hinted {move.value}: your {slots}"  # shown to the partner, whose slots they are
