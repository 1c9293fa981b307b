"""Episode transcripts of our own, from the episode records: HTML pages for the Snakemake report and the dialogue
``clemprm inspect PATH --transcript N`` prints.

* :func:`dialogue`: an episode's messages in order: at each turn what the game told the player since its previous
  answer (a turn's ``messages`` are the player's whole perspective: the messages after its last answer are new), then
  the answer;
* :func:`episode_html`: the page of one episode: its outcome and the game's episode scores, then the dialogue;
* :func:`choices_html`: the page of a search's choices in one episode (eval episodes' ``choices``): at each turn where
  it chose, every candidate with its score, the one played marked;
* :func:`write_transcripts`: the ``eval_transcripts`` stage: per eval mode and game, the pages of one won and one lost
  episode.

Free of torch and clemcore, as :mod:`clemprm.evaluation.inspect`, which imports it.
"""

from __future__ import annotations

import html
import json
import logging
import math
from pathlib import Path
from typing import NamedTuple

from clemprm import records
from clemprm.modes import MODES

log = logging.getLogger(__name__)

GAME_MASTER = "Game Master"
# what a search's scores are, by the scorer of its mode (clemprm.modes.EvalMode.scorer)
SCORER_NAMES = {"prm": "the PRM's P(success)", "logprob": "the policy's mean token log-probability",
                "random": "a random score (the control: the pick is random)", "implicit": "PRIME's implicit PRM",
                "rule": "the rule reading each candidate's fork with no model (the control of a lookahead search)"}
STYLE = """body { font-family: sans-serif; max-width: 60em; margin: 1em auto; }
pre { white-space: pre-wrap; margin: 0.2em 0; font-family: monospace; }
.message { border-radius: 6px; padding: 0.4em 0.8em; margin: 0.5em 0; }
.game { background: #f0f0f0; margin-right: 6em; }
.answer { background: #dbeafe; margin-left: 6em; }
.speaker { font-size: small; color: #555; }
.outcome { font-weight: bold; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; vertical-align: top; }
tr.chosen { background: #dcfce7; font-weight: bold; }"""


class Line(NamedTuple):
    """One message of a transcript."""

    speaker: str
    text: str
    answer: bool   # the player's answer, else a message of the game to the player


def player_of(turn: dict) -> str:
    return f"{turn['player']} ({turn['game_role']})"


def new_messages(messages: list[dict]) -> list[dict]:
    """The messages after the player's last answer in its perspective: what the game told it since (on its first
    turn, all of them)."""
    last_answer = max((i for i, message in enumerate(messages) if message["role"] == "assistant"), default=-1)
    return messages[last_answer + 1:]


def dialogue(row: dict) -> list[Line]:
    """The episode's messages in order (see the module docstring)."""
    lines = []
    for turn in row["turns"]:
        player = player_of(turn)
        for message in new_messages(turn["messages"]):
            source = "System" if message["role"] == "system" else GAME_MASTER
            lines.append(Line(f"{source} → {player}", message["content"], False))
        lines.append(Line(player, turn["response"], True))
    return lines


def outcome(row: dict) -> str:
    """``won``, ``lost`` (played to the end, not won) or ``aborted``."""
    return "aborted" if row["aborted"] else "won" if row["success"] else "lost"


def outcome_line(row: dict) -> str:
    """The outcome, BENCH_SCORE where played, and the exception that ended the episode where one did."""
    text = f"outcome: {outcome(row)}"
    if not row["aborted"]:
        text += f", BENCH_SCORE {row['bench_score']:.1f}"
    return text + (f" (error: {row['error']})" if row.get("error") else "")


def heading(row: dict) -> str:
    """The episode id, with its mode and policy where the row has them."""
    mode = MODES.get(row.get("mode"))
    details = ([f"mode {row['mode']}" + (" (lookahead: candidates played in forks)" if mode and mode.regime ==
                                         "lookahead" else "")] if row.get("mode") else []) + [f"policy {row['policy']}"]
    return f"{row['episode_id']} ({', '.join(details)})"


# --- HTML ------------------------------------------------------------------------------------------------------

def page(title: str, body: list[str]) -> str:
    """A standalone HTML page."""
    return (f'<!DOCTYPE html>\n<html>\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
            f"<style>\n{STYLE}\n</style>\n</head>\n<body>\n<h1>{html.escape(title)}</h1>\n" + "\n".join(body)
            + "\n</body>\n</html>\n")


def outcome_html(row: dict) -> list[str]:
    """The outcome line and a table of the game scorer's episode scores."""
    scores = json.loads(row["episode_scores"] or "{}")
    cells = "".join(f"<tr><th>{html.escape(str(name))}</th><td>{html.escape(str(value))}</td></tr>\n"
                    for name, value in scores.items())
    return [f'<p class="outcome">{html.escape(outcome_line(row))}</p>',
            f"<table>\n<tr><th>episode score</th><th>value</th></tr>\n{cells}</table>" if scores else ""]


def message_html(line: Line) -> str:
    kind = "answer" if line.answer else "game"
    return (f'<div class="message {kind}"><div class="speaker">{html.escape(line.speaker)}</div>'
            f"<pre>{html.escape(line.text)}</pre></div>")


def episode_html(row: dict) -> str:
    """The page of one episode: outcome and episode scores, then every message of the dialogue."""
    return page(heading(row), outcome_html(row) + [message_html(line) for line in dialogue(row)])


def score_text(score: float) -> str:
    return "not scored (failed generation)" if score == -math.inf else f"{score:.4f}"


def candidate_html(index: int, text: str, score: float, chosen: bool) -> str:
    """A table row: the candidate's index, text and score; the played one marked."""
    tag, mark = ('<tr class="chosen">', "played") if chosen else ("<tr>", "")
    return (f"{tag}<td>{index}</td><td><pre>{html.escape(text)}</pre></td><td>{score_text(score)}</td>"
            f"<td>{mark}</td></tr>\n")


def choice_html(choice: dict, turn: dict | None) -> str:
    """One turn where the search chose: what the game last told the player, then every candidate with its score."""
    if turn is None:   # the game or the generation failed on the played candidate: no turn was recorded
        title, context = f"turn {choice['turn_idx']} (not played: the episode ended)", ""
    else:
        said = new_messages(turn["messages"])
        title = f"turn {choice['turn_idx']}: {player_of(turn)}"
        context = (f"<details><summary>what the game last said</summary><pre>{html.escape(said[-1]['content'])}"
                   f"</pre></details>" if said else "")
    rows = "".join(candidate_html(j, text, score, j == choice["chosen"])
                   for j, (text, score) in enumerate(zip(choice["candidates"], choice["scores"])))
    return (f"<h2>{html.escape(title)}</h2>\n{context}\n<table>\n<tr><th>#</th><th>candidate</th><th>score</th>"
            f"<th></th></tr>\n{rows}</table>")


def choices_html(row: dict) -> str:
    """The page of a search's choices in one episode: at each turn where it chose, the candidates and their scores
    (the played one marked; beam search plays by the aggregated score of a beam's turns, so its pick need not be the
    best of its turn)."""
    scorer = SCORER_NAMES[MODES[row["mode"]].scorer]
    turns = {turn["turn_idx"]: turn for turn in row["turns"]}
    return page(f"search choices: {heading(row)}",
                [f"<p>Scores: {html.escape(scorer)}.</p>", f'<p class="outcome">{html.escape(outcome_line(row))}</p>']
                + [choice_html(choice, turns.get(choice["turn_idx"])) for choice in row["choices"]])


# --- the eval_transcripts stage -------------------------------------------------------------------------------

def picked_episodes(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """Per game, the first won and the first lost episode where there are: ``{(game, "won" | "lost"): row}``; a lost
    one played to the end where there is one, else an aborted one."""
    picked = {}
    for row in sorted(rows, key=lambda row: row["aborted"]):   # stable: in file order, played episodes first
        picked.setdefault((row["game"], "won" if row["success"] else "lost"), row)
    return picked


def write_page(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_transcripts(mode_paths: list[str], folder: str) -> list[Path]:
    """Per eval mode (``results/eval/<mode>.parquet``) and game, the page of one won and one lost episode
    (:func:`picked_episodes`), ``<folder>/<mode>/<game>/<won|lost>.html``, and beside it, for a search, the page of its
    choices in that episode, ``<won|lost>_choices.html``. Returns the pages written."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    written = []
    for path in mode_paths:
        for (game, kind), row in picked_episodes(records.read_records(path, records.EVAL_EPISODES)).items():
            pages = Path(folder, row["mode"], game)
            written.append(write_page(pages / f"{kind}.html", episode_html(row)))
            if row["choices"]:
                written.append(write_page(pages / f"{kind}_choices.html", choices_html(row)))
    log.info("eval transcripts: %d pages in %s", len(written), folder)
    return written
