"""Parse-time checks of the games the config plays (:mod:`clemprm.checks.parse_time` runs them), from their
instances files and their code read as text (:mod:`clemprm.checks.game_code`); no game code runs.

* ``games.clembench_path`` is a clembench checkout and every game of ``games.clembench_games`` is found in it
  (:func:`clemprm.play.catalog.clembench_specs`) with an instances file that can be read, holds an instance and no
  ``game_id`` twice in one experiment (:func:`clemprm.play.catalog.instance_rows`); its Python imports resolve here
  and the NLTK data it downloads at import time is installed (offline the download fails and the game breaks later,
  inside a job);
* ``games.parse_mode_overrides`` and ``games.instances_files`` name played games; ``games.clembench_path`` is a
  folder when set;
* ``games.experiments`` names played games and experiments their instances files hold;
* every row of ``games.instance_list`` matches an instance of a played game (a warning under ``on_failure:
  continue``);
* with RL rewarded per turn on episodes, every played game logs per-turn scores;
* ``score.games`` (SCoRe's) holds single-player games only, each a configured game when SCoRe is part of the run
  (eval mode ``self_correct``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from clemprm.checks.game_code import (code_error, game_imports, importable, install_hint, logs_turn_scores,
                                      nltk_data_installed)


def clembench_problems(games: dict) -> list[str]:
    """Why the configured clembench games cannot be played here ([] when they can)."""
    from clemprm.play.catalog import clembench_specs, instance_rows, instances_file

    names = games.get("clembench_games") or []
    if not names:
        return []
    if not games.get("clembench_path"):
        return ["games.clembench_games is set but games.clembench_path is null"]
    try:
        specs = clembench_specs(games["clembench_path"])
    except ValueError as error:
        return [str(error)]
    problems = []
    chosen = games.get("instances_files") or {}
    for name in names:
        if name not in specs:
            problems.append(f"games.clembench_games: no game {name!r} in clembench checkout "
                            f"{games['clembench_path']} (found: {', '.join(sorted(specs)) or 'none'})")
            continue
        game_dir, spec = specs[name]
        try:   # a file that is not there, not JSON, repeats a game_id within an experiment, or holds no instance
            path = instances_file(game_dir, spec, chosen.get(name))
            if not instance_rows(path, name):
                problems.append(f"game {name!r}: instances file {path} holds no instance (each experiment's "
                                f"game_instances is empty): nothing to play")
        except ValueError as error:
            problems.append(str(error))
        try:
            modules, nltk_data = game_imports(game_dir)
        except (SyntaxError, ValueError, OSError) as error:   # ValueError: a null byte in the source
            problems.append(f"game {name!r}: cannot read its code: {code_error(error)}")
            continue
        missing = sorted(module for module in modules if not importable(module))
        if missing:
            problems.append(f"game {name!r} imports {', '.join(missing)}, not installed here ({install_hint(missing)})")
        absent = [package for package in nltk_data if not nltk_data_installed(package)]
        if absent:
            problems.append(f"game {name!r} needs the NLTK data {', '.join(absent)}, which NLTK does not find here "
                            f"(on a machine with network: python -m nltk.downloader -d DIR {' '.join(absent)}, then "
                            f"set NLTK_DATA=DIR; NLTK also refuses data writable by other accounts: chmod -R go-w "
                            f"DIR; docs/games.md: clembench games)")
    return problems


def unplayed_game_problems(games: dict) -> list[str]:
    """Keys that name a game the run does not play (``games.parse_mode_overrides``, ``games.instances_files``: a
    misspelled name would be ignored), ``games.instances_files`` naming a built-in game (its instances are built in,
    one file per split: the key chooses among a clembench game's files, and a path given for a built-in game was
    accepted unread), and a ``games.clembench_path`` that is no folder (also when no clembench game is played
    yet)."""
    played, problems = played_games(games), []
    for key in ("parse_mode_overrides", "instances_files"):
        for name in sorted(set(games.get(key) or {}) - set(played)):
            problems.append(f"games.{key} names {name!r}, which is not a game this run plays (games.builtin: "
                            f"{', '.join(games['builtin']) or 'none'}; games.clembench_games: "
                            f"{', '.join(games.get('clembench_games') or []) or 'none'})")
    for name in sorted(set(games.get("instances_files") or {}) & set(games["builtin"])):
        problems.append(f"games.instances_files names {name!r}, a built-in game: its instances are built in "
                        f"(clemprm/games/{name}/in/, one file per split); the key chooses the instances file of a "
                        f"clembench game (games.clembench_games): drop {name!r} from it")
    path = games.get("clembench_path")
    if path and not games.get("clembench_games") and not os.path.isdir(os.path.expanduser(path)):
        problems.append(f"games.clembench_path: {path} is not a directory (a clembench checkout; null when no "
                        f"clembench game is played)")
    return problems


def played_games(games: dict) -> list[str]:
    """The games a run plays: ``games.builtin`` and ``games.clembench_games``."""
    return list(games["builtin"]) + list(games.get("clembench_games") or [])


def experiment_problems(games: dict) -> list[str]:
    """Why ``games.experiments`` cannot select what it names: a game that is not configured, or an experiment its
    instances files do not hold. A clembench game that cannot be found is :func:`clembench_problems`' to report."""
    from clemprm.games import SPLITS, builtin_game_dir
    from clemprm.play.catalog import clembench_specs, experiment_names, instances_file

    selected = games.get("experiments") or {}
    clembench = games.get("clembench_games") or []
    specs = {}
    if any(game in clembench for game in selected) and games.get("clembench_path"):
        try:
            specs = clembench_specs(games["clembench_path"])
        except ValueError:
            specs = {}
    problems = []
    for game, names in sorted(selected.items()):
        try:
            if game in games["builtin"]:
                files = [builtin_game_dir(game) / "in" / f"instances_{split}.json" for split in SPLITS]
            elif game in clembench:
                if game not in specs:
                    continue
                game_dir, spec = specs[game]
                files = [instances_file(game_dir, spec, (games.get("instances_files") or {}).get(game))]
            else:
                problems.append(f"games.experiments.{game}: {game!r} is not a configured game (games.builtin: "
                                f"{', '.join(games['builtin']) or 'none'}; games.clembench_games: "
                                f"{', '.join(clembench) or 'none'})")
                continue
            known = set().union(*(experiment_names(path, game) for path in files))
        except ValueError as error:
            if game in clembench:
                continue   # clembench_problems names the instances file
            problems.append(f"games.experiments.{game}: {error}")
            continue
        unknown = [name for name in names if name not in known]
        if unknown:
            problems.append(f"games.experiments.{game}: no experiment {', '.join(map(repr, unknown))} in game "
                            f"{game!r} (known: {', '.join(sorted(known)) or 'none'})")
    return problems


UNMATCHED_SHOWN = 5
"""How many unmatched rows of an instance list a message quotes (then the count of all)."""


def instance_list_problems(games: dict) -> tuple[list[str], list[str]]:
    """``(why games.instance_list cannot be read, its rows that match no instance of a played game)``: an unknown
    game (no built-in game, none of the checkout: a misspelling), experiment or task_id, or a split the game does not
    hold it in; the first :data:`UNMATCHED_SHOWN` of them and their count. Rows of games this run does not play
    (:func:`other_games`) are left out, as the catalog leaves them: one list may serve several runs. The games'
    instances are read from their instances files (no game code runs)."""
    from clemprm.games import SPLITS
    from clemprm.play.catalog import read_instance_list

    path = games.get("instance_list")
    if not path:
        return [], []
    if not os.path.isfile(os.path.expanduser(path)):
        return [f"games.instance_list: {path} is not a file (relative to {os.getcwd()}; a playpen-data instances "
                f"table: parquet, csv, jsonl or json)"], []
    try:
        rows = read_instance_list(os.path.expanduser(path))
        known = instance_keys(games)
    except ValueError as error:
        return [f"games.instance_list: {error}"], []
    if known is None:   # a game that cannot be found: clembench_problems names it
        return [], []
    others = other_games(games)   # a shared list's rows of games this run does not play: not ours to judge
    unmatched = sorted(row for row in rows if row[0] not in others and row[:3] not in known.get(row[3], set()))
    if not unmatched:
        return [], []
    shown = "; ".join("/".join(map(str, row)) for row in unmatched[:UNMATCHED_SHOWN])
    more = f" and {len(unmatched) - UNMATCHED_SHOWN} more" if len(unmatched) > UNMATCHED_SHOWN else ""
    return [], [f"games.instance_list: {len(unmatched)} of {len(rows)} rows of {path} match no instance of a played "
                f"game (game/experiment/task_id/split): {shown}{more} (splits: {', '.join(SPLITS)}; games: "
                f"{', '.join(played_games(games))})"]


def other_games(games: dict) -> set[str]:
    """The games this run could play but does not: the other built-in games and the other games of the checkout."""
    from clemprm.games import BUILTIN_GAMES
    from clemprm.play.catalog import clembench_specs

    try:
        checkout = set(clembench_specs(games["clembench_path"])) if games.get("clembench_path") else set()
    except ValueError:   # clembench_problems names it
        checkout = set()
    return (set(BUILTIN_GAMES) | checkout) - set(played_games(games))


def instance_keys(games: dict) -> dict[str, set[tuple[str, str, int]]] | None:
    """Per split, the ``(game, experiment, game_id)`` an instance list may name: a built-in game's from its file of
    that split, a clembench game's from its instances file in every split (the list assigns them). None when a
    clembench game or its instances file cannot be found (:func:`clembench_problems` names it)."""
    from clemprm.games import SPLITS, builtin_game_dir
    from clemprm.play.catalog import clembench_specs, instances_file

    keys: dict[str, set] = {split: set() for split in SPLITS}
    for game in games["builtin"]:
        for split in SPLITS:
            keys[split] |= file_instance_keys(game, builtin_game_dir(game) / "in" / f"instances_{split}.json")
    clembench = games.get("clembench_games") or []
    try:
        specs = clembench_specs(games["clembench_path"]) if clembench else {}
        files = {game: instances_file(*specs[game], (games.get("instances_files") or {}).get(game))
                 for game in clembench}
    except (ValueError, KeyError, TypeError):   # TypeError: no clembench_path
        return None
    for game, path in files.items():
        found = file_instance_keys(game, path)
        for split in SPLITS:
            keys[split] |= found
    return keys


def file_instance_keys(game: str, path: Path) -> set[tuple[str, str, int]]:
    """The ``(game, experiment, game_id)`` of every instance of an instances file; ValueError naming the file
    (:func:`clemprm.play.catalog.instance_rows`)."""
    from clemprm.play.catalog import instance_rows

    return {(game, experiment["name"], int(instance["game_id"])) for experiment, instance in instance_rows(path, game)}


def turn_score_problems(config: dict) -> list[str]:
    """With RL rewarded per turn (``rl.reward.source: turn_scores``) on episodes (``rl.data: episodes``), every played
    game must log per-turn scores (:func:`clemprm.checks.game_code.logs_turn_scores`): the RL job would fail at a
    game that logs none after SFT and the first rollouts. A clembench game that cannot be found is
    :func:`clembench_problems`' to report."""
    from clemprm.config import TURN_REWARD_SOURCES
    from clemprm.games import builtin_game_dir
    from clemprm.play.catalog import clembench_specs

    rl, games = config["rl"], config["games"]
    if not rl["algorithms"] or rl["reward"]["source"] not in TURN_REWARD_SOURCES or rl["data"] != "episodes":
        return []
    folders = {game: builtin_game_dir(game) for game in games["builtin"]}
    if games.get("clembench_games"):
        try:
            specs = clembench_specs(games["clembench_path"])
        except (ValueError, TypeError):   # TypeError: no clembench_path
            specs = {}
        folders.update({game: specs[game][0] for game in games["clembench_games"] if game in specs})
    try:
        silent = [game for game, folder in folders.items() if not logs_turn_scores(folder)]
    except SyntaxError:   # a game file Python cannot decode: clembench_problems names it
        return []
    if not silent:
        return []
    return [f"rl.reward.source: turn_scores rewards each turn by the scores the game logs at it, and "
            f"{', '.join(silent)} log{'s' if len(silent) == 1 else ''} none (only games that log a 'turn scores' "
            f"event at every answer can, such as hanabi): use success_played or bench_score, or play only such games "
            f"(rl.data: states trains on hanabi's states alone)"]


def game_players(games: dict, name: str):
    """The ``players`` entry of the ``clemgame.json`` of a built-in game or a configured clembench game (None when
    neither has that name, or the clembench checkout cannot be read: :func:`clembench_problems` names it)."""
    from clemprm.games import BUILTIN_GAMES, builtin_game_dir
    from clemprm.play.catalog import clembench_specs

    if name in BUILTIN_GAMES:
        return json.loads((Path(builtin_game_dir(name)) / "clemgame.json").read_text()).get("players")
    if name in (games.get("clembench_games") or []) and games.get("clembench_path"):
        try:
            spec = clembench_specs(games["clembench_path"]).get(name)
        except ValueError:
            return None
        return None if spec is None else spec[1].get("players")
    return None


def single_player_problems(config: dict, *, in_use: bool = True) -> list[str]:
    """Why ``score.games`` cannot be SCoRe's games ([] when it can): a game with more than one player never can;
    ``in_use`` (SCoRe is part of the run): each must also be a configured game."""
    games = config["games"]
    problems = []
    for name in config["score"]["games"]:
        configured = name in games.get("builtin", []) or name in (games.get("clembench_games") or [])
        if in_use and not configured:
            problems.append(f"config key 'score.games': {name!r} is not a configured game "
                            f"(games.builtin or games.clembench_games)")
            continue
        players = game_players(games, name)
        if players is not None and players not in (1, "1", "one"):
            problems.append(f"config key 'score.games': {name!r} is not a single-player game (its clemgame.json has "
                            f"players: {players}); SCoRe's second attempt corrects one player's first attempt")
    return problems


def check_single_player_games(config: dict) -> None:
    """Raise ``ValueError`` naming ``score.games`` for the problems of :func:`single_player_problems`: SCoRe's stage
    checks its games itself, as a run may make it alone (``snakemake results/score/adapter``) where the parse-time
    check took SCoRe for no part of the run (``self_correct`` not in ``eval.modes``: an unconfigured game passed)."""
    problems = single_player_problems(config)
    if problems:
        raise ValueError("\n".join(problems))
