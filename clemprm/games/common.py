"""Helpers shared by the built-in games: parse modes, answer parsing, reprompt text, instance files.

Imported by the games' ``master.py`` files with an absolute import (clemcore loads ``master.py`` by file
path, so relative imports do not work there). This module does not import clemcore: the instance generators
use it too and stay fast to import.

Parse modes (``experiment["parse_mode"]``, default ``lenient``):

* ``strict``: the answer must contain a line that starts with the tag (case-insensitive, leading
  whitespace allowed), e.g. ``GUESS: 7``. The FIRST such line is the move; its value must be valid
  (an integer in range, or one of the option words), otherwise the answer is a violation.
* ``lenient``: a valid strict move wins; otherwise the first valid move found anywhere in the answer counts
  (the first integer in range; the first option word mentioned, case-insensitive, on word boundaries).
  So every answer valid under ``strict`` is valid under ``lenient`` with the same move.

Any string (also empty, or not a string at all) can be parsed: invalid answers give ``None``, never an error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

PARSE_MODES: tuple[str, ...] = ("strict", "lenient")
DEFAULT_PARSE_MODE = "lenient"
MAX_CONSECUTIVE_VIOLATIONS = 2
"""A violation is answered with one reprompt; the second consecutive violation aborts the episode."""

# characters that may decorate a tagged value, e.g. ``GUESS: <7>`` or ``ANSWER: "apple".``
_DECORATION = " \t*_`'\"<>()[]{}"
_INTEGER = re.compile(r"(?<![\w.\-])(\d+)(?!\w)(?!\.\d)")


def get_parse_mode(experiment: Mapping | None) -> str:
    """The experiment's ``parse_mode`` (``lenient`` when absent or None); raises ValueError on unknown modes."""
    mode = (experiment or {}).get("parse_mode") or DEFAULT_PARSE_MODE
    if mode not in PARSE_MODES:
        raise ValueError(f"unknown parse_mode {mode!r}; expected one of {PARSE_MODES}")
    return mode


def as_text(response) -> str:
    """A player's answer as a string: None becomes empty, other non-strings their ``str``."""
    if response is None:
        return ""
    if isinstance(response, bytes):
        return response.decode("utf-8", errors="replace")
    return response if isinstance(response, str) else str(response)


def _tag_line(tag: str) -> re.Pattern:
    return re.compile(rf"^[ \t]*{re.escape(tag)}[ \t]*:(?P<value>.*)$", re.IGNORECASE | re.MULTILINE)


def first_tagged_value(text: str, tag: str) -> str | None:
    """The rest of the first line starting with ``TAG:`` (None when no line does)."""
    match = _tag_line(tag).search(as_text(text))
    return None if match is None else match.group("value")


def tagged_block(text: str, tag: str) -> str | None:
    """Like :func:`first_tagged_value`, but when the tagged line is empty, the next non-empty line."""
    text = as_text(text)
    match = _tag_line(tag).search(text)
    if match is None:
        return None
    value = match.group("value").strip()
    if value:
        return value
    for line in text[match.end():].splitlines():
        if line.strip():
            return line.strip()
    return ""


def _integer_at_start(value: str, low: int, high: int) -> int | None:
    match = _INTEGER.match(value.lstrip(_DECORATION))
    if match is None or len(match.group(1)) > 9:
        return None
    number = int(match.group(1))
    return number if low <= number <= high else None


def parse_integer(text, tag: str, low: int, high: int, mode: str) -> int | None:
    """An integer move in ``low..high`` (see the module doc for the modes), or None."""
    text = as_text(text)
    value = first_tagged_value(text, tag)
    if value is not None:
        number = _integer_at_start(value, low, high)
        if number is not None:
            return number
    if mode == "strict":
        return None
    for match in _INTEGER.finditer(text):
        if len(match.group(1)) <= 9 and low <= int(match.group(1)) <= high:
            return int(match.group(1))
    return None


def _options_pattern(options: Iterable[str]) -> re.Pattern:
    # longest first, so that an option that is a prefix of another never shadows it
    words = sorted({o.lower() for o in options}, key=lambda w: (-len(w), w))
    return re.compile(r"(?<![\w-])(" + "|".join(re.escape(w) for w in words) + r")(?![\w-])", re.IGNORECASE)


def parse_option(text, tag: str, options: Sequence[str], mode: str) -> str | None:
    """One of ``options`` (returned as spelled in ``options``), or None. See the module doc for the modes."""
    text = as_text(text)
    if not options:
        return None
    by_lower = {o.lower(): o for o in options}
    pattern = _options_pattern(options)
    value = first_tagged_value(text, tag)
    if value is not None:
        match = pattern.match(value.lstrip(_DECORATION))
        if match is not None:
            return by_lower[match.group(1).lower()]
    if mode == "strict":
        return None
    match = pattern.search(text)
    return None if match is None else by_lower[match.group(1).lower()]


def mentions_word(text, word: str) -> bool:
    """Whether ``text`` contains ``word`` or its plural (``-s``/``-es``), case-insensitive, as a whole word."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?:e?s)?(?![\w-])", as_text(text), re.IGNORECASE) is not None


def collapse_whitespace(text: str, max_chars: int | None = None) -> str:
    """Runs of whitespace as single spaces; cut at a word boundary to at most ``max_chars``."""
    text = " ".join(as_text(text).split())
    if max_chars is not None and len(text) > max_chars:
        cut = text[:max_chars]
        text = cut.rsplit(" ", 1)[0] if " " in cut else cut
    return text


def format_line(tag: str, placeholder: str) -> str:
    """The answer format shown to players, e.g. ``GUESS: <number>``."""
    return f"{tag}: <{placeholder}>"


def reprompt_text(reason: str, answer_format: str) -> str:
    """The one reprompt a player gets after a violation: why, and the format again."""
    return f"Invalid answer: {reason}. Try again. Reply with one line in this format:\n{answer_format}"


def handle_violation(master, player, error, reprompt: str) -> None:
    """A game master's ``_on_parse_error`` for the built-in games: the violation is counted and logged; the player
    gets one reprompt (``reprompt``), and a second violation in a row aborts the episode."""
    master.consecutive_violations += 1
    master.info["parse_ok"] = False
    master.log_to_self("invalid format", error.reason)
    if master.consecutive_violations >= MAX_CONSECUTIVE_VIOLATIONS:
        master.reprompted = False
        master.log_to_self("game_result", "ABORT")
        master.state.abort()
    else:
        master.reprompted = True
        master.set_context_for(player, reprompt)


def log_outcome(master, *, aborted: bool, success: bool, lose: bool | None = None) -> None:
    """A game master's ``_on_after_game`` outcome keys: clemcore's Aborted, Lose and Success, each 0 or 1.

    An aborted episode is neither lost nor won. ``lose`` defaults to "ended, not aborted, not won"; a game
    that can be closed before its end (guessnumber) passes its own flag, so an unfinished episode logs 0/0/0."""
    from clemcore.clemgame.metrics import METRIC_ABORTED, METRIC_LOSE, METRIC_SUCCESS  # keeps this module clemcore-free
    lose = not success if lose is None else lose
    master.log_key(METRIC_ABORTED, int(aborted))
    master.log_key(METRIC_LOSE, int(lose and not aborted))
    master.log_key(METRIC_SUCCESS, int(success and not aborted))


def options_reason(options: Sequence[str]) -> str:
    """The reprompt reason for an answer naming none of the options."""
    return f"name one of the words {', '.join(options)}"


# ---------------------------------------------------------------------------------------------------------
# instance files


def dump_json(obj) -> str:
    """The canonical text of an instance file (stable across runs, so regeneration is byte-identical)."""
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def write_split_files(instances_by_split: Mapping[str, dict], out_dir: str | Path) -> list[Path]:
    """Writes ``instances_<split>.json`` files into ``out_dir`` (created if missing)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, instances in instances_by_split.items():
        path = out_dir / f"instances_{split}.json"
        path.write_text(dump_json(instances), encoding="utf-8")
        paths.append(path)
    return paths


def generate_split_files(build_instances, game_dir: Path, seed: int, out_dir: str | Path | None) -> dict[str, dict]:
    """Builds a game's instances from ``seed`` and writes them to ``out_dir`` (default: the game's ``in/``)."""
    by_split = build_instances(seed)
    write_split_files(by_split, game_dir / "in" if out_dir is None else out_dir)
    return by_split


def generator_cli(generate, description: str, argv=None) -> None:
    """The command line of every ``instancegenerator.py``: ``--seed`` and ``--out``."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the game's in/)")
    args = parser.parse_args(argv)
    generate(args.seed, args.out)


def split_sequence(items: Sequence, fractions: Sequence[float]) -> list[list]:
    """Cuts ``items`` into consecutive parts of the given fractions (the last part takes the rest)."""
    parts, start = [], 0
    for i, fraction in enumerate(fractions):
        end = len(items) if i == len(fractions) - 1 else start + round(fraction * len(items))
        parts.append(list(items[start:end]))
        start = end
    return parts


def load_lexicon(path: str | Path) -> dict[str, list[str]]:
    """A ``{category: [words]}`` lexicon; checks that words are unique, lowercase single words."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    categories = data["categories"]
    seen: dict[str, str] = {}
    for category, words in categories.items():
        for word in words:
            if not re.fullmatch(r"[a-z]+", word):
                raise ValueError(f"{path}: word {word!r} of {category!r} is not a lowercase single word")
            if word in seen:
                raise ValueError(f"{path}: word {word!r} in both {seen[word]!r} and {category!r}")
            seen[word] = category
    return data


def parse_free_text(text, tag: str, mode: str, max_chars: int) -> str | None:
    """A free-text move such as a description (whitespace collapsed, cut to ``max_chars``), or None.

    ``strict``: the text after the first line starting with ``TAG:`` (or, when that line is empty, the next
    non-empty line). ``lenient``: the same when the tag is there, else the whole answer. Empty text is None.
    """
    block = tagged_block(text, tag)
    if block is None:
        if mode == "strict":
            return None
        block = as_text(text)
    return collapse_whitespace(block, max_chars) or None


TURN_SCORES_EVENT = "turn scores"
"""The per-turn scores contract: a game that scores each answer on its own logs one event of this type (action
``content``: a ``{name: number}`` dict) at every answer, e.g. ``self.log_to_self(TURN_SCORES_EVENT, scores)``.
Hanabi does (its card's rewards); the RL stage's ``turn_scores`` reward source reads these events of any game."""


def turn_scores_of(interactions: dict) -> list[dict]:
    """The ``turn scores`` events of a recorder's interactions, one per answer, in order."""
    return [event["action"]["content"] for round_events in interactions["turns"] for event in round_events
            if event["action"]["type"] == TURN_SCORES_EVENT]
