"""The ``rl_states`` stage: the hanabi prompt set, game states from the rule-based player's self-play, to train
single-turn on states.

The rule-based player (:mod:`clemprm.games.hanabi.bot`) plays both seats of every hanabi instance of a split (the
train split by default) through the rollout engine; every turn is a state: the prompt the player to move gets
(its whole perspective: one message, hanabi players remember only the current turn), the answers that led there
(``history``) and the rule-based player's own answer there (``reference``). Replaying ``history`` through the
engine (:func:`replay_state`) rebuilds the game exactly (games are deterministic given the instance and the
answers), with the player waiting for its answer: play a generated answer with ``engine.apply`` and read its
rewards with :func:`clemprm.games.hanabi.rewards.turn_rewards`. Records: :data:`clemprm.records.STATES`.

    python -m clemprm.stages.rl_states OUT.parquet [--config configs/hanabi.yaml] [--split train]
                                       [--max-per-episode N]
"""

from __future__ import annotations

import logging

from clemprm import records
from clemprm.play.catalog import GameCatalog, Instance
from clemprm.config import provenance
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.play.episode import Episode
from clemprm.stages.branch_points import evenly_spaced

log = logging.getLogger(__name__)

GAME = "hanabi"


def waiting_seat():
    """A model for both seats that the engine waits on, so every turn's prompt is seen; the answers come from the
    players' rule-based moves. (A ``CustomResponseModel`` would answer by itself inside the engine, which lets
    programmatic players play their turns: the turns would pass unseen.)"""
    from clemcore.backends import HumanModel
    from clemcore.backends.model_registry import ModelSpec

    return HumanModel(ModelSpec(model_name="rule-based"))


def self_play_states(catalog: GameCatalog, split: str = "train", max_per_episode: int | None = None) -> list[dict]:
    """One :data:`records.STATES` row per turn of the rule-based player's self-play on ``split`` (a longer game's
    turns are subsampled evenly to ``max_per_episode``, first and last kept)."""
    engine = RolloutEngine(catalog, Sampling())
    model = waiting_seat()
    instances = catalog.instances(GAME, split)
    rows = []
    for number, instance in enumerate(instances, 1):
        game, experiment, game_id = instance.key
        episode = engine.start(instance, [model], f"{game}/{experiment}/{game_id}/bot", seed=0)
        states, history = [], []
        while not episode.done and (waiting := engine.waiting(episode)) is not None:
            player, messages = waiting
            answer = player._custom_response(None)  # the rule-based player's answer (programmatic play)
            states.append({
                "state_id": f"{game}/{experiment}/{game_id}/{len(history)}", "game": game, "experiment": experiment,
                "game_id": game_id, "split": split, "turn_idx": len(history), "player": player.name,
                "game_role": player.game_role, "messages": messages, "history": list(history), "reference": answer})
            engine.replay(episode, [answer])
            history.append(answer)
        if episode.error is not None:
            raise RuntimeError(f"rule-based self-play of {instance.key} failed: {episode.error}")
        keep = evenly_spaced(len(states), max_per_episode) if max_per_episode else range(len(states))
        rows += [states[index] for index in keep]
        log.info("hanabi states: %d/%d episodes, %d states (this game: %d turns, score %s)", number,
                 len(instances), len(rows), len(states), episode.env.game_master.game.score())
    return rows


def write_states(games_settings: dict, output: str, seed: int, split: str = "train",
                 max_per_episode: int | None = None) -> list[dict]:
    """:func:`self_play_states` of the hanabi instances ``games_settings`` (a ``games`` config section) selects and
    the run's ``seed`` draws (the draw the RL stage looks them up in), written to ``output`` with their provenance."""
    if GAME not in games_settings["builtin"]:
        raise ValueError(f"games.builtin {games_settings['builtin']} does not list {GAME}")
    rows = self_play_states(GameCatalog(games_settings, seed), split, max_per_episode)
    settings = {"seed": seed, "games": games_settings, "states": {"split": split, "max_per_episode": max_per_episode}}
    records.write_records(output, rows, records.STATES, provenance(settings))
    log.info("wrote %d hanabi states to %s", len(rows), output)
    return rows


def state_instance(catalog: GameCatalog, row: dict) -> Instance:
    """The catalog's instance of a state row (its ``(game, experiment, game_id)`` in its split)."""
    key = (row["game"], row["experiment"], row["game_id"])
    for instance in catalog.instances(row["game"], row["split"]):
        if instance.key == key:
            return instance
    raise KeyError(f"state {row['state_id']}: instance {key} is not among the configured {row['split']} instances")


def replay_state(engine: RolloutEngine, instance: Instance, history: list[str], models: list, episode_id: str,
                 seed: int) -> Episode:
    """A new episode of ``instance`` with ``history`` replayed: the player to move waits for its answer."""
    episode = engine.replay(engine.start(instance, models, episode_id, seed), history)
    if episode.done or len(episode.turns) != len(history):
        raise ValueError(f"{episode_id}: replaying {len(history)} answers did not reach a waiting player "
                         f"({episode.error or 'the game ended'})")
    return episode


if __name__ == "__main__":
    import argparse

    from clemprm.config import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the parquet file to write")
    parser.add_argument("--config", default="configs/hanabi.yaml", help="its games section selects the instances")
    parser.add_argument("--split", default="train")
    parser.add_argument("--max-per-episode", type=int, default=None, help="states kept per game (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    write_states(load_config(args.config)["games"], args.output, args.split, args.max_per_episode)
