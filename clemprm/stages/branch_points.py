"""The branch points of the SFT policy (the ``branch_points`` stage), their siblings and the game states they stand in.

Branch points
    The SFT policy (base + SFT adapter) plays the train split, and the first
    ``branch_points.validation_instances`` instances per game of the validation split as the run's seed draws it
    (:meth:`~clemprm.play.catalog.GameCatalog.instances`: another seed holds out other instances; their rows keep
    ``split: validation``: the PRM stage never trains or selects on them, they are its held-out set for the
    ranking metrics); every LLM turn is a branch point: the prefix
    the player saw, its answer (the candidate), and the answers of the whole episode up to it (``history``).
    A trajectory with more turns than ``branch_points.max_per_episode`` is subsampled evenly along it.
    With ``branch_points.siblings: M`` > 1, M - 1 more answers are sampled from the same prefix (the game state
    before the candidate, rebuilt by replay; one ``generate`` call for all of them, seeded from the branch point):
    the distinct ones that differ from the played candidate become branch points of their own
    (``<prefix_id>/s<j>``), with the played one's prefix and ``prefix_id``, so the siblings of a state group and a
    PRM can be measured on the comparison a search makes. ``episode_*`` keep describing the sampled trajectory
    the prefix comes from.

Game states (:class:`BranchPointStates`)
    A branch point's game state is rebuilt by replaying its ``history``: games are deterministic given the
    instance, the answers and the episode's own random generators (:mod:`clemprm.play.engine`), so a replay that does
    not reproduce the recorded prefix is a bug of that game (or of its set-up here): :class:`ReplayDivergence`,
    naming the game and the branch point. The siblings are sampled from the state before the candidate, the soft
    labels (:mod:`clemprm.stages.labels`) continue from the state after it.
"""

from __future__ import annotations

import logging

from clemprm import distributed, records
from clemprm.checks.run_time import (FailureMark, check_episodes, check_instances, check_not_empty, marks_metadata,
                                     warning_mark)
from clemprm.config import provenance
from clemprm.models.loader import policy_settings
from clemprm.play.catalog import GameCatalog, Instance
from clemprm.play.contract import Generation, Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.play.episode import Episode, game_seed
from clemprm.stats import derive_seed

log = logging.getLogger(__name__)


def evenly_spaced(n: int, cap: int) -> list[int]:
    """``min(n, cap)`` indices spread evenly over ``range(n)``, always including the first and the last."""
    if n <= cap:
        return list(range(n))
    if cap == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (cap - 1)) for i in range(cap)})


def branch_points_of(episode: dict, max_per_episode: int, base_seed: int) -> list[dict]:
    """The branch point rows of one episode record (:data:`records.EPISODES`); none for a failed episode."""
    if episode["error"] is not None:
        return []
    turns = episode["turns"]
    history = [turn["response"] for turn in turns]
    rows = []
    for index in evenly_spaced(len(turns), max_per_episode):
        turn = turns[index]
        bp_id = f"{episode['episode_id']}/{turn['turn_idx']}"
        rows.append({
            "bp_id": bp_id, "prefix_id": bp_id, "episode_id": episode["episode_id"], "game": episode["game"],
            "experiment": episode["experiment"], "game_id": episode["game_id"], "split": episode["split"],
            "turn_idx": turn["turn_idx"], "player": turn["player"], "game_role": turn["game_role"],
            "prefix": turn["messages"], "candidate": turn["response"], "history": history[:index + 1],
            "parse_ok": turn["parse_ok"], "reply": turn["reply"], "seed": derive_seed(base_seed, "soft_labels", bp_id),
            "episode_bench_score": episode["bench_score"], "episode_success": episode["success"],
            "episode_aborted": episode["aborted"], "multiplicity": 1})
    return rows


def branch_points(settings: dict, sft_adapter: str | None, episodes_output: str, output: str,
                  cache_dir: str | None = None, policy=None, on_failure: str = "stop") -> list[dict]:
    """The SFT policy plays the train split (and ``branch_points.validation_instances`` validation instances per
    game, the PRM's held-out set); write its episodes and their branch points. Fails when every
    episode of a game failed or there is no branch point at all, unless ``on_failure`` is continue (then the branch
    points' provenance records what the stage went on despite)."""
    from clemprm.models.generation import load_policy
    from clemprm.stages.rollouts import summarize

    bp_settings = settings["branch_points"]
    catalog = GameCatalog(settings["games"], settings["seed"])
    marks = check_instances("branch_points", catalog, "train", on_failure)
    policy = policy or load_policy(policy_settings(settings["model"], sft_adapter), cache_dir)
    engine = RolloutEngine(catalog, Sampling(bp_settings["temperature"], bp_settings["top_p"],
                                             bp_settings["max_new_tokens"]))
    held_out, marks_held_out = held_out_instances(catalog, bp_settings["validation_instances"])
    marks += marks_held_out
    instances = catalog.all_instances("train") + held_out
    episodes = engine.play(instances, [policy], repeats=bp_settings["episodes_per_instance"],
                           base_seed=settings["seed"], stage="branch_points", policy_name=policy.name)
    rows = [row for episode in episodes
            for row in branch_points_of(episode, bp_settings["max_per_episode"], settings["seed"])]
    if bp_settings["siblings"] > 1:
        rows = with_siblings(engine, BranchPointStates(engine, catalog, policy, settings["seed"]), rows,
                             bp_settings["siblings"], settings["seed"])
    marks += check_episodes("branch_points", episodes, on_failure)
    marks += check_not_empty("branch_points", "branch points", len(rows),
                             f"{len(episodes)} SFT-policy episodes, {sum(e['error'] is not None for e in episodes)} "
                             f"failed", on_failure, condition="no_branch_points")
    metadata = {**provenance(settings), **marks_metadata(marks)}
    records.write_records(episodes_output, episodes, records.EPISODES, metadata)
    records.write_records(output, rows, records.BRANCH_POINTS, metadata)
    log.info("branch points: %d from %d SFT-policy episodes -> %s\n%s", len(rows), len(episodes), output,
             summarize(episodes))
    return rows


def held_out_instances(catalog: GameCatalog, per_game: int) -> tuple[list[Instance], list[FailureMark]]:
    """The first ``per_game`` validation instances of each game in the catalog's drawn order (a draw of the run's
    seed), and a warning mark where a game gives fewer (``games.max_instances.validation`` caps the split lower, or
    the game holds no more): the PRM is then judged on a smaller held-out set than asked, which the summary says."""
    chosen = {game: catalog.instances(game, "validation")[:per_game] for game in catalog.games}
    short = {game: len(found) for game, found in chosen.items() if len(found) < per_game}
    marks = [warning_mark(
        "branch_points", f"branch_points.validation_instances {per_game}: the held-out set gets fewer instances of "
        f"{', '.join(f'{game} ({n})' for game, n in short.items())} (games.max_instances.validation "
        f"{catalog.config['max_instances']['validation']}, or the game's validation split holds no more): the PRM is "
        f"judged on fewer than asked", condition="heldout_capped",
        count=sum(per_game - n for n in short.values()))] if short else []
    return [instance for found in chosen.values() for instance in found], marks


def distinct_siblings(candidate: str,
                      generations: list[Generation]) -> tuple[list[tuple[int, Generation]], dict[str, int]]:
    """The sampled ``generations`` of a state (slots 1, 2, ...; slot 0 is the played ``candidate``) reduced to one
    per distinct answer: ``(slot, generation)`` of the first of each answer that differs from the candidate (a
    failed generation kept, to be logged as failed), and how many of the state's samples each answer text is (its
    multiplicity, the candidate's own sample included)."""
    fresh, counts = [], {candidate: 1}
    for j, generation in enumerate(generations, start=1):
        if generation.error is None and generation.text in counts:
            counts[generation.text] += 1
            continue
        if generation.error is None:
            counts[generation.text] = 1
        fresh.append((j, generation))
    return fresh, counts


def with_siblings(engine: RolloutEngine, states: "BranchPointStates", rows: list[dict], siblings: int,
                  base_seed: int) -> list[dict]:
    """``rows`` each followed by its siblings: ``siblings - 1`` answers sampled from its prefix in one ``propose``
    call, of which the distinct ones that differ from the candidate are kept (:func:`distinct_siblings`), each with
    the game's verdict on it (``parse_ok``), the game's reply to it and its own seed, and every row of the state with
    its ``multiplicity``: how many of the state's samples gave its answer (a random pick among the samples picks it
    that much more often). An answer the policy or the game failed on is left out (logged). In a job of several
    processes each samples the siblings of its share of ``rows``."""
    def siblings_of_share(share: list[dict]) -> list[list[dict]]:
        before = states.states_before(share)
        for state, bp in zip(before, share):  # fresh samples, not the played candidate again
            state.seed = derive_seed(base_seed, "siblings", bp["bp_id"])
        proposals = engine.propose(before, siblings - 1)
        groups, duplicates, failed = [], 0, 0
        for bp, state, candidates in zip(share, before, proposals):
            fresh, counts = distinct_siblings(bp["candidate"], candidates)
            duplicates += sum(counts.values()) - len(counts)
            group = [{**bp, "multiplicity": counts[bp["candidate"]]}]
            for (j, generation), played in zip(fresh, engine.play_each(state, [g for _, g in fresh])):
                if played.error is not None:
                    failed += 1
                    log.warning("branch point %s: sibling %d left out: %s", bp["bp_id"], j, played.error)
                    continue
                sibling_id = f"{bp['prefix_id']}/s{j}"
                group.append({**bp, "bp_id": sibling_id, "candidate": generation.text,
                              "history": bp["history"][:-1] + [generation.text],
                              "parse_ok": played.turns[-1]["parse_ok"], "reply": played.turns[-1]["reply"],
                              "seed": derive_seed(base_seed, "soft_labels", sibling_id),
                              "multiplicity": counts[generation.text]})
            groups.append(group)
        log.info("siblings: %d prefixes, %d sampled answers, %d kept, %d duplicates of an earlier sibling, %d failed",
                 len(share), (siblings - 1) * len(share), sum(map(len, groups)) - len(share), duplicates, failed)
        return groups

    return [bp for group in distributed.map_split(rows, siblings_of_share) for bp in group]


class BranchPointStates:
    """Rebuilds the game state right after each branch point's candidate, replaying each episode once:
    branch points of one episode (sorted by turn) fork from one replay as it moves along."""

    def __init__(self, engine: RolloutEngine, catalog: GameCatalog, policy, base_seed: int):
        self.engine, self.catalog, self.policy, self.base_seed = engine, catalog, policy, base_seed
        self._instances: dict[tuple, Instance] = {}

    def instance(self, bp: dict) -> Instance:
        key = (bp["game"], bp["experiment"], bp["game_id"])
        if key not in self._instances:
            for instance in self.catalog.instances(bp["game"], bp["split"]):
                self._instances[instance.key] = instance
        if key not in self._instances:
            raise KeyError(f"branch point {bp['bp_id']}: instance {key} is not among the configured games' "
                           f"{bp['split']} instances")
        return self._instances[key]

    def states(self, bps: list[dict]) -> list[Episode]:
        """One episode per branch point, at the state after its candidate (:class:`ReplayDivergence` when the replay
        does not reproduce it)."""
        states = self.states_before(bps)
        for bp, state in zip(bps, states):
            self.engine.replay(state, [bp["candidate"]])
            self._check_reproduces(state, bp)
        return states

    def states_before(self, bps: list[dict]) -> list[Episode]:
        """One episode per branch point (id and seed its own), at the state before its candidate: the player waits
        for an answer to the branch point's prefix. All but the last answer of ``history`` are the sampled
        trajectory's, so one replay per episode serves all its branch points and their siblings."""
        by_episode: dict[str, list[int]] = {}
        for index, bp in enumerate(bps):
            by_episode.setdefault(bp["episode_id"], []).append(index)
        states: list[Episode | None] = [None] * len(bps)
        for indices in by_episode.values():
            indices.sort(key=lambda i: bps[i]["turn_idx"])
            episode_id = bps[indices[0]]["episode_id"]
            replay = self.engine.start(self.instance(bps[indices[0]]), [self.policy], episode_id, 0,
                                       game_seed(self.base_seed, episode_id))
            for index in indices:
                bp = bps[index]
                self.engine.replay(replay, bp["history"][len(replay.turns):-1])
                states[index] = replay.fork(bp["bp_id"], seed=bp["seed"])
        return states

    @staticmethod
    def _check_reproduces(replay: Episode, bp: dict) -> None:
        last = replay.turns[-1] if len(replay.turns) == len(bp["history"]) else None
        if replay.error is None and last and last["response"] == bp["candidate"] and last["messages"] == bp["prefix"]:
            return
        if replay.error is not None:
            how = f"the replay failed: {replay.error}"
        elif last is None:
            how = f"the game ended after {len(replay.turns)} of the {len(bp['history'])} recorded answers"
        else:
            how = "the player saw another prompt than recorded"
        raise ReplayDivergence(
            f"game {bp['game']}: replaying branch point {bp['bp_id']} did not reproduce the recorded game ({how}). "
            f"The game must be deterministic given its instance, the answers and the random generators the engine "
            f"seeds per episode (Python's random, numpy.random); a game that draws from other sources cannot be "
            f"labelled")


class ReplayDivergence(RuntimeError):
    """A branch point's replay did not rebuild the recorded game: the labels of that game would be wrong."""
