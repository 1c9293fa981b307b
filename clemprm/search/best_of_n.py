"""Best-of-N: at every policy turn, N sampled answers; the one the scorer ranks highest is played.

Blind (the default): the candidates are scored on the perspective and the candidate alone, and only the chosen one
reaches the game. Lookahead: each candidate is played in a fork of the game first and the scorer reads what the fork
shows (:func:`clemprm.search.score_forks`); the chosen fork goes on.
"""

from __future__ import annotations

from clemprm.play.contract import Sampling, Scorer
from clemprm.play.engine import Progress, RolloutEngine
from clemprm.play.episode import Episode
from clemprm.search import SearchCost, choice, score_blind, score_forks


def best_of_n(engine: RolloutEngine, episodes: list[Episode], prm: Scorer, n: int, sampling: Sampling,
              label: str = "best_of_n", lookahead: bool = False) -> list[SearchCost]:
    """Play ``episodes`` to the end, each turn choosing among ``n`` candidates by score; return each one's cost.
    With ``lookahead`` an episode of the list is replaced by the fork its chosen candidate was played in (same id
    and seed).

    Each step: one ``propose`` call for all waiting episodes of all games and one scorer call for all their
    candidates. Ties go to the first candidate, which is the answer plain sampling would have played. Each turn's
    candidates, their scores and the pick go into the episode's cost (``choices``).
    """
    costs = [SearchCost() for _ in episodes]
    progress = Progress(len(episodes), label)
    live = [index for index, episode in enumerate(episodes) if not episode.done]
    while live:
        waiting = [episodes[index] for index in live]
        proposals = engine.propose(waiting, n, sampling)
        if lookahead:
            children = [engine.play_each(episode, candidates) for episode, candidates in zip(waiting, proposals)]
            scores = score_forks(engine, prm, waiting, proposals, children)
        else:
            children, scores = None, score_blind(engine, prm, waiting, proposals)
        turns = tokens = 0
        for slot, (index, episode, candidates, candidate_scores) in enumerate(zip(live, waiting, proposals, scores)):
            costs[index].add(candidates, candidate_scores)
            tokens += sum(candidate.new_tokens for candidate in candidates)
            if candidates:
                turns += 1
                best = max(range(len(candidates)), key=candidate_scores.__getitem__)
                costs[index].choices.append(choice(len(episode.turns), candidates, candidate_scores, best))
                if lookahead:
                    episodes[index] = children[slot][best]
                else:
                    engine.apply(episode, candidates[best])   # the one answer the game sees this turn
        live = [index for index in live if not episodes[index].done]
        progress.update(len(episodes) - len(live), turns, tokens, force=not live)
    return costs
