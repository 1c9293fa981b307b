"""What is in a record file: schema, provenance, per-game statistics and a few shortened example rows; or one episode
as a transcript (``clemprm inspect PATH --transcript N``).

Works on any parquet file the pipeline writes; what is summarized depends only on which columns exist.
Kept free of torch/transformers/clemcore imports so ``clemprm inspect`` starts fast.
"""

from __future__ import annotations

import collections
import math
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from clemprm import records
from clemprm.checks.run_time import MARKS_KEY
from clemprm.evaluation.transcript import dialogue, heading, outcome_line

SHOWN_VERSIONS = ("clemprm", "clemcore", "transformers")
ELLIPSIS = "…"
GAME_COLUMNS = ("game", "meta.game")
# (aborted, success, bench_score): episodes carry their own outcome, branch points the outcome of their episode.
OUTCOME_COLUMNS = (("aborted", "success", "bench_score"),
                   ("episode_aborted", "episode_success", "episode_bench_score"))
STAT_COLUMNS = ("mode", "label", "n_turns", "meta.outcome", "k", "n_aborted", "n_success", "n_lost", "count",
                "parse_ok", "source")
# the answers records (clemprm.records.ANSWERS): one row per distinct answer, its plays counted
ANSWER_COLUMNS = ("count", "parse_ok", "source", "n_success", "n_lost", "n_aborted")


def inspect_file(path: str | Path, examples: int = 3, width: int = 100, bins: int = 10) -> str:
    """The full report on one record file; raises :class:`records.RecordFileError` naming an unreadable file."""
    table = read_file(path)
    lines = [f"{path}", f"rows: {table.num_rows}", "schema:"]
    lines += [f"  {line}" for line in schema_lines(table.schema)]
    provenance = records.read_provenance(path)
    lines.append(provenance_line(provenance))
    lines += [f"WARNING, the stage went on (on_failure: continue): {mark['message']}"
              for mark in provenance.get(MARKS_KEY, [])]
    groups = group_stats(table, bins)
    if groups:
        lines.append("per game:")
        for name, stats in groups.items():
            lines += [f"  {line}" for line in format_group(name, stats, width - 2)]
    indices = example_indices(table.num_rows, examples)
    for index, row in zip(indices, table.take(pa.array(indices, pa.int64())).to_pylist()):
        lines.append(f"example row {index}:")
        lines += format_example(row, width)
    return "\n".join(lines)


def read_file(path: str | Path) -> pa.Table:
    """The table of one record file; a folder is refused with the record files under it (pyarrow would read it as a
    dataset of every file there and fail on the first that is not parquet)."""
    if Path(path).is_dir():
        found = sorted(str(file) for file in Path(path).rglob("*.parquet"))
        shown = "\n  ".join(found[:20]) + (f"\n  ... and {len(found) - 20} more" if len(found) > 20 else "")
        raise records.RecordFileError(f"{path} is a folder: give one record file (a .parquet file); "
                                      + (f"under it:\n  {shown}" if found else "it holds none"))
    if not Path(path).exists():
        raise records.RecordFileError(f"record file {path} does not exist")
    return records.read_table(path)


def episode_transcript(path: str | Path, index: int) -> str:
    """Row ``index`` of an episodes file as a transcript: its heading, one line per message (the speaker, then the
    text, quoted, its line breaks as ``\\n``), the outcome. Raises :class:`records.RecordFileError` naming a file
    without episodes or without that row."""
    table = read_file(path)
    if "turns" not in table.column_names:
        raise records.RecordFileError(f"record file {path} holds no episodes (no turns column)")
    if not 0 <= index < table.num_rows:
        raise records.RecordFileError(f"record file {path} has no row {index} (it has {table.num_rows} rows)")
    row = table.slice(index, 1).to_pylist()[0]
    lines = [f"{line.speaker}: {quote(line.text, math.inf)}" for line in dialogue(row)]
    return "\n".join([heading(row), *lines, outcome_line(row)])


# --- schema and provenance -------------------------------------------------------------------------------------

def type_name(data_type: pa.DataType) -> str:
    """Arrow type without the ``item:``/``element:`` names arrow prints for list items."""
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return f"list<{type_name(data_type.value_type)}>"
    if pa.types.is_struct(data_type):
        fields = ", ".join(f"{field.name}: {type_name(field.type)}" for field in data_type)
        return f"struct<{fields}>"
    return str(data_type)


def schema_lines(schema: pa.Schema) -> list[str]:
    return [f"{field.name}: {type_name(field.type)}" for field in schema]


def provenance_line(provenance: dict) -> str:
    """Which config sections and main package versions made the file, on one line."""
    if not provenance:
        return "provenance: none"
    sections = ", ".join(sorted(provenance.get("config", {}))) or "none"
    versions = provenance.get("versions", {})
    shown = ", ".join(f"{name} {versions[name]}" for name in SHOWN_VERSIONS if name in versions)
    return f"provenance: config sections {sections}; {shown or 'no versions'}"


# --- per-game statistics ---------------------------------------------------------------------------------------

def stat_columns(table: pa.Table) -> dict[str, list]:
    """The columns the statistics use, as Python lists keyed by (dotted, for struct fields) name.

    ``n_turns`` is taken from the length of ``turns`` when only the nested list exists.
    """
    flat = table.flatten()
    wanted = GAME_COLUMNS + STAT_COLUMNS + tuple(name for names in OUTCOME_COLUMNS for name in names)
    columns = {name: flat.column(name).to_pylist() for name in wanted if name in flat.column_names}
    if "n_turns" not in columns and "turns" in table.column_names:
        columns["n_turns"] = pc.list_value_length(table.column("turns")).to_pylist()
    for name in GAME_COLUMNS:
        if name in columns:
            columns["game"] = columns.pop(name)
    return columns


def group_keys(columns: dict[str, list], n_rows: int) -> list[str]:
    """Each row's group: its game, and its mode too where eval episodes have one."""
    games = columns.get("game", ["all"] * n_rows)
    if "mode" in columns:
        return [f"{game} / {mode}" for game, mode in zip(games, columns["mode"])]
    return [str(game) for game in games]


def group_stats(table: pa.Table, bins: int = 10) -> dict[str, dict]:
    """Statistics per group (see :func:`group_keys`), sorted by name, plus ``all`` when there are several."""
    columns = stat_columns(table)
    rows_of = collections.defaultdict(list)
    for index, key in enumerate(group_keys(columns, table.num_rows)):
        rows_of[key].append(index)
    groups = {key: rows_stats(columns, rows_of[key], bins) for key in sorted(rows_of)}
    if len(groups) > 1:
        groups["all"] = rows_stats(columns, list(range(table.num_rows)), bins)
    return groups


def rows_stats(columns: dict[str, list], indices: list[int], bins: int) -> dict:
    """The statistics of the rows at ``indices``, for every statistic whose columns exist."""
    def values(name):
        return [columns[name][index] for index in indices]

    stats = {"rows": len(indices)}
    if "label" in columns:
        stats["label"] = label_stats(values("label"), bins)
    outcome = outcome_columns(columns)
    if outcome:
        aborted, success, bench_score = outcome
        stats.update(outcome_stats(values(aborted), values(success),
                                   values(bench_score) if bench_score in columns else None))
        stats["outcome_of"] = "episode" if aborted.startswith("episode_") else "row"
    if "n_turns" in columns:
        stats["mean_turns"] = mean(values("n_turns"))
    if "meta.outcome" in columns:
        stats["outcomes"] = dict(sorted(collections.Counter(values("meta.outcome")).items()))
    if {"k", "n_aborted", "n_success"} <= columns.keys():
        stats.update(continuation_stats(values("k"), values("n_aborted"), values("n_success")))
    if set(ANSWER_COLUMNS) <= columns.keys():
        stats["answers"] = answer_stats(*map(values, ANSWER_COLUMNS))
    return stats


def outcome_columns(columns: dict[str, list]) -> tuple[str, str, str] | None:
    """The row's own outcome columns, else those of its episode (branch points); None when there are neither."""
    for names in OUTCOME_COLUMNS:
        if names[0] in columns and names[1] in columns:
            return names
    return None


def present(values: list) -> list:
    """Values without nulls and NaNs."""
    return [value for value in values if value is not None and not (isinstance(value, float) and math.isnan(value))]


def mean(values: list) -> float:
    values = present(values)
    return statistics.fmean(values) if values else math.nan


def label_stats(labels: list, bins: int) -> dict:
    """Mean, population std, min, max and histogram counts over [0, 1] of the (non-missing) labels."""
    labels = present(labels)
    if not labels:
        return {"n": 0, "mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan,
                "histogram": [0] * bins}
    return {"n": len(labels), "mean": statistics.fmean(labels), "std": statistics.pstdev(labels),
            "min": min(labels), "max": max(labels), "histogram": histogram(labels, bins)}


def histogram(values: list[float], bins: int) -> list[int]:
    """Counts in ``bins`` equal bins over [0, 1]; the last bin includes 1, values outside go to the edge bins."""
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, max(0, math.floor(value * bins)))] += 1
    return counts


def outcome_stats(aborted: list, success: list, bench_score: list | None) -> dict:
    """Abort and success rates; mean BENCH_SCORE of the rows that were played to the end."""
    stats = {"abort_rate": mean(aborted), "success_rate": mean(success)}
    if bench_score is not None:
        stats["bench_score"] = mean([score for score, was_aborted in zip(bench_score, aborted) if not was_aborted])
    return stats


def continuation_stats(k: list, n_aborted: list, n_success: list) -> dict:
    """Mean K and the share of all continuations that aborted / succeeded (NaN when none were played). Rows with
    ``k == 0`` (terminal branch points) played no continuation: their counts describe the candidate's own outcome."""
    rows = [(n, a, s) for n, a, s in zip(k, n_aborted, n_success) if n]
    played = sum(n for n, _, _ in rows)
    return {"mean_k": mean(k),
            "continuation_abort_rate": sum(a or 0 for _, a, _ in rows) / played if played else math.nan,
            "continuation_success_rate": sum(s or 0 for _, _, s in rows) / played if played else math.nan}


def answer_stats(count: list, parse_ok: list, source: list, n_success: list, n_lost: list, n_aborted: list) -> dict:
    """Of answers records: the distinct answers and their plays, the share the game accepted (of each), how the
    plays' episodes ended (shares of the plays) and the distinct answers by the source that first played them."""
    plays = sum(count)
    ended = {"won": sum(n_success), "lost": sum(n_lost), "aborted": sum(n_aborted)}
    return {"distinct": len(count), "plays": plays,
            "accepted": mean([float(ok) for ok in parse_ok]),
            "accepted_plays": sum(n for n, ok in zip(count, parse_ok) if ok) / plays if plays else math.nan,
            "ended": {outcome: n / plays if plays else math.nan for outcome, n in ended.items()},
            "sources": dict(collections.Counter(source))}


def format_group(name: str, stats: dict, width: int) -> list[str]:
    """One group's statistics as text lines: a headline, then outcomes, continuations and the label histogram."""
    headline = [f"{name}: {stats['rows']} rows"]
    if "abort_rate" in stats:
        of = " (episode)" if stats["outcome_of"] == "episode" else ""
        headline.append(f"abort{of} {percent(stats['abort_rate'])}, success{of} {percent(stats['success_rate'])}")
        if "bench_score" in stats:
            headline.append(f"bench_score{of} {stats['bench_score']:.1f}")
    if "mean_turns" in stats:
        headline.append(f"turns {stats['mean_turns']:.2f}")
    lines = [", ".join(headline)]
    if "outcomes" in stats:
        lines.append("  outcomes: " + ", ".join(f"{outcome} {n}" for outcome, n in stats["outcomes"].items()))
    if "mean_k" in stats:
        lines.append(f"  k {stats['mean_k']:.2f}, continuations aborted {percent(stats['continuation_abort_rate'])}"
                     f", succeeded {percent(stats['continuation_success_rate'])}")
    if "answers" in stats:
        answers = stats["answers"]
        ended = ", ".join(f"{outcome} {percent(rate)}" for outcome, rate in answers["ended"].items())
        lines.append(f"  answers: {answers['distinct']} distinct, {answers['plays']} plays; accepted "
                     f"{percent(answers['accepted'])} (of the plays {percent(answers['accepted_plays'])}); "
                     f"plays ended {ended}")
        lines.append("  first played in: " + ", ".join(f"{source} {n}" for source, n in answers["sources"].items()))
    if "label" in stats:
        label = stats["label"]
        lines.append(f"  label: mean {label['mean']:.3f}, std {label['std']:.3f}, "
                     f"min {label['min']:.3f}, max {label['max']:.3f}")
        lines += [f"    {line}" for line in histogram_lines(label["histogram"], width - 4)]
    return lines


def percent(rate: float) -> str:
    return "n/a" if math.isnan(rate) else f"{100 * rate:.1f}%"


def histogram_lines(counts: list[int], width: int) -> list[str]:
    """One line per bin: its range, its count and a bar of ``#`` (the fullest bin fills the width)."""
    bins = len(counts)
    count_width = len(str(max(counts, default=0)))
    lines = []
    for index, count in enumerate(counts):
        closing = "]" if index == bins - 1 else ")"
        prefix = f"[{index / bins:.2f}, {(index + 1) / bins:.2f}{closing} {count:>{count_width}} "
        room = max(1, width - len(prefix))
        bar = math.ceil(room * count / max(counts)) if count else 0
        lines.append((prefix + "#" * bar).rstrip())
    return lines


# --- example rows ----------------------------------------------------------------------------------------------

def example_indices(n_rows: int, n: int) -> list[int]:
    """``n`` row indices spread evenly from the first row to the last (files are sorted by game)."""
    if n <= 0 or n_rows == 0:
        return []
    if n >= n_rows:
        return list(range(n_rows))
    if n == 1:
        return [0]
    return sorted({round(i * (n_rows - 1) / (n - 1)) for i in range(n)})


def format_example(row: dict, width: int) -> list[str]:
    """One line per column, each at most ``width`` characters."""
    lines = []
    for name, value in row.items():
        prefix = f"  {name}: "
        lines.append(prefix + format_value(value, max(width - len(prefix), 8)))
    return lines


def format_value(value, limit: int) -> str:
    """A value as at most ``limit`` characters: strings quoted, lists and structs summarized."""
    if isinstance(value, list):
        return format_list(value, limit)
    if isinstance(value, dict):
        return format_struct(value, limit)
    if isinstance(value, str):
        return quote(value, limit)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    return shorten(str(value), limit)


def quote(text: str, limit: int) -> str:
    return '"' + shorten(text.replace("\n", "\\n"), max(limit - 2, 1)) + '"'


def shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(limit - 1, 0)] + ELLIPSIS


def format_struct(value: dict, limit: int) -> str:
    """A message as ``role: "content"``, a turn as ``game_role: "response"``, other structs as ``{key: value}``."""
    if value.keys() >= {"role", "content"}:
        head = f"{value['role']}: "
        return head + quote(value["content"] or "", limit - len(head))
    if value.keys() >= {"turn_idx", "response"}:
        head = f"{value.get('game_role') or value.get('player')}: "
        return head + quote(value["response"] or "", limit - len(head))
    fields = ", ".join(f"{key}: {format_value(item, limit)}" for key, item in value.items())
    return shorten("{" + fields + "}", limit)


def format_list(values: list, limit: int) -> str:
    """``[N messages] first … last`` for lists of structs; all items (as many as fit) for lists of scalars.

    The first message of a perspective is the long game prompt and the last the answer, hence first and last.
    """
    head = f"[{len(values)} {list_noun(values)}{'' if len(values) == 1 else 's'}]"
    if not values:
        return head
    if not isinstance(values[0], dict):
        items = ", ".join(format_value(item, limit) for item in values)
        return shorten(f"{head} {items}", limit)
    room = limit - len(head) - 1
    if len(values) == 1:
        return f"{head} {format_value(values[0], room)}"
    separator = " … " if len(values) > 2 else ", "
    last = format_value(values[-1], (room - len(separator)) // 2)  # the last item leaves any room it does not use
    first = format_value(values[0], room - len(separator) - len(last))
    return shorten(f"{head} {first}{separator}{last}", limit)


def list_noun(values: list) -> str:
    first = values[0] if values else None
    if isinstance(first, dict) and first.keys() >= {"role", "content"}:
        return "message"
    if isinstance(first, dict) and "turn_idx" in first:
        return "turn"
    return "item"
