"""clemcore's own runners (sequential, batchwise) with in-memory scoring: the reference the engine is
compared against, in the equivalence tests and in ``clemprm.bench.engine`` and ``labels``."""

from __future__ import annotations

from dataclasses import dataclass, field

from clemprm.play.catalog import Instance
from clemprm.play.clemcore_setup import import_clemcore


@dataclass
class ReferenceEpisode:
    key: tuple[str, str, int]
    responses: list[str] = field(default_factory=list)
    scores: dict = field(default_factory=dict)


def run_clemcore(runner: str, benchmark, instances: list[Instance], model,
                 batch_size: int = 1) -> list[ReferenceEpisode]:
    """Play ``instances`` of one game with clemcore's ``runner`` ("sequential" or "batchwise"); score each episode."""
    import_clemcore()
    from clemcore.clemgame import (GameBenchmarkCallback, GameBenchmarkCallbackList, GameInstances,
                                   GameInteractionsRecorder)
    from clemcore.clemgame.runners import batchwise, sequential

    episodes: dict[tuple, ReferenceEpisode] = {}
    recorders: dict[tuple, GameInteractionsRecorder] = {}

    class ScoreInMemory(GameBenchmarkCallback):
        def on_game_start(self, game_master, game_instance):
            key = (game_master.game_spec.game_name, game_master.experiment["name"], int(game_instance["game_id"]))
            recorders[key] = GameInteractionsRecorder(key[0], key[1], key[2], "", {})
            game_master.register(recorders[key])
            episodes[key] = ReferenceEpisode(key)

        def on_game_end(self, game_master, game_instance, exception=None, rewards=None):
            key = (game_master.game_spec.game_name, game_master.experiment["name"], int(game_instance["game_id"]))
            interactions = recorders.pop(key).interactions
            episodes[key].responses = [event["action"]["content"] for turn in interactions["turns"] for event in turn
                                       if event["action"]["type"] == "get message"]
            if exception is None:
                scorer = benchmark.create_game_scorer(game_master.experiment, game_instance)
                scorer.compute_scores(interactions)
                episodes[key].scores = scorer.scores["episode scores"]

    rows = [{"game_name": i.game, "experiment": i.experiment, "game_instance": i.instance} for i in instances]
    callbacks = GameBenchmarkCallbackList([ScoreInMemory()])
    if runner == "sequential":
        sequential.run(benchmark, GameInstances(benchmark.game_name, rows), [model], callbacks=callbacks)
    elif runner == "batchwise":
        batchwise.run(benchmark, GameInstances(benchmark.game_name, rows), [model], callbacks=callbacks,
                      batch_size=batch_size)
    else:
        raise ValueError(f"unknown clemcore runner {runner!r}")
    return [episodes[instance.key] for instance in instances]


def run_clemcore_branching(roots: list, k: int, aborted_value: float) -> list[list[float]]:
    """Soft-label continuations with clemcore's branching runner: from each root episode (a branch point's
    state, see :class:`clemprm.stages.branch_points.BranchPointStates`) ``k`` branches are played to the end one at a
    time.
    Returns each root's continuation scores (0-100; an aborted one ``aborted_value`` x 100)."""
    import copy
    import math

    import_clemcore()
    from clemcore.clemgame import GameBenchmarkCallback, GameBenchmarkCallbackList, GameInteractionsRecorder
    from clemcore.clemgame.runners.branching import BranchingRunner

    all_scores = []
    for root in roots:
        scores = []

        class ScoreOnEnd(GameBenchmarkCallback):
            def on_game_end(self, game_master, game_instance, exception=None, rewards=None):
                recorder = next(r for r in game_master._loggers if isinstance(r, GameInteractionsRecorder))
                scorer = root.benchmark.create_game_scorer(root.instance.experiment, root.instance.instance)
                scorer.compute_scores(recorder.interactions)
                episode_scores = scorer.scores["episode scores"]
                aborted = bool(episode_scores.get("Aborted", 1))
                main = episode_scores.get("Main Score", math.nan)
                scores.append(100.0 * aborted_value if aborted else float(main))

        root_env = copy.deepcopy(root.env, {id(root.benchmark): root.benchmark})
        root_env.callbacks = GameBenchmarkCallbackList([ScoreOnEnd()])

        def at_root(env=None, **_):  # branch k ways at the branch point only, then play each branch on
            return env is root_env

        BranchingRunner(root_env, branching_factor=k, branching_condition=at_root).run()
        all_scores.append(scores)
    return all_scores
