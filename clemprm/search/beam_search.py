"""Beam search over forked games, ranked by the PRM (search-and-learn's beam search, one game turn per iteration).

A lookahead search (:mod:`clemprm.search`): every beam is a game that answered the answers on its way, and later
perspectives hold the game's replies to answers the search then drops; its figures are no clembench scores.

Each iteration every live beam (a forked game) proposes N answers at its next turn; each distinct answer is
played into a fork of the beam (a child), every child is scored by the PRM on (the beam's perspective, the
answer, the game's reply to it), and per game the ``beam_width`` best live children by aggregated score go on.
Children whose game ended are set aside as finished beams. In the built-in games every LLM turn is a policy turn
(self-play), so one iteration is one turn. The search stops when no beam is live or after ``iterations``; the answer is
the finished beam with the best aggregated score, or, when none finished, the best live beam, recorded as unfinished
(aborted): an unfinished game never wins over a finished one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from clemprm.play.contract import Sampling, Scorer
from clemprm.play.engine import Progress, RolloutEngine
from clemprm.play.episode import Episode
from clemprm.stats import derive_seed
from clemprm.search import SearchCost, choice, score_forks

AGGREGATIONS = ("last", "min", "prod")


@dataclass
class Beam:
    episode: Episode
    step_scores: list[float] = field(default_factory=list)   # the PRM score of each answer the search chose
    choices: list[dict] = field(default_factory=list)   # the choices on the way here (clemprm.records.CHOICE rows)

    def score(self, aggregation: str, log_scale: bool = False) -> float:
        """The beam's score: of its last step (search-and-learn's "last"), its worst step, or the product of the
        steps' probabilities (``prod``; with ``log_scale``, scores that are log-probabilities, their sum: the log of
        that product, so that a likelier path ranks higher). A step that was not scored (a failed generation) makes
        the beam the worst."""
        if not self.step_scores or -math.inf in self.step_scores:
            return -math.inf
        if aggregation == "last":
            return self.step_scores[-1]
        if aggregation == "min":
            return min(self.step_scores)
        return sum(self.step_scores) if log_scale else math.prod(self.step_scores)


def distinct(candidates: list) -> list:
    """The first candidate of every distinct answer text: identical answers give identical games."""
    seen = set()
    return [c for c in candidates if not (c.text in seen or seen.add(c.text))]


def children_of(engine: RolloutEngine, beam: Beam, candidates: list) -> list[Episode]:
    """A fork of ``beam`` per candidate, with that answer played (:meth:`RolloutEngine.play_each`). Each child gets
    its own seed, so beams that share a turn number do not share random streams."""
    turn_idx = len(beam.episode.turns)
    return engine.play_each(beam.episode, candidates,
                            seeds=[derive_seed(beam.episode.seed, "beam", turn_idx, j) for j in range(len(candidates))])


def expand(beam: Beam, candidates: list, children: list[Episode], scores: list[float]) -> list[Beam]:
    """The child beams of ``beam``: each played candidate's game, remembering the choice that made it."""
    turn_idx = len(beam.episode.turns)
    return [Beam(child, beam.step_scores + [score], beam.choices + [choice(turn_idx, candidates, scores, j)])
            for j, (child, score) in enumerate(zip(children, scores))]


def beam_search(engine: RolloutEngine, roots: list[Episode], prm: Scorer, *, n: int, beam_width: int,
                iterations: int, sampling: Sampling, aggregation: str = "last",
                label: str = "beam_search") -> tuple[list[Episode], list[SearchCost]]:
    """Search every root game; return the chosen trajectory per root (under the root's id and seed) and its cost,
    whose ``choices`` are those on the chosen trajectory.

    Each iteration: one ``propose`` call for all live beams of all games and one PRM call for all their
    distinct candidates. A scorer whose scores are log-probabilities says so (``Scorer.log_scale``), and ``prod`` then
    multiplies the probabilities they stand for (:meth:`Beam.score`).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown beam score aggregation {aggregation!r} (known: {', '.join(AGGREGATIONS)})")
    log_scale = prm.log_scale
    costs = [SearchCost() for _ in roots]
    live = [[] if root.done else [Beam(root)] for root in roots]
    finished = [[Beam(root)] if root.done else [] for root in roots]
    progress = Progress(len(roots), label)
    for _ in range(iterations):
        parents = [(r, beam) for r, beams in enumerate(live) for beam in beams]
        if not parents:
            break
        proposals = engine.propose([beam.episode for _, beam in parents], n, sampling)
        unique = [distinct(candidates) for candidates in proposals]   # the PRM scores each distinct child once
        played = [children_of(engine, beam, candidates) for (_, beam), candidates in zip(parents, unique)]
        scores = score_forks(engine, prm, [beam.episode for _, beam in parents], unique, played)
        children: list[list[Beam]] = [[] for _ in roots]
        for (r, parent), candidates, unique_candidates, games, unique_scores in zip(parents, proposals, unique, played,
                                                                                    scores):
            costs[r].add(candidates, unique_scores)
            # a parent whose generation call failed has no candidates and is finished (failed)
            children[r] += expand(parent, unique_candidates, games, unique_scores) if candidates else [parent]
        for r, beams in enumerate(children):
            finished[r] += [beam for beam in beams if beam.episode.done]
            ranked = sorted((beam for beam in beams if not beam.episode.done),
                            key=lambda b: -b.score(aggregation, log_scale))
            live[r] = ranked[:beam_width]
        progress.update(sum(not beams for beams in live), sum(map(len, unique)),
                        sum(candidate.new_tokens for candidates in proposals for candidate in candidates),
                        force=not any(live))
    chosen = []
    for root, cost, done, beams in zip(roots, costs, finished, live):
        best = max(done or beams, key=lambda b: b.score(aggregation, log_scale))
        best.episode.seed = root.seed
        cost.choices = best.choices
        chosen.append(best.episode)
    return chosen, costs
