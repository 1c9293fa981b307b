"""Writes wordref's ``in/instances_{train,validation,test}.json`` (deterministic for a seed).

Every category of ``resources/lexicon.json`` (12 words each) is shuffled and cut into train (6 words),
validation (3) and test (3) words; an instance only uses words of its split, so no word (target or distractor)
is in two splits. Within a split every target is used once, except in the extra validation instances (below).
Experiments:

* ``different_category`` (easy): the three words come from three different categories;
* ``same_category`` (hard): the three words come from one category.

``game_id`` runs on across the splits of an experiment (train from 0, then validation, then test, then the extra
validation instances). The extra validation instances (:data:`EXTRA_VALIDATION` per experiment: 40 validation
instances per game, for held-out metrics whose intervals say something) are drawn after all the others from the
same validation words, every target once within its experiment (the 36 validation words cannot give 40 distinct
targets): the earlier instances stay exactly as they were.

    python -m clemprm.games.wordref.instancegenerator [--seed 42] [--out DIR]
"""

from __future__ import annotations

import random
from pathlib import Path

from clemprm.games.common import (DEFAULT_PARSE_MODE, generate_split_files, generator_cli, load_lexicon,
                                  split_sequence)

GAME_NAME = "wordref"
GAME_DIR = Path(__file__).resolve().parent
LEXICON = GAME_DIR / "resources" / "lexicon.json"
SPLITS = ("train", "validation", "test")
SPLIT_FRACTIONS = (0.5, 0.25, 0.25)
EXPERIMENTS = (
    ("different_category", {"train": 20, "validation": 10, "test": 10}),
    ("same_category", {"train": 20, "validation": 10, "test": 10}),
)
EXTRA_VALIDATION = 10   # per experiment, drawn last


def split_words(categories: dict[str, list[str]], rng: random.Random) -> dict[str, dict[str, list[str]]]:
    """``{split: {category: words}}``: each category's words shuffled and cut by :data:`SPLIT_FRACTIONS`."""
    by_split: dict[str, dict[str, list[str]]] = {split: {} for split in SPLITS}
    for category in sorted(categories):
        words = sorted(categories[category])
        rng.shuffle(words)
        for split, part in zip(SPLITS, split_sequence(words, SPLIT_FRACTIONS)):
            by_split[split][category] = part
    return by_split


def _draw(experiment: str, words: dict[str, list[str]], rng: random.Random) -> tuple[list[str], list[str], str]:
    """(three words, their categories, the target)."""
    if experiment == "same_category":
        category = rng.choice(sorted(words))
        triple = rng.sample(words[category], 3)
        categories = [category] * 3
    else:
        categories = rng.sample(sorted(words), 3)
        triple = [rng.choice(words[category]) for category in categories]
    target_index = rng.randrange(3)
    return triple, categories, triple[target_index]


def build_instances(seed: int = 42) -> dict[str, dict]:
    """``{split: {"experiments": [...]}}`` for all splits, without writing anything."""
    lexicon = load_lexicon(LEXICON)
    rng = random.Random(seed)
    words_by_split = split_words(lexicon["categories"], rng)
    by_split: dict[str, dict] = {split: {"experiments": []} for split in SPLITS}
    used_targets: dict[str, set[str]] = {split: set() for split in SPLITS}
    next_id = {}
    for name, counts in EXPERIMENTS:
        next_id[name] = 0
        for split in SPLITS:
            instances = draw_instances(name, lexicon, words_by_split[split], rng, used_targets[split], counts[split],
                                       next_id[name], split)
            next_id[name] += len(instances)
            by_split[split]["experiments"].append({
                "name": name,
                "parse_mode": DEFAULT_PARSE_MODE,
                "game_instances": instances,
            })
    for name, experiment in zip(next_id, by_split["validation"]["experiments"]):
        used = {instance["target"] for instance in experiment["game_instances"]}
        experiment["game_instances"] += draw_instances(name, lexicon, words_by_split["validation"], rng, used,
                                                       EXTRA_VALIDATION, next_id[name], "validation")
    return by_split


def draw_instances(name: str, lexicon: dict, words: dict[str, list[str]], rng: random.Random, used_targets: set[str],
                   count: int, first_id: int, split: str) -> list[dict]:
    """``count`` instances of experiment ``name`` from ``words``, ids from ``first_id``, each with a target not in
    ``used_targets`` (which gains them)."""
    instances = []
    for _ in range(10_000):
        if len(instances) == count:
            break
        triple, categories, target = _draw(name, words, rng)
        if target in used_targets:
            continue
        used_targets.add(target)
        order = rng.sample(range(3), 3)
        instances.append({
            "game_id": first_id + len(instances),
            "target": target,
            "target_category": categories[triple.index(target)],
            "target_label": lexicon["labels"][categories[triple.index(target)]],
            "words": [triple[i] for i in order],
            "categories": [categories[i] for i in order],
            "guesser_words": rng.sample(triple, 3),
        })
    if len(instances) < count:
        raise RuntimeError(f"wordref: cannot draw {count} {name} instances for {split}")
    return instances


def generate(seed: int = 42, out_dir: str | Path | None = None) -> dict[str, dict]:
    """Builds the instances and writes them to ``out_dir`` (default: this game's ``in/``)."""
    return generate_split_files(build_instances, GAME_DIR, seed, out_dir)


if __name__ == "__main__":
    generator_cli(generate, __doc__)
