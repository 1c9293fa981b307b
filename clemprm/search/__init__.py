"""PRM-guided test-time search over forkable games (Hugging Face search-and-learn, for multi-turn dialogue games).

One short module per strategy; greedy play is the engine's plain :meth:`~clemprm.play.engine.RolloutEngine.run`.

* :func:`clemprm.search.best_of_n.best_of_n`: at every policy turn N sampled answers; the one the PRM scores
  highest is played.
* :func:`clemprm.search.beam_search.beam_search`: beams are forked games; every beam's N continuations are
  ranked by the PRM and the best ``beam_width`` survive.

A PRM is any object with ``score(pairs) -> list[float]``, a pair being ``(perspective messages, candidate answer,
the game's reply to it)`` (:class:`clemprm.models.prm.PRMScorer`, :class:`RandomScorer` for the control mode,
:class:`clemprm.models.logprob.LogprobScorer` for the policy's own mean token log-probability, or a scripted scorer
in tests; only the PRM reads the reply). Every search step makes one ``propose`` call (one ``generate`` call per
model), plays each candidate in a fork of its game (:meth:`~clemprm.play.engine.RolloutEngine.play_each`: the
reply, and the game that goes on when the candidate is chosen) and makes one ``score`` call for all games together.
This package holds what the strategies share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


class RandomScorer:
    """The control for a PRM: a uniform random score per pair, a function of ``seed`` and the pair alone, so a
    search with it picks among the very candidates the PRM-guided search saw, at random (no model, no cost)."""

    stats = None

    def __init__(self, seed: int):
        self.seed = seed

    def score(self, pairs: list[tuple[list[dict], str, str]]) -> list[float]:
        return [derive_seed(self.seed, "random scorer", [(m["role"], m["content"]) for m in messages], candidate)
                / 2 ** 63 for messages, candidate, _ in pairs]


def choice(turn_idx: int, candidates: list, scores: list[float], chosen: int) -> dict:
    """A turn where a search chose, as a row of :data:`clemprm.records.CHOICE`: each candidate's text and score, and
    the index of the one played."""
    return {"turn_idx": turn_idx, "candidates": [candidate.text for candidate in candidates], "scores": list(scores),
            "chosen": chosen}


def greedy_cost(episode) -> SearchCost:
    """Plain play: one candidate per turn, no PRM."""
    return SearchCost(policy_tokens=sum(turn["new_tokens"] for turn in episode.turns), nodes=len(episode.turns))


def score_candidates(engine, prm, episodes: list, proposals: list[list], children: list[list]) -> list[list[float]]:
    """The scorer's score of every candidate of every episode, in one ``score`` call: on the perspective of the
    player the episode waits for, the candidate, and the game's reply to it in its fork (``children``, from
    ``engine.play_each``). A failed generation, or a candidate the game failed on, is not scored (-inf): it wins only
    when every one failed."""
    pairs, slots = [], []
    for index, (episode, candidates, played) in enumerate(zip(episodes, proposals, children)):
        for j, (candidate, child) in enumerate(zip(candidates, played)):
            if child.error is None:   # a failed generation failed its fork too (engine.apply)
                pairs.append((engine.waiting(episode)[1], candidate.text, child.turns[-1]["reply"]))
                slots.append((index, j))
    scores = [[-math.inf] * len(candidates) for candidates in proposals]
    for (index, j), score in zip(slots, prm.score(pairs) if pairs else []):
        scores[index][j] = float(score)
    return scores
