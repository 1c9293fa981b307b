"""What ``labels.k_first`` (two labelling rounds) would spend and keep on labels already made with all K.

    python -m clemprm.bench k_first --results runs/learning/seed-11/results [--k-first 1 2 3]
    python -m clemprm.bench k_first --labels results/labels/soft_labels.parquet

``--results`` reads a run's label shards (``labels/shards/*.parquet``: every continuation, together);
``--labels`` names soft-label files instead. A soft-label row keeps its continuations' scores in the order they
were seeded (continuation j from the branch point's seed and j alone), so the first n of them are exactly what a
first round of n plays. For each n this replays the stage's own decision (:func:`clemprm.stages.labels.settled_states`)
on them and reports: the continuations and the generated tokens spent (a settled candidate's tokens estimated as
n / K of its own), against all K; the states whose siblings' labels differ with all K (what a PRM learns to rank
from) that the second round still labels in full; and the states per continuation against all K (the labelling
budget's yield). Rows with continuation errors are counted as they are (their scores are the scored ones). Counts,
not timings: one repeat says it all.
"""

from __future__ import annotations

from pathlib import Path

from clemprm import records
from clemprm.bench import Figures, RunFiles
from clemprm.stages.labels import settled_states


def add_arguments(parser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--results", type=Path, help="a run's results folder: its label shards")
    source.add_argument("--labels", type=Path, nargs="+", help="soft-label files made with all K at once "
                        "(labels.k_first: null)")
    parser.add_argument("--k-first", type=int, nargs="+", default=[1, 2, 3])


def informative_states(rows: list[dict]) -> set[str]:
    """States with two or more labelled siblings whose labels differ."""
    labels: dict[str, set[float]] = {}
    for row in rows:
        labels.setdefault(row["prefix_id"], set()).add(round(row["label"], 9))
    return {prefix for prefix, seen in labels.items() if len(seen) > 1}


def run(args) -> Figures:
    paths = args.labels or RunFiles(args.results).label_shards()
    rows = [row for path in paths for row in records.read_records(path, records.SOFT_LABELS)]
    live = [row for row in rows if not row["terminal"]]
    k = max(row["k"] for row in rows)
    all_continuations = sum(row["k"] for row in live)
    all_tokens = sum(row["new_tokens"] for row in live)
    informative = informative_states(rows)
    figures = Figures("k_first")
    figures.note(f"{len(paths)} file(s): {len(rows)} candidates ({len(live)} with continuations), "
                 f"{len({row['prefix_id'] for row in rows})} states, K = {k}: {all_continuations} continuations, "
                 f"{all_tokens} new tokens; {len(informative)} states whose siblings' labels differ")
    for first in args.k_first:
        terminal = {index: (row["rollout_scores"][0],) for index, row in enumerate(rows) if row["terminal"]}
        outcomes = {index: [(score,) for score in row["rollout_scores"][:first]]
                    for index, row in enumerate(rows) if not row["terminal"]}
        settled = settled_states(rows, terminal, outcomes)
        spent = sum(min(first, row["k"]) if row["prefix_id"] in settled else row["k"] for row in live)
        tokens = sum(row["new_tokens"] * (min(first, row["k"]) / row["k"] if row["prefix_id"] in settled else 1)
                     for row in live if row["k"])
        kept = len(informative - settled)
        yield_ratio = (kept / spent) / (len(informative) / all_continuations) if informative else None
        figures.add(f"k_first {first}: settled states", len(settled), "states")
        figures.add(f"k_first {first}: continuations", spent / all_continuations, "of all K")
        figures.add(f"k_first {first}: new tokens", tokens / all_tokens, "of all K")
        figures.add(f"k_first {first}: informative kept", kept, f"of {len(informative)}")
        figures.add(f"k_first {first}: informative per continuation", yield_ratio, "x all K")
    return figures
