"""Branch points and their K-rollout Monte-Carlo soft labels (the ``branch_points`` and ``soft_labels`` stages).

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

Soft labels
    A branch point's game state is rebuilt by replaying its ``history``: games are deterministic given the
    instance, the answers and the episode's own random generators (:mod:`clemprm.play.engine`), so a replay that does
    not reproduce the recorded prefix is a bug of that game (or of its set-up here): the shard fails, naming the
    game and the branch point. From there K forks are played to the end by the SFT policy, all continuations of all
    branch points of a chunk in lockstep through the one rollout engine. Each continuation is scored by the game's
    own BENCH_SCORE (a game that draws random numbers during play draws them afresh in each continuation, from the
    continuation's seed); an aborted one counts ``labels.aborted_value`` x 100; one stopped after
    ``labels.max_rollout_rounds`` turns past the branch point is scored with the game's partial score at the
    cutoff (:func:`partial_score`). label = mean(scores) / 100. A candidate that ended the game is labelled with
    its own final score.

    With ``labels.k_first`` (1 <= k_first < K; at K or above, one round of K) the continuations are played in two
    rounds: k_first per candidate first, then the other K - k_first only for the states where some first-round score
    differs from another (the siblings' and the continuations' own): a state whose every continuation lost alike
    keeps its k_first (its labels are alike either way), and every other label is the one all K at once give,
    continuation for continuation. The labelling budget goes to the states a PRM can learn to rank from.

    A continuation whose game raises (its code, its scorer, its ``partial_bench_score``, its scorer on an episode
    with answers closed as lost) is an error: it is left
    out of the label (``n_errors`` counts it, ``rollout_scores`` holds only the scored ones) and logged with its
    game; a branch point left without any scored continuation gets no label. The shard goes on either way.

    A shard file also keeps every continuation's answers with the game's verdict on each and how it ended
    (:data:`clemprm.records.SOFT_LABEL_SHARDS`), for the answers records (:mod:`clemprm.stages.answers`); the
    gathered soft labels leave them out.

Sharding and resumption
    Shard s of S takes the prefixes s, s+S, s+2S, ... with all their siblings (one replay of a state serves them
    all, and their continuations share the prefix in the generator's batches). Every random choice derives from
    the branch point's own seed, never from the shard or the batch, so the gathered labels do not depend on S. A
    shard labels its branch points in chunks of about ``labels.checkpoint_every`` (whole states) and appends each
    finished chunk to a checkpoint folder beside its output; a shard that is killed and rerun skips what its
    checkpoint holds (the checkpoint is discarded when the settings or the branch points changed; an unreadable part
    alone, with a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from pathlib import Path

from clemprm import distributed, records
from clemprm.play.catalog import GameCatalog, Instance
from clemprm.checks.run_time import check_episodes, check_instances, check_not_empty, fail_or_warn, marks_metadata
from clemprm.config import provenance
from clemprm.models.loader import policy_settings
from clemprm.play.engine import Episode, Generation, RolloutEngine, Sampling, game_seed, seeded_generator_states
from clemprm.stats import derive_seed

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ branch points


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
    instances = catalog.all_instances("train") + held_out_instances(catalog, bp_settings["validation_instances"])
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


def held_out_instances(catalog: GameCatalog, per_game: int) -> list[Instance]:
    """The first ``per_game`` validation instances of each game in the catalog's drawn order (a draw of the run's
    seed; fewer where ``games.max_instances.validation`` caps the split lower, or the game holds fewer: a warning,
    as the PRM is then judged on a smaller held-out set than asked)."""
    chosen = {game: catalog.instances(game, "validation")[:per_game] for game in catalog.games}
    if short := {game: len(found) for game, found in chosen.items() if len(found) < per_game}:
        log.warning("branch_points.validation_instances %d: the held-out set gets fewer instances of %s "
                    "(games.max_instances.validation %d, or the game's validation split holds no more): the PRM is "
                    "judged on fewer than asked", per_game, ", ".join(f"{game} ({n})" for game, n in short.items()),
                    catalog.config["max_instances"]["validation"])
    return [instance for found in chosen.values() for instance in found]


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


# ------------------------------------------------------------------------------------------ soft labels


class ContinuationError(Exception):
    """A continuation the game could not play or score to the end (its code, scorer or partial score raised)."""


_NO_PARTIAL_SCORE_LOGGED: set[str] = set()


def partial_score(episode: Episode) -> float:
    """The BENCH_SCORE (0-100) of an unfinished episode at the cutoff. A game master's ``partial_bench_score()``
    when it has one (an exception there is the continuation's error); otherwise :func:`closed_as_lost_score`
    (whose :class:`ContinuationError` is the continuation's error too), and 0 where that yields no score (logged
    once per game)."""
    partial = getattr(episode.env.game_master, "partial_bench_score", None)
    if partial is not None:
        try:
            return float(partial())
        except Exception as error:
            raise ContinuationError(f"partial_bench_score raised {type(error).__name__}: {error}") from error
    score, reason = closed_as_lost_score(episode)
    if reason is None:
        return score
    if episode.instance.game not in _NO_PARTIAL_SCORE_LOGGED:
        _NO_PARTIAL_SCORE_LOGGED.add(episode.instance.game)
        log.info("%s: no partial score from its scorer on an episode closed as lost (%s): capped continuations "
                 "score 0", episode.instance.game, reason)
    return 0.0


def closed_as_lost_score(episode: Episode) -> tuple[float, str | None]:
    """``(Main Score, None)`` of the game's own scorer on a copy of the unfinished ``episode`` closed as lost, shaped
    as clemcore leaves a finished episode: a round the game had opened but not played is closed first
    (:func:`close_unplayed_round`), then the game's end-of-game hook logs its keys and events (into the last played
    round, as when it ends), then Aborted 0, Lose 1, Success 0 are logged over whatever it logged.

    ``(nan, why)`` when there is no score: the scorer's Main Score is NaN, or the episode holds no answer yet and
    the hook or scorer raised on it (clemcore's scorers divide by the episode's requests: an empty episode cannot be
    scored; not an error). A hook or scorer that raises on an episode with answers is an error of the game's code:
    :class:`ContinuationError`."""
    from clemcore.clemgame.legacy.master import DialogueGameMaster as LegacyDialogueGameMaster
    from clemcore.clemgame.metrics import METRIC_ABORTED, METRIC_LOSE, METRIC_SUCCESS

    closed = episode.fork()
    interactions = closed.recorder.interactions
    try:
        closing = closed.env.game_master
        round_closed = close_unplayed_round(closed.recorder)
        with closed.own_generators():
            closing._on_after_game()
            closing.log_game_end(auto_count_logging=not isinstance(closing, LegacyDialogueGameMaster))
        if round_closed:
            drop_own_counts_of_unplayed_round(interactions)
        for key, value in ((METRIC_ABORTED, 0), (METRIC_LOSE, 1), (METRIC_SUCCESS, 0)):
            closed.recorder.log_key(key, value)
        score = float(closed.scores().get("Main Score", math.nan))
    except Exception as error:
        if not holds_answers(interactions):
            return math.nan, f"no answer yet, {type(error).__name__}: {error}"
        raise ContinuationError(f"the game's end-of-game hook or scorer raised on the episode closed as lost: "
                                f"{type(error).__name__}: {error}") from error
    return (score, None) if math.isfinite(score) else (math.nan, f"its Main Score is {score}")


def holds_answers(interactions: dict) -> bool:
    """Whether any player answered yet in an episode's ``interactions`` (clemcore's players log each answer as a
    ``get message`` event; a game may log other events during set-up)."""
    return any(event["action"]["type"] == "get message" for events in interactions["turns"] for event in events)


def close_unplayed_round(recorder) -> bool:
    """Undo the recorder's opening of the last round when nothing happened in it yet (clemcore opens the next round
    as soon as one ends, but not after the last one): a game never ends in such a round, and clemcore's scorers
    divide by each round's requests. What the end-of-game hook logs next then lands in the last played round, as
    in a finished episode. Its per-round request counts go with it. True when a round was closed.

    Reaches into clemcore 3.7.2's ``GameInteractionsRecorder`` (its round index and per-round counts), the inverse
    of its ``log_next_round``."""
    turns = recorder.interactions["turns"]
    if len(turns) < 2 or turns[-1]:
        return False
    turns.pop()
    for counts in (recorder.requests_counts, recorder.violated_requests_counts, recorder.successful_requests_counts):
        counts.pop()
    recorder._current_round -= 1
    return True


def drop_own_counts_of_unplayed_round(interactions: dict) -> None:
    """Per-round request counts a game logs itself (legacy games, in their end-of-game hook) that still hold an
    entry for the round :func:`close_unplayed_round` closed."""
    from clemcore.clemgame.metrics import (METRIC_REQUEST_COUNT, METRIC_REQUEST_COUNT_PARSED,
                                           METRIC_REQUEST_COUNT_VIOLATED)

    for key in (METRIC_REQUEST_COUNT, METRIC_REQUEST_COUNT_PARSED, METRIC_REQUEST_COUNT_VIOLATED):
        counts = interactions.get(key)
        if isinstance(counts, list) and len(counts) == len(interactions["turns"]) + 1:
            counts.pop()


def continuation_score(episode: Episode, capped: bool, aborted_value: float) -> tuple[float, bool, bool]:
    """``(score 0-100, aborted, success)`` of a finished or capped continuation; :class:`ContinuationError` when
    the game failed on it (its code or scorer raised)."""
    if episode.error is not None:
        raise ContinuationError(episode.error)
    if capped:
        return partial_score(episode), False, False
    row = episode.record("", Sampling())
    if row["error"] is not None:  # the scorer raised
        raise ContinuationError(row["error"])
    if row["aborted"]:
        return 100.0 * aborted_value, True, False
    return row["bench_score"], False, row["success"]


def label_row(bp: dict, scores: list[float], aborted: list[bool], success: list[bool], capped: int,
              new_tokens: int, terminal: bool, errors: int = 0) -> dict | None:
    """The soft-label row of a branch point from its scored continuations (None: none was scored)."""
    if not scores:
        return None
    return {**bp, "k": 0 if terminal else len(scores) + errors, "terminal": terminal, "rollout_scores": scores,
            "n_aborted": sum(aborted), "n_success": sum(success), "n_capped": capped, "n_errors": errors,
            "new_tokens": new_tokens, "label": sum(scores) / len(scores) / 100.0}


def scored(episode: Episode, capped: bool, aborted_value: float, errors: "ErrorCounts"):
    """:func:`continuation_score`, or None when the game failed on it (counted in ``errors``)."""
    try:
        return continuation_score(episode, capped, aborted_value)
    except ContinuationError as error:
        errors.add(episode.instance.game, episode.episode_id, str(error))
        return None


class ErrorCounts:
    """Continuation errors per game: how many, and the first one (logged when it happens)."""

    def __init__(self):
        self.count: dict[str, int] = {}
        self.first: dict[str, str] = {}

    def add(self, game: str, where: str, error: str) -> None:
        self.count[game] = self.count.get(game, 0) + 1
        self.first.setdefault(game, f"{where}: {error}")
        log.warning("%s: continuation %s failed (%d so far in this game): %s", game, where, self.count[game], error)

    def lines(self) -> str:
        return "\n".join(f"{game}: {count} continuations failed, first: {self.first[game]}"
                         for game, count in sorted(self.count.items()))


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


def label_chunk(engine: RolloutEngine, states: BranchPointStates, bps: list[dict], label_settings: dict,
                errors: ErrorCounts | None = None) -> list[dict]:
    """Soft-label a chunk of branch points: all K continuations of all of them in lockstep; with
    ``labels.k_first`` in two rounds (:func:`settled_states`). Branch points without any scored continuation get
    no row (their errors are counted in ``errors``). Each row also holds its ``continuations``
    (:data:`records.CONTINUATION`: every one played, its answers with the game's verdicts and how it ended; none for
    a terminal candidate), which the answers records read."""
    errors = errors if errors is not None else ErrorCounts()
    k, aborted_value = label_settings["k"], label_settings["aborted_value"]
    first = min(label_settings["k_first"] or k, k)   # k_first >= K: one round of K (a config that lowers K alone)
    roots = states.states(bps)
    outcomes: dict[int, list] = {}   # branch point index -> (score, aborted, success, capped) of each scored one
    failed: dict[int, int] = {}
    tokens: dict[int, int] = {}
    played: dict[int, list[dict]] = {}   # branch point index -> its continuations (records.CONTINUATION)
    terminal, live = {}, []
    for index, (bp, root) in enumerate(zip(bps, roots)):
        if not root.done:
            live.append(index)
            continue
        outcome = scored(root, False, aborted_value, errors)   # the candidate ended the game
        if outcome is not None:
            terminal[index] = outcome
    play_continuations(engine, bps, roots, live, range(first), label_settings, errors, outcomes, failed, tokens,
                       played)
    if first < k:
        settled = settled_states(bps, terminal, outcomes)
        rest = [index for index in live if bps[index]["prefix_id"] not in settled]
        log.info("soft labels, k_first %d: %d of %d states settled (every first continuation scored alike); "
                 "%d of %d candidates get the other %d continuations", first, len(settled),
                 len({bp["prefix_id"] for bp in bps}), len(rest), len(live), k - first)
        play_continuations(engine, bps, roots, rest, range(first, k), label_settings, errors, outcomes, failed,
                           tokens, played)
    rows = {index: label_row(bps[index], [score], [aborted], [success], 0, 0, terminal=True)
            for index, (score, aborted, success) in terminal.items()}
    for index in live:
        scores, aborted, success, capped = ([list(column) for column in zip(*outcomes[index])] if index in outcomes
                                            else [[]] * 4)
        rows[index] = label_row(bps[index], scores, aborted, success, sum(capped), tokens.get(index, 0),
                                terminal=False, errors=failed.get(index, 0))
    return [{**rows[index], "continuations": played.get(index, [])} for index in sorted(rows)
            if rows[index] is not None]


def play_continuations(engine: RolloutEngine, bps: list[dict], roots: list[Episode], indices: list[int],
                       continuations: range, label_settings: dict, errors: ErrorCounts, outcomes: dict,
                       failed: dict, tokens: dict, played: dict) -> None:
    """Play continuations ``continuations`` (their numbers j) of the branch points ``indices`` to the end in
    lockstep and add their scores to ``outcomes``, their failures to ``failed``, their new tokens to ``tokens``,
    their answers and ends to ``played`` (:func:`continuation_record`).
    Continuation j of a branch point is seeded from the branch point and j alone, so it is the same continuation
    in either round and in any chunk."""
    forks: list[tuple[int, int, Episode, int]] = []  # (branch point index, j, fork, turns before it)
    for index in indices:
        bp, root = bps[index], roots[index]
        for j in continuations:
            fork = root.fork(f"{bp['bp_id']}/k{j}", seed=derive_seed(bp["seed"], "continuation", j))
            # each continuation meets its own game randomness (a game that draws during play), seeded like its answers
            if fork.generator_states is not None:
                fork.generator_states = seeded_generator_states(derive_seed(bp["seed"], "continuation", j, "game"))
            forks.append((index, j, fork, len(root.turns)))
    if not forks:
        return
    engine.run([fork for _, _, fork, _ in forks], label="soft label continuations",
               max_turns=label_settings["max_rollout_rounds"])
    for index, j, fork, start in forks:
        capped = not fork.done
        tokens[index] = tokens.get(index, 0) + sum(turn["new_tokens"] for turn in fork.turns[start:])
        outcome = scored(fork, capped, label_settings["aborted_value"], errors)
        played.setdefault(index, []).append(continuation_record(bps[index]["prefix"], j, fork.turns[start:], outcome,
                                                                capped))
        if outcome is None:
            failed[index] = failed.get(index, 0) + 1
        else:
            outcomes.setdefault(index, []).append((*outcome, capped))


def continuation_record(prefix: list[dict], j: int, turns: list[dict], outcome: tuple | None, capped: bool) -> dict:
    """Continuation ``j`` as a shard keeps it (:data:`records.CONTINUATION`): its ``turns`` (answers, verdicts) and
    how it ended (``outcome``: :func:`scored`'s, None when the game failed on it). A perspective is stored as what
    follows the leading messages it shares with the branch point's ``prefix``: a continuation's perspectives all
    start with that prefix, so a shard does not hold it again for every turn of every continuation."""
    if outcome is None or capped:
        end, bench_score = ("error" if outcome is None else "capped"), None
    else:
        score, aborted, success = outcome
        end = "aborted" if aborted else "success" if success else "lost"
        bench_score = math.nan if aborted else score
    kept = []
    for turn in turns:
        shared = 0
        for mine, theirs in zip(turn["messages"], prefix):
            if mine != theirs:
                break
            shared += 1
        kept.append({"turn_idx": turn["turn_idx"], "player": turn["player"], "game_role": turn["game_role"],
                     "shared": shared, "messages_tail": turn["messages"][shared:], "response": turn["response"],
                     "parse_ok": turn["parse_ok"]})
    return {"k": j, "outcome": end, "bench_score": bench_score, "turns": kept}


def settled_states(bps: list[dict], terminal: dict, outcomes: dict) -> set[str]:
    """The states (prefix ids) whose candidates' first-round outcomes all scored alike (a terminal candidate by its
    own score): no difference between or within their candidates seen, so they keep their ``k_first``
    continuations. The others get all K: their labels are those of a run with all K at once."""
    scores: dict[str, set[float]] = {}
    for index, bp in enumerate(bps):
        seen = [terminal[index][0]] if index in terminal else [outcome[0] for outcome in outcomes.get(index, [])]
        scores.setdefault(bp["prefix_id"], set()).update(seen)
    return {prefix for prefix, seen in scores.items() if len(seen) <= 1}


def label_chunk_split(engine: RolloutEngine, states: BranchPointStates, bps: list[dict], label_settings: dict,
                      errors: ErrorCounts) -> list[dict]:
    """:func:`label_chunk` of ``bps``; in a job of several processes each labels its share of the prefixes (a prefix
    with all its siblings: one replay serves them) and every one gets all rows, in the order of ``bps``."""
    prefixes = list(dict.fromkeys(bp["prefix_id"] for bp in bps))

    def label_share(share: list[str]) -> list[list[dict]]:
        mine = set(share)
        rows = label_chunk(engine, states, [bp for bp in bps if bp["prefix_id"] in mine], label_settings, errors)
        return [[row for row in rows if row["prefix_id"] == prefix] for prefix in share]

    labelled = {row["bp_id"]: row for group in distributed.map_split(prefixes, label_share) for row in group}
    return [labelled[bp["bp_id"]] for bp in bps if bp["bp_id"] in labelled]


class ShardCheckpoint:
    """Finished chunks of a shard as parquet parts in ``<output>.ckpt/``, valid for one fingerprint only."""

    def __init__(self, output: str | Path, fingerprint: str):
        self.folder = Path(f"{output}.ckpt")
        self.fingerprint = fingerprint

    def load(self) -> list[dict]:
        stamp = self.folder / "fingerprint"
        if self.folder.exists() and (not stamp.exists() or stamp.read_text() != self.fingerprint):
            log.info("checkpoint %s was made with other settings or branch points: starting over", self.folder)
            shutil.rmtree(self.folder)
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            stamp.write_text(self.fingerprint)
            return []
        rows = []
        for part in self._parts():
            try:
                rows += records.read_records(part, records.SOFT_LABEL_SHARDS)
            except records.RecordFileError as error:   # e.g. cut short by a full disk: label its branch points again
                log.warning("checkpoint part %s is unreadable and is discarded; its branch points are labelled "
                            "again: %s", part, error)
                part.unlink()
        return rows

    def save(self, rows: list[dict]) -> None:
        """Write ``rows`` as the next part (numbered after the last one, also when an earlier one was discarded)."""
        last = max((int(part.stem.removeprefix("part-")) for part in self._parts()), default=-1)
        records.write_records(self.folder / f"part-{last + 1:05d}.parquet", rows, records.SOFT_LABEL_SHARDS, {})

    def _parts(self) -> list[Path]:
        return sorted(self.folder.glob("part-*.parquet"))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def shard_fingerprint(settings: dict, bp_path: str | Path, shard: int, shards: int) -> str:
    digest = hashlib.sha256(json.dumps([settings, shard, shards], sort_keys=True, default=str).encode())
    digest.update(Path(bp_path).read_bytes())
    return digest.hexdigest()


def whole_states(bps: list[dict], size: int) -> list[list[dict]]:
    """``bps`` in chunks of at least ``size`` branch points (the last one may be smaller) that split no state: a
    state's siblings are labelled in one chunk, where ``labels.k_first`` compares them."""
    by_state: dict[str, list[dict]] = {}
    for bp in bps:
        by_state.setdefault(bp["prefix_id"], []).append(bp)
    chunks, chunk = [], []
    for state in by_state.values():
        if len(chunk) >= size:
            chunks.append(chunk)
            chunk = []
        chunk += state
    return chunks + ([chunk] if chunk else [])


def shard_rows(bps: list[dict], shard: int, shards: int) -> list[dict]:
    """The branch points of prefixes ``shard, shard + shards, ...`` (in order of first appearance), siblings
    included; with one candidate per prefix, branch points ``shard, shard + shards, ...``."""
    prefixes = list(dict.fromkeys(bp["prefix_id"] for bp in bps))
    mine = set(prefixes[shard::shards])
    return [bp for bp in bps if bp["prefix_id"] in mine]


def soft_labels_shard(settings: dict, bp_path: str, sft_adapter: str | None, shard: int, shards: int, output: str,
                      cache_dir: str | None = None, threads: int | None = None, policy=None,
                      errors: ErrorCounts | None = None) -> list[dict]:
    """Label branch points ``shard, shard + shards, ...`` of ``bp_path``, resuming from the shard's checkpoint.
    ``threads`` (the job's threads) overrides ``model.threads``, so shards can share a machine. ``errors``, if
    given, counts the continuations the games failed on in this call (this process's share), also those of branch
    points left without a label, which the returned rows do not hold. Returns the soft-label rows
    (:data:`records.SOFT_LABELS`); the shard file also holds each one's continuations
    (:data:`records.SOFT_LABEL_SHARDS`)."""
    label_settings = settings["labels"]
    branch_points = records.read_records(bp_path, records.BRANCH_POINTS, splits=records.LABEL_SPLITS)
    mine = shard_rows(branch_points, shard, shards)
    checkpoint = ShardCheckpoint(output, shard_fingerprint(settings, bp_path, shard, shards))
    # rank 0 reads (and may discard) the checkpoint; every rank labels its share of what is left
    done = {row["bp_id"]: row for row in distributed.from_main(checkpoint.load() if distributed.is_main() else None)}
    todo = [bp for bp in mine if bp["bp_id"] not in done]
    log.info("soft labels shard %d/%d: %d branch points, %d done in the checkpoint, %d to label (K=%d)",
             shard, shards, len(mine), len(done), len(todo), label_settings["k"])
    if todo:
        from clemprm.models.generation import load_policy

        model_settings = policy_settings(settings["model"], sft_adapter)
        policy = policy or load_policy({**model_settings, "threads": threads or model_settings["threads"]}, cache_dir)
        engine = RolloutEngine(GameCatalog(settings["games"], settings["seed"]), Sampling(
            label_settings["temperature"], label_settings["top_p"], label_settings["max_new_tokens"]))
        states = BranchPointStates(engine, engine.catalog, policy, settings["seed"])
        step, errors = label_settings["checkpoint_every"], errors if errors is not None else ErrorCounts()
        for chunk in whole_states(todo, step):
            rows = label_chunk_split(engine, states, chunk, label_settings, errors)
            checkpoint.save(rows)
            done.update((row["bp_id"], row) for row in rows)
            log.info("soft labels shard %d/%d: %d/%d branch points labelled", shard, shards, len(done), len(mine))
        if errors.count:
            log.warning("soft labels shard %d/%d: continuations the games failed on (left out of the labels):\n%s",
                        shard, shards, errors.lines())
    rows = [done[bp["bp_id"]] for bp in mine if bp["bp_id"] in done]
    records.write_records(output, rows, records.SOFT_LABEL_SHARDS, provenance(settings))
    if distributed.is_main():
        checkpoint.remove()
    return [{name: row[name] for name in records.SOFT_LABELS.names} for row in rows]


def gather_soft_labels(settings: dict, bp_path: str, shard_paths: list[str], output: str,
                       on_failure: str = "stop") -> list[dict]:
    """Concatenate the shards in branch point order into one soft-labels file. Fails when no label has any
    variance (nothing for a PRM to learn), unless ``on_failure`` is continue (then the file's provenance records
    it)."""
    by_id = {}
    for path in shard_paths:
        for row in records.read_records(path, records.SOFT_LABELS, splits=records.LABEL_SPLITS):
            if row["bp_id"] in by_id:
                raise ValueError(f"branch point {row['bp_id']} is in two shards (again in {path})")
            by_id[row["bp_id"]] = row
    order = [bp["bp_id"] for bp in records.read_records(bp_path, records.BRANCH_POINTS,
                                                         splits=records.LABEL_SPLITS)]
    rows = [by_id[bp_id] for bp_id in order if bp_id in by_id]
    log.info("soft labels: %d of %d branch points labelled (%d without any scored continuation)\n%s", len(rows),
             len(order), len(order) - len(rows), summarize_labels(rows))
    marks = check_not_empty("gather_soft_labels", "soft labels", len(rows), f"{len(order)} branch points", on_failure,
                            condition="no_soft_labels")
    if rows and len({row["label"] for row in rows}) == 1:
        marks.append(fail_or_warn(
            "gather_soft_labels", f"no soft label with any variance: all {len(rows)} labels are "
            f"{rows[0]['label']:.3f}, nothing for a PRM to learn ({summarize_labels(rows)})", on_failure,
            condition="no_label_variance", count=len(rows)))
    records.write_records(output, rows, records.SOFT_LABELS, {**provenance(settings), **marks_metadata(marks)})
    log.info("soft labels -> %s", output)
    return rows


def labelling_counts(branch_points: list[dict], rows: list[dict], errors: ErrorCounts) -> str:
    """One line on a labelling of ``branch_points``: how many got a label (``rows``; terminal: the candidate ended
    the game), the continuations scored (the capped ones among them) and those the games failed on, counted in
    ``errors`` (:func:`soft_labels_shard`'s), which also holds the failures of the branch points left without a
    label (every continuation failed; for a terminal one, its own score)."""
    continued = [row for row in rows if not row["terminal"]]
    scored = sum(len(row["rollout_scores"]) for row in continued)
    return (f"{len(rows)}/{len(branch_points)} labelled ({len(rows) - len(continued)} terminal), "
            f"{scored} continuations scored ({sum(row['n_capped'] for row in continued)} capped), "
            f"{sum(errors.count.values())} failed")


def summarize_labels(rows: list[dict]) -> str:
    """One line per game: branch points, label mean, continuations, their abort and success rates."""
    lines = []
    for game in sorted({row["game"] for row in rows}):
        game_rows = [row for row in rows if row["game"] == game]
        labels = [row["label"] for row in game_rows]
        mean = sum(labels) / len(labels)
        std = math.sqrt(sum((x - mean) ** 2 for x in labels) / len(labels))
        continued = [row for row in game_rows if not row["terminal"]]
        k = sum(row["k"] for row in continued) or 1
        lines.append(f"{game}: {len(game_rows)} branch points, label mean {mean:.3f} (std {std:.3f}), "
                     f"{len(game_rows) - len(continued)} terminal; {k} continuations of the others: "
                     f"{100 * sum(r['n_aborted'] for r in continued) / k:.0f}% aborted, "
                     f"{100 * sum(r['n_success'] for r in continued) / k:.0f}% success, "
                     f"{100 * sum(r['n_capped'] for r in continued) / k:.0f}% capped, "
                     f"{sum(r['n_errors'] for r in continued)} failed (left out)")
    return "\n".join(lines)
