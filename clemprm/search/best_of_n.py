"""Best-of-N: at every policy turn, N sampled answers; the one the PRM scores highest is played."""

from __future__ import annotations

from clemprm.play.engine import Episode, Progress, RolloutEngine, Sampling
from clemprm.search import SearchCost, choice, score_candidates


def best_of_n(engine: RolloutEngine, episodes: list[Episode], prm, n: int, sampling: Sampling,
              label: str = "best_of_n") -> list[SearchCost]:
    """Play ``episodes`` to the end, each turn choosing among ``n`` candidates by PRM score; return each one's cost.
    An episode of the list is replaced by the fork its chosen candidate was played in (same id and seed).

    Each step: one ``propose`` call for all waiting episodes of all games, every candidate played in a fork of its
    game (the PRM reads the game's reply), and one PRM call for all their candidates. Ties go to the first
    candidate, which is the answer plain sampling would have played. Each turn's candidates, their scores and the
    pick go into the episode's cost (``choices``).
    """
    costs = [SearchCost() for _ in episodes]
    progress = Progress(len(episodes), label)
    live = [index for index, episode in enumerate(episodes) if not episode.done]
    while live:
        waiting = [episodes[index] for index in live]
        proposals = engine.propose(waiting, n, sampling)
        children = [engine.play_each(episode, candidates) for episode, candidates in zip(waiting, proposals)]
        scores = score_candidates(engine, prm, waiting, proposals, children)
        turns = tokens = 0
        for index, episode, candidates, played, candidate_scores in zip(live, waiting, proposals, children, scores):
            costs[index].add(candidates, candidate_scores)
            tokens += sum(candidate.new_tokens for candidate in candidates)
            if candidates:
                turns += 1
                best = max(range(len(candidates)), key=candidate_scores.__getitem__)
                costs[index].choices.append(choice(len(episode.turns), candidates, candidate_scores, best))
                episodes[index] = played[best]
        live = [index for index in live if not episodes[index].done]
        progress.update(len(episodes) - len(live), turns, tokens, force=not live)
    return costs
