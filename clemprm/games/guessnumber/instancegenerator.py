"""Writes guessnumber's ``in/instances_{train,validation,test}.json`` (deterministic for a seed).

Each experiment's secret numbers are shuffled and cut into disjoint train/validation/test parts, so no
(experiment, target) pair is in two splits. ``game_id`` runs on across the splits of an experiment
(train from 0, then validation, then test, then the extra validation instances), so ``(game, experiment,
game_id)`` names one instance everywhere. The extra validation instances (:data:`EXTRA_VALIDATION`, from the
experiments with numbers to spare: 40 validation instances in all, for held-out metrics whose intervals say
something) take the secret numbers drawn after all the others: the earlier instances stay exactly as they were.

    python -m clemprm.games.guessnumber.instancegenerator [--seed 42] [--out DIR]
"""

from __future__ import annotations

import random
from pathlib import Path

from clemprm.games.common import DEFAULT_PARSE_MODE, generate_split_files, generator_cli

GAME_NAME = "guessnumber"
GAME_DIR = Path(__file__).resolve().parent

# name, N (secret number in 1..N), M (guesses; enough for binary search), instances per split
EXPERIMENTS = (
    ("range10", 10, 4, {"train": 4, "validation": 3, "test": 3}),
    ("range20", 20, 5, {"train": 10, "validation": 5, "test": 5}),
    ("range50", 50, 6, {"train": 13, "validation": 6, "test": 6}),
    ("range100", 100, 7, {"train": 13, "validation": 6, "test": 6}),
)
SPLITS = ("train", "validation", "test")
EXTRA_VALIDATION = {"range50": 10, "range100": 10}   # per experiment, drawn last


def build_instances(seed: int = 42) -> dict[str, dict]:
    """``{split: {"experiments": [...]}}`` for all splits, without writing anything."""
    by_split: dict[str, dict] = {split: {"experiments": []} for split in SPLITS}
    for index, (name, max_number, max_guesses, counts) in enumerate(EXPERIMENTS):
        rng = random.Random(seed * 1000 + index)
        extra = EXTRA_VALIDATION.get(name, 0)
        # drawn one after the other: the extra numbers come after (and leave as they were) the splits' numbers
        targets = rng.sample(range(1, max_number + 1), sum(counts.values()) + extra)
        extra_targets = targets[len(targets) - extra:]
        game_id = 0
        for split in SPLITS:
            part, targets = targets[:counts[split]], targets[counts[split]:]
            instances = []
            for target in part:
                instances.append({"game_id": game_id, "target": target})
                game_id += 1
            by_split[split]["experiments"].append({
                "name": name,
                "parse_mode": DEFAULT_PARSE_MODE,
                "max_number": max_number,
                "max_guesses": max_guesses,
                "game_instances": instances,
            })
        by_split["validation"]["experiments"][-1]["game_instances"] += [
            {"game_id": game_id + i, "target": target} for i, target in enumerate(extra_targets)]
    return by_split


def generate(seed: int = 42, out_dir: str | Path | None = None) -> dict[str, dict]:
    """Builds the instances and writes them to ``out_dir`` (default: this game's ``in/``)."""
    return generate_split_files(build_instances, GAME_DIR, seed, out_dir)


if __name__ == "__main__":
    generator_cli(generate, __doc__)
