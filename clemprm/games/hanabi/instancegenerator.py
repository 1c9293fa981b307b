"""Writes hanabi's ``in/instances_{train,validation,test}.json`` (deterministic for a seed).

An experiment is a deck (``colours``, ``ranks``, ``rank_counts``, ``hand_size``, ``hint_tokens``, ``fuse_tokens``);
an instance is one order of that deck (``deck``: the cards in draw order, e.g. ``"R1 Y3 ..."``), shuffled from the
seed. No deck order is in two splits (nor twice in one). Experiments:

* ``small``: 2 colours (red, yellow), ranks 1-3 (3, 2, 1 copies), hands of 3, 4 hint and 3 fuse tokens: 12 cards,
  max score 6, short prompts (the embedded SmolLM2);
* ``full``: the standard game: 5 colours, ranks 1-5 (3, 2, 2, 2, 1 copies), hands of 5, 8 hint and 3 fuse
  tokens: 50 cards, max score 25 (cluster models).

``game_id`` runs on across the splits of an experiment (train from 0, then validation, then test).

    python -m clemprm.games.hanabi.instancegenerator [--seed 42] [--out DIR]
"""

from __future__ import annotations

import random
from pathlib import Path

from clemprm.games.common import DEFAULT_PARSE_MODE, generate_split_files, generator_cli
from clemprm.games.hanabi.rules import DeckConfig

GAME_NAME = "hanabi"
GAME_DIR = Path(__file__).resolve().parent
SPLITS = ("train", "validation", "test")
COUNTS = {"train": 50, "validation": 10, "test": 10}
EXPERIMENTS = (
    ("small", {"colours": ["red", "yellow"], "ranks": 3, "rank_counts": [3, 2, 1], "hand_size": 3,
               "hint_tokens": 4, "fuse_tokens": 3}),
    ("full", {"colours": ["red", "yellow", "green", "blue", "white"], "ranks": 5, "rank_counts": [3, 2, 2, 2, 1],
              "hand_size": 5, "hint_tokens": 8, "fuse_tokens": 3}),
)


def build_instances(seed: int = 42) -> dict[str, dict]:
    """``{split: {"experiments": [...]}}`` for all splits, without writing anything."""
    by_split: dict[str, dict] = {split: {"experiments": []} for split in SPLITS}
    for index, (name, deck_settings) in enumerate(EXPERIMENTS):
        config = DeckConfig.from_experiment({"name": name, **deck_settings})
        rng = random.Random(seed * 1000 + index)
        cards = [config.card_text(card) for card in config.full_deck()]
        used: set[str] = set()
        game_id = 0
        for split in SPLITS:
            instances = []
            while len(instances) < COUNTS[split]:
                rng.shuffle(cards)
                deck = " ".join(cards)
                if deck in used:
                    continue
                used.add(deck)
                instances.append({"game_id": game_id, "deck": deck})
                game_id += 1
            by_split[split]["experiments"].append({
                "name": name, "parse_mode": DEFAULT_PARSE_MODE, **deck_settings, "game_instances": instances})
    return by_split


def generate(seed: int = 42, out_dir: str | Path | None = None) -> dict[str, dict]:
    """Builds the instances and writes them to ``out_dir`` (default: this game's ``in/``)."""
    return generate_split_files(build_instances, GAME_DIR, seed, out_dir)


if __name__ == "__main__":
    generator_cli(generate, __doc__)
