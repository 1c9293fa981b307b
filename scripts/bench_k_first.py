"""Benchmark: what ``labels.k_first`` (two labelling rounds) would spend and keep on labels already made with all K.

    python scripts/bench_k_first.py results/labels/soft_labels.parquet [--k-first 1 2 3]
    python scripts/bench_k_first.py results/labels/shards/*.parquet        (the shards of a run, together)

A soft-label row keeps its continuations' scores in the order they were seeded (continuation j from the branch point's
seed and j alone), so the first n of them are exactly what a first round of n plays. For each n this replays the
stage's own decision (:func:`clemprm.stages.labels.settled_states`) on them and prints: the continuations and the
generated tokens spent (a settled candidate's tokens estimated as n / K of its own), against all K; the states whose
siblings' labels differ with all K (what a PRM learns to rank from) that the second round still labels in full; and
the states per continuation against all K (the labelling budget's yield). Rows with continuation errors are counted
as they are (their scores are the scored ones).
"""

from __future__ import annotations

import argparse

from clemprm import records
from clemprm.stages.labels import settled_states


def informative_states(rows: list[dict]) -> set[str]:
    """States with two or more labelled siblings whose labels differ."""
    labels: dict[str, set[float]] = {}
    for row in rows:
        labels.setdefault(row["prefix_id"], set()).add(round(row["label"], 9))
    return {prefix for prefix, seen in labels.items() if len(seen) > 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("labels", nargs="+", help="soft-label files made with all K at once (labels.k_first: null)")
    parser.add_argument("--k-first", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    rows = [row for path in args.labels for row in records.read_records(path, records.SOFT_LABELS)]
    live = [row for row in rows if not row["terminal"]]
    k = max(row["k"] for row in rows)
    all_continuations = sum(row["k"] for row in live)
    all_tokens = sum(row["new_tokens"] for row in live)
    informative = informative_states(rows)
    print(f"{' '.join(args.labels)}: {len(rows)} candidates ({len(live)} with continuations), "
          f"{len({row['prefix_id'] for row in rows})} states, K = {k}: {all_continuations} continuations, "
          f"{all_tokens} new tokens; {len(informative)} states whose siblings' labels differ")
    print(f"{'k_first':>7} {'settled states':>14} {'continuations':>18} {'new tokens':>18} "
          f"{'informative kept':>16} {'informative states per continuation':>36}")
    for first in args.k_first:
        terminal = {index: (row["rollout_scores"][0],) for index, row in enumerate(rows) if row["terminal"]}
        outcomes = {index: [(score,) for score in row["rollout_scores"][:first]]
                    for index, row in enumerate(rows) if not row["terminal"]}
        settled = settled_states(rows, terminal, outcomes)
        spent = sum(min(first, row["k"]) if row["prefix_id"] in settled else row["k"] for row in live)
        tokens = sum(row["new_tokens"] * (min(first, row["k"]) / row["k"] if row["prefix_id"] in settled else 1)
                     for row in live if row["k"])
        kept = len(informative - settled)
        yield_ratio = (kept / spent) / (len(informative) / all_continuations) if informative else float("nan")
        print(f"{first:>7} {len(settled):>14} {spent:>8} ({spent / all_continuations:>5.0%}) "
              f"{tokens:>8.0f} ({tokens / all_tokens:>5.0%}) {kept:>9} of {len(informative):<4} "
              f"{yield_ratio:>30.2f}x")


if __name__ == "__main__":
    main()
