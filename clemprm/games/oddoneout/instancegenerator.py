"""Writes oddoneout's ``in/instances_{train,validation,test}.json`` (deterministic for a seed).

Every category of ``resources/lexicon.json`` (12 words each) is shuffled and cut into train (6 words),
validation (3) and test (3) words; an instance only uses words of its split, so no word is in two splits.
Within a split every odd word is used once, except in the extra validation instances (below). An instance: three
words of one category plus one odd word, shuffled. Experiments:

* ``different_domain`` (easy): the odd word's category is in another domain (e.g. fruits + a tool);
* ``same_domain`` (hard): the odd word's category is a sibling in the same domain (e.g. fruits + a vegetable).

``game_id`` runs on across the splits of an experiment (train from 0, then validation, then test, then the extra
validation instances). The extra validation instances (:data:`EXTRA_VALIDATION` per experiment: 40 validation
instances per game, for held-out metrics whose intervals say something) are drawn after all the others from the
same validation words, every odd word once within its experiment (the 36 validation words cannot give 40 distinct
odd words): the earlier instances stay exactly as they were.

    python -m clemprm.games.oddoneout.instancegenerator [--seed 42] [--out DIR]
"""

from __future__ import annotations

import random
from pathlib import Path

from clemprm.games.common import (DEFAULT_PARSE_MODE, generate_split_files, generator_cli, load_lexicon,
                                  split_sequence)

GAME_NAME = "oddoneout"
GAME_DIR = Path(__file__).resolve().parent
LEXICON = GAME_DIR / "resources" / "lexicon.json"
SPLITS = ("train", "validation", "test")
SPLIT_FRACTIONS = (0.5, 0.25, 0.25)
MAX_ATTEMPTS = 2
EXPERIMENTS = (
    ("different_domain", {"train": 20, "validation": 10, "test": 10}),
    ("same_domain", {"train": 20, "validation": 10, "test": 10}),
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


def domain_of(lexicon: dict) -> dict[str, str]:
    """Category -> domain (a category in no domain is its own domain)."""
    domains = {category: category for category in lexicon["categories"]}
    for domain, categories in lexicon["domains"].items():
        for category in categories:
            domains[category] = domain
    return domains


def _draw(experiment: str, lexicon: dict, words: dict[str, list[str]], rng: random.Random):
    """(shared category, odd category, three words of the shared category, odd word)."""
    domains = domain_of(lexicon)
    categories = sorted(words)
    if experiment == "same_domain":
        category = rng.choice([c for c in categories if c in sum(lexicon["domains"].values(), [])])
        odd_category = rng.choice([c for c in categories if domains[c] == domains[category] and c != category])
    else:
        category = rng.choice(categories)
        odd_category = rng.choice([c for c in categories if domains[c] != domains[category]])
    return category, odd_category, rng.sample(words[category], 3), rng.choice(words[odd_category])


def build_instances(seed: int = 42) -> dict[str, dict]:
    """``{split: {"experiments": [...]}}`` for all splits, without writing anything."""
    lexicon = load_lexicon(LEXICON)
    rng = random.Random(seed)
    words_by_split = split_words(lexicon["categories"], rng)
    by_split: dict[str, dict] = {split: {"experiments": []} for split in SPLITS}
    used_odd_words: dict[str, set[str]] = {split: set() for split in SPLITS}
    next_id = {}
    for name, counts in EXPERIMENTS:
        next_id[name] = 0
        for split in SPLITS:
            instances = draw_instances(name, lexicon, words_by_split[split], rng, used_odd_words[split], counts[split],
                                       next_id[name], split)
            next_id[name] += len(instances)
            by_split[split]["experiments"].append({
                "name": name,
                "parse_mode": DEFAULT_PARSE_MODE,
                "max_attempts": MAX_ATTEMPTS,
                "game_instances": instances,
            })
    for name, experiment in zip(next_id, by_split["validation"]["experiments"]):
        used = {instance["odd_word"] for instance in experiment["game_instances"]}
        experiment["game_instances"] += draw_instances(name, lexicon, words_by_split["validation"], rng, used,
                                                       EXTRA_VALIDATION, next_id[name], "validation")
    return by_split


def draw_instances(name: str, lexicon: dict, words: dict[str, list[str]], rng: random.Random, used_odd_words: set[str],
                   count: int, first_id: int, split: str) -> list[dict]:
    """``count`` instances of experiment ``name`` from ``words``, ids from ``first_id``, each with an odd word not in
    ``used_odd_words`` (which gains them)."""
    instances = []
    for _ in range(10_000):
        if len(instances) == count:
            break
        category, odd_category, triple, odd_word = _draw(name, lexicon, words, rng)
        if odd_word in used_odd_words:
            continue
        used_odd_words.add(odd_word)
        instances.append({
            "game_id": first_id + len(instances),
            "words": rng.sample(triple + [odd_word], 4),
            "odd_word": odd_word,
            "category": category,
            "category_label": lexicon["labels"][category],
            "odd_category": odd_category,
        })
    if len(instances) < count:
        raise RuntimeError(f"oddoneout: cannot draw {count} {name} instances for {split}")
    return instances


def generate(seed: int = 42, out_dir: str | Path | None = None) -> dict[str, dict]:
    """Builds the instances and writes them to ``out_dir`` (default: this game's ``in/``)."""
    return generate_split_files(build_instances, GAME_DIR, seed, out_dir)


if __name__ == "__main__":
    generator_cli(generate, __doc__)
