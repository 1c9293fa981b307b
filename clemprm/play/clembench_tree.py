"""clembench results trees: played episodes in the layout clemcore 3.7.2's file callbacks write
(``clemcore/clemgame/callbacks/files.py``), so that clemcore's own ``clem score``, ``clem transcribe`` and
``clem eval`` read them as they read a ``clem run``'s results.

One *run folder* per policy and eval mode, inside a results folder (what ``clem run -r`` takes)::

    <results_dir>/<run_dir>/run.json
    <results_dir>/<run_dir>/<game>/<experiment>/experiment.json
    <results_dir>/<run_dir>/<game>/<experiment>/<episode_dir>/instance.json
                                                             interactions.json
                                                             scores.json
                                                             completed.json  (or error.json)

* ``run_dir`` (:func:`run_dir_name`) is ``<policy>-<mode>``: ``clem eval`` names a row by it (the 5th-last path
  part), and two modes of one policy (``greedy_base`` and the searches both play the base model) must not share a
  row, or it drops the second's episodes as repeated files.
* ``episode_dir`` (:func:`episode_dir_name`) is clemcore's ``instance_<game_id, 5 digits>`` when every instance
  was played once; with several episodes per instance it is ``instance_<game_id>_episode_<repeat, 5 digits>``
  (the repeat of the episode id ``<game>/<experiment>/<game_id>/<repeat>``). No extra folder level: ``clem eval``
  takes the last five path parts as model / game / experiment / episode / file, and ``clem score`` reads
  ``experiment.json`` from the parent of the episode folder.
* ``instance.json``: the game instance; ``experiment.json``: the experiment without its instances (with the
  pipeline's settings applied, e.g. a built-in game's ``parse_mode``), plus ``timestamp``, ``game_name`` and
  ``player_models``, as clemcore's ``ExperimentFileSaver`` writes it.
* ``interactions.json``: the episode's :class:`~clemcore.clemgame.GameInteractionsRecorder` dict as the game
  produced it (meta, players, turns, request counts, the game's own keys); only ``meta.results_folder`` (the run
  folder) and ``player_models`` are filled in, as clemcore's ``InteractionsFileSaver`` creates its recorder with
  them.
* ``scores.json``: the game's own scorer on those interactions (:meth:`~clemprm.play.episode.Episode.game_scores`:
  ``episode scores`` with Aborted, Lose, Success, Main Score and the game's other keys, ``round scores``): what
  ``clem score`` recomputes.
* ``completed.json`` / ``error.json``: clemcore's ``SignalFileSaver`` files, plus the episode id and seed (to find
  the episode's row in the pipeline's parquet). An episode that failed (an exception in game code or scorer, a
  too-long prompt, a beam search that ended unfinished) has, as in clemcore, no ``interactions.json``; its
  ``scores.json`` is the pipeline's: ``Aborted`` 1, ``Lose`` 0, ``Success`` 0, ``Main Score`` NaN, so that
  ``clem eval`` counts it as not played, as the pipeline's summary does (``clem score`` does not touch it).
* ``run.json``: clemcore's ``RunFileSaver`` keys (``clem_version``, ``created``, ``player_models``, per game its
  ``game_path`` and ``num_instances``, here the episodes played) plus ``clemprm``: what the caller adds (the mode,
  its sampling, ...).

The player's ``*.requests.json`` (clemcore's ``PlayerFileSaver``) is not written. A run folder is written beside
its place and moved in, replacing an older one.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from collections import Counter
from datetime import datetime
from pathlib import Path

from clemprm import distributed
from clemprm.play.clemcore_setup import import_clemcore
from clemprm.play.contract import Sampling
from clemprm.play.episode import Episode

# the episode scores of a failed episode: not played (what clem eval's % Played counts), no quality
FAILED_EPISODE_SCORES = {"Aborted": 1, "Lose": 0, "Success": 0, "Main Score": math.nan}


def run_dir_name(policy: str, mode: str, regime: str = "blind") -> str:
    """The run folder of ``policy`` played in ``mode``: ``<policy>-<mode>``, ``<policy>-<mode>-lookahead`` for a
    lookahead mode (its candidates were played in forks: no clembench score), path separators and spaces as ``_``."""
    suffix = "" if regime == "blind" or mode.endswith("lookahead") else "-lookahead"
    return re.sub(r"[\s/\\]+", "_", f"{policy}-{mode}{suffix}")


def episode_dir_name(game_id: int, repeat: int, several: bool) -> str:
    """``instance_00003`` (clemcore's) or, with several episodes per instance, ``instance_00003_episode_00001``."""
    name = f"instance_{int(game_id):05d}"
    return f"{name}_episode_{repeat:05d}" if several else name


def model_infos(model, sampling: Sampling) -> dict:
    """``player_models`` as clemcore's ``Model.to_infos`` gives it: the model spec and the generation arguments
    (here the mode's sampling)."""
    spec = getattr(model, "model_spec", None)
    return {0: {"model_spec": spec.to_dict() if spec is not None else {"model_name": model.name},
                "gen_args": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                             "max_tokens": sampling.max_new_tokens}}}


def _plain(value):
    if hasattr(value, "item"):   # numpy scalars
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def store_json(data, path: Path) -> None:
    """As clemcore's ``store_json``: indented, not ASCII-escaped, NaN as ``NaN``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(data, file, ensure_ascii=False, indent=2, default=_plain)


def episode_files(episode: Episode, run_dir: str, infos: dict) -> dict[str, dict]:
    """The files of one episode folder, by name. ``episode.record`` has been called (it marks an unfinished or
    unscorable episode as failed)."""
    signal = {"timestamp": datetime.now().isoformat(), "episode_id": episode.episode_id, "seed": episode.seed}
    files = {"instance.json": episode.instance.instance}
    error = episode.error if episode.error is not None or episode.done else "episode not finished"
    recorded = episode.recorder.interactions
    interactions = {**recorded, "meta": {**recorded["meta"], "results_folder": run_dir}, "player_models": infos}
    scores = None
    if error is None:
        try:   # on the interactions as written: a scorer may copy their meta data, clem score would
            scores = episode.game_scores(copy.deepcopy(interactions))
        except Exception as exception:  # the row says so too: Episode.record failed the episode the same way
            error = f"{type(exception).__name__}: {exception}"
    if scores is None:
        files["scores.json"] = {"meta": {"written_by": "clemprm: the episode failed, no game scorer ran",
                                         "error": error},
                                "players": {}, "round scores": {}, "episode scores": dict(FAILED_EPISODE_SCORES)}
        files["error.json"] = {**signal, "error": "EpisodeFailed", "message": error}
        return files
    files["interactions.json"] = interactions
    files["scores.json"] = scores
    files["completed.json"] = signal
    return files


def episode_entry(episode: Episode, run_dir: str, infos: dict) -> dict:
    """What the run folder holds of one episode, as plain data (picklable: a job of several processes gathers the
    entries of every rank's episodes, :mod:`clemprm.distributed`): its instance key, its experiment's settings, its
    game's path and its files (:func:`episode_files`)."""
    return {"key": episode.instance.key,
            "experiment": {k: v for k, v in episode.instance.experiment.items() if k != "game_instances"},
            "game_path": str(getattr(episode.benchmark, "game_path", "")),
            "files": episode_files(episode, run_dir, infos)}


def write_results_tree(results_dir: str | Path, run_dir: str, entries: list[dict], *, infos: dict,
                       info: dict | None = None) -> Path:
    """Write the :func:`episode_entry` of every episode (played by the model of ``infos``: :func:`model_infos`) as the
    run folder ``<results_dir>/<run_dir>`` (module docstring); ``info`` goes into ``run.json`` as ``clemprm``. Returns
    the run folder (written by rank 0 alone in a job of several processes)."""
    import_clemcore()
    from clemcore import get_version

    final = Path(results_dir) / run_dir
    if not distributed.is_main():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    several = any(count > 1 for count in Counter(tuple(entry["key"]) for entry in entries).values())
    repeats: Counter = Counter()
    games: dict[str, dict] = {}
    for entry in entries:
        key = tuple(entry["key"])
        game, experiment_name, game_id = key
        repeat = repeats[key]
        repeats[key] += 1
        experiment_dir = tmp / game / experiment_name
        if not (experiment_dir / "experiment.json").exists():
            store_json({**entry["experiment"], "timestamp": datetime.now().isoformat(), "game_name": game,
                        "player_models": infos}, experiment_dir / "experiment.json")
        episode_dir = experiment_dir / episode_dir_name(game_id, repeat, several)
        if episode_dir.exists():
            raise ValueError(f"two episodes of {game}/{experiment_name}/{game_id} in one folder: {episode_dir.name}")
        for name, data in entry["files"].items():
            store_json(data, episode_dir / name)
        games.setdefault(game, {"game_path": entry["game_path"], "num_instances": 0})["num_instances"] += 1
    store_json({"clem_version": get_version(), "created": datetime.now().isoformat(), "player_models": infos,
                "games": games, "clemprm": info or {}}, tmp / "run.json")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final
