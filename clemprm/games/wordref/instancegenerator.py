"""Writes wordref's ``in/instances_{train,validation,test}.json`` (deterministic for a seed).

Every category of ``resources/lexicon.json`` (12 words each) is shuffled and cut into train (6 words),
validation (3) and test (3) words; an instance only uses words of its split, so no word (target or distractor)
is in two splits. Within a split every target is used once. Experiments:

* ``different_category`` (easy): the three words come from three different categories;
* ``same_category`` (hard): the three words come from one category.

``game_id`` runs on across the splits of an experiment (train from 0, then validation, then test).

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
    for name, counts in EXPERIMENTS:
        game_id = 0
        for split in SPLITS:
            instances = []
            for _ in range(10_000):
                if len(instances) == counts[split]:
                    break
                triple, categories, target = _draw(name, words_by_split[split], rng)
                if target in used_targets[split]:
                    continue
                used_targets[split].add(target)
                order = rng.sample(range(3), 3)
                instances.append({
                    "game_id": game_id,
                    "target": target,
                    "target_category": categories[triple.index(target)],
                    "target_label": lexicon["labels"][categories[triple.index(target)]],
                    "words": [triple[i] for i in order],
                    "categories": [categories[i] for i in order],
                    "guesser_words": rng.sample(triple, 3),
                })
                game_id += 1
            if len(instances) < counts[split]:
                raise RuntimeError(f"wordref: cannot draw {counts[split]} {name} instances for {split}")
            by_split[split]["experiments"].append({
                "name": name,
                "parse_mode": DEFAULT_PARSE_MODE,
                "game_instances": instances,
            })
    return by_split


def generate(seed: int = 42, out_dir: str | Path | None = None) -> dict[str, dict]:
    """Builds the instances and writes them to ``out_dir`` (default: this game's ``in/``)."""
    return generate_split_files(build_instances, GAME_DIR, seed, out_dir)


if __name__ == "__main__":
    generator_cli(generate, __doc__)
