"""PRM-guided test-time search (Hugging Face search-and-learn, for multi-turn dialogue games), in two regimes.

*blind* (the default, the PRM card's and clembench's): the played game is the only game. At each turn the search
samples N candidates, scores each on the player's perspective and the candidate alone, and the game receives the
chosen one only: one answer per turn, as clembench scores a player. *lookahead* (opt-in): every candidate is played
in a fork of the game and the scorer may read what the fork shows (the game's reply, whether it accepted the answer,
the end of the game); the search tries N answers per turn against the game's own verdict, which no real partner
allows, so its figures are no clembench scores and are compared only with lookahead controls (:class:`RuleScorer`).

One short module per strategy; greedy play is the engine's plain :meth:`~clemprm.play.engine.RolloutEngine.run`.

* :func:`clemprm.search.best_of_n.best_of_n`: at every policy turn N sampled answers; the one the scorer ranks
  highest is played (blind, or lookahead over forks).
* :func:`clemprm.search.beam_search.beam_search`: beams are forked games; every beam's N continuations are
  ranked and the best ``beam_width`` survive (lookahead only: every beam's game answered its answers).

A scorer is a :class:`clemprm.play.contract.Scorer`: ``score(pairs) -> list[float]`` over
:class:`~clemprm.play.contract.Pair` (the PRM, the policy's own log-probability, PRIME's implicit PRM, and here
:class:`RandomScorer` and :class:`RuleScorer` for the controls). Every search step makes one ``propose`` call (one
``generate`` call per model) and one ``score`` call for all games together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from clemprm.play.contract import Pair, Scorer
from clemprm.play.engine import rule_score
from clemprm.stats import derive_seed


@dataclass
class SearchCost:
    """What a search spent on one episode, and what it chose on the path it played."""

    policy_tokens: int = 0   # tokens the policy generated, candidates that were never played included
    prm_pairs: int = 0       # (perspective, candidate) pairs the PRM scored
    nodes: int = 0           # candidate answers generated: the nodes of the search tree
    choices: list[dict] = field(default_factory=list)   # rows of clemprm.records.CHOICE, in turn order

    def add(self, candidates: list, scores: list[float]) -> None:
        self.policy_tokens += sum(candidate.new_tokens for candidate in candidates)
        self.prm_pairs += sum(score > -math.inf for score in scores)
        self.nodes += len(candidates)


class RandomScorer(Scorer):
    """The control for a PRM: a uniform random score per candidate slot, a function of ``seed``, the turn (the
    perspective) and the slot alone, never of the text, so a search with it plays one of the N samples at random:
    an answer the policy gave twice is picked twice as often (the policy's own distribution; a score of the text
    would pick uniformly over distinct answers). It picks among the very candidates the PRM-guided search saw (no
    model, no cost)."""

    def __init__(self, seed: int):
        self.seed = seed

    def score(self, pairs: list[Pair]) -> list[float]:
        return [derive_seed(self.seed, "random scorer", [(m["role"], m["content"]) for m in pair.perspective],
                            pair.slot) / 2 ** 63 for pair in pairs]


class RuleScorer(Scorer):
    """The control for a search that reads the fork (lookahead): :func:`clemprm.play.engine.rule_score` of each
    pair, no model. Ties go the way every search breaks them (to the first candidate: a sample as random as any
    other)."""

    def score(self, pairs: list[Pair]) -> list[float]:
        if any(pair.accepted is None for pair in pairs):
            raise ValueError("the rule scorer reads what a fork shows: it scores lookahead pairs only")
        return [rule_score(pair.reply, pair.accepted) for pair in pairs]


def choice(turn_idx: int, candidates: list, scores: list[float], chosen: int) -> dict:
    """A turn where a search chose, as a row of :data:`clemprm.records.CHOICE`: each candidate's text and score, and
    the index of the one played."""
    return {"turn_idx": turn_idx, "candidates": [candidate.text for candidate in candidates], "scores": list(scores),
            "chosen": chosen}


def greedy_cost(episode) -> SearchCost:
    """Plain play: one candidate per turn, no PRM."""
    return SearchCost(policy_tokens=sum(turn["new_tokens"] for turn in episode.turns), nodes=len(episode.turns))


def _score_slots(prm: Scorer, proposals: list[list], pairs: list[Pair],
                 slots: list[tuple[int, int]]) -> list[list[float]]:
    """Every candidate's score, -inf where no pair was made (a failed generation: it wins only when all failed)."""
    scores = [[-math.inf] * len(candidates) for candidates in proposals]
    for (index, j), score in zip(slots, prm.score(pairs) if pairs else []):
        scores[index][j] = float(score)
    return scores


def score_blind(engine, prm: Scorer, episodes: list, proposals: list[list]) -> list[list[float]]:
    """The scorer's score of every candidate of every episode, in one ``score`` call, on the perspective of the
    player the episode waits for and the candidate alone: no game sees any of them."""
    pairs, slots = [], []
    for index, (episode, candidates) in enumerate(zip(episodes, proposals)):
        perspective = engine.waiting(episode)[1] if candidates else None
        for j, candidate in enumerate(candidates):
            if candidate.error is None:
                pairs.append(Pair(perspective, candidate.text, slot=j))
                slots.append((index, j))
    return _score_slots(prm, proposals, pairs, slots)


def score_forks(engine, prm: Scorer, episodes: list, proposals: list[list], children: list[list]) -> list[list[float]]:
    """Lookahead: the scorer's score of every candidate of every episode, in one ``score`` call, with what its fork
    (``children``, from ``engine.play_each``) shows: the game's reply and its verdict on the answer. A candidate the
    game failed on is not scored (-inf)."""
    pairs, slots = [], []
    for index, (episode, candidates, played) in enumerate(zip(episodes, proposals, children)):
        perspective = engine.waiting(episode)[1] if candidates else None
        for j, child in enumerate(played):
            if child.error is None:   # a failed generation failed its fork too (engine.apply)
                turn = child.turns[-1]
                pairs.append(Pair(perspective, candidates[j].text, turn["reply"], turn["parse_ok"], j))
                slots.append((index, j))
    return _score_slots(prm, proposals, pairs, slots)
