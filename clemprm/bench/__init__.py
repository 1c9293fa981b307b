"""The benchmarks, behind one door: ``python -m clemprm.bench NAME [options]`` (``--list`` lists them).

Every module of this package but ``__main__`` is one benchmark. It exposes ``add_arguments(parser)`` (its own
options; the door adds the shared ``--workdir``, ``--repeat`` and ``--json``) and ``run(args) -> Figures``. A
benchmark that compares two or more ways side by side runs them interleaved, A B A B, ``--repeat`` times itself and
says so with ``REPEATS_ITSELF = True``; the door runs any other benchmark ``--repeat`` times whole. Either way each
figure keeps one sample per repeat, and the door prints one table (min / median / max over the repeats, and each
ratio taken per repeat from the two figures measured together) and writes it as JSON with ``--json``.

The top floor of the library: a benchmark may import from every floor below, and nothing imports it.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Figure:
    """One measured quantity: a sample per repeat."""

    unit: str
    samples: list[float] = field(default_factory=list)
    ratio_of: tuple[str, str] | None = None   # (numerator, denominator) figures, for a ratio

    def summary(self) -> dict:
        values = [value for value in self.samples if value is not None]
        spread = ({"min": min(values), "median": statistics.median(values), "max": max(values)} if values
                  else {"min": None, "median": None, "max": None})
        return {"unit": self.unit, "samples": self.samples, **spread,
                **({"ratio_of": list(self.ratio_of)} if self.ratio_of else {})}


@dataclass
class Figures:
    """What one benchmark measured: named figures (a sample per repeat), ratios and notes, printed as one table."""

    benchmark: str
    figures: dict[str, Figure] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, value: float | None, unit: str = "") -> None:
        """One more sample of figure ``name`` (a repeat's)."""
        self.figures.setdefault(name, Figure(unit)).samples.append(value)

    def ratio(self, name: str, numerator: str, denominator: str) -> None:
        """Figure ``name``: ``numerator / denominator`` per repeat, of the samples the two figures took together (the
        same run, A B A B), so that a machine's drift between repeats does not enter a ratio."""
        top, bottom = self.figures[numerator].samples, self.figures[denominator].samples
        if len(top) != len(bottom):
            raise ValueError(f"ratio {name}: {numerator} has {len(top)} samples, {denominator} {len(bottom)}; a ratio "
                             "needs both measured in every repeat")
        self.figures[name] = Figure("x", [None if a is None or not b else a / b for a, b in zip(top, bottom)],
                                    (numerator, denominator))

    def note(self, text: str) -> None:
        """A line printed under the table (what was measured on what, a check's outcome)."""
        self.notes.append(text)

    def merge(self, other: Figures) -> None:
        """Append the samples and notes of another repeat of the same benchmark."""
        for name, figure in other.figures.items():
            mine = self.figures.setdefault(name, Figure(figure.unit, ratio_of=figure.ratio_of))
            mine.samples.extend(figure.samples)
        self.notes.extend(note for note in other.notes if note not in self.notes)

    def as_json(self) -> dict:
        return {"benchmark": self.benchmark,
                "figures": {name: figure.summary() for name, figure in self.figures.items()},
                "notes": self.notes, "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}}

    def table(self) -> str:
        repeats = max((len(figure.samples) for figure in self.figures.values()), default=0)
        width = max([len(name) for name in self.figures] + [6])
        lines = [f"== {self.benchmark}: {repeats} repeat(s); min / median / max over the repeats",
                 f"{'figure':<{width}} {'unit':>12} {'min':>11} {'median':>11} {'max':>11}"]
        for name, figure in self.figures.items():
            summary = figure.summary()
            cells = [_cell(summary[key]) for key in ("min", "median", "max")]
            lines.append(f"{name:<{width}} {figure.unit:>12} " + " ".join(f"{cell:>11}" for cell in cells))
        return "\n".join(lines + self.notes)


def _cell(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


@dataclass(frozen=True)
class RunFiles:
    """Where a pipeline run keeps the records and models a benchmark reads, from its results folder (``results/``
    of a run's working directory). Each accessor checks that the file is there."""

    results: Path

    def _existing(self, relative: str, made_by: str) -> Path:
        path = self.results / relative
        if not path.exists():
            raise SystemExit(f"{path} does not exist: --results names a pipeline's results folder whose {made_by} "
                             "has run (or pass the file itself)")
        return path

    def soft_labels(self) -> Path:
        return self._existing("labels/soft_labels.parquet", "gather_soft_labels rule")

    def label_shards(self) -> list[Path]:
        return sorted(self._existing("labels/shards", "soft_labels rule").glob("*.parquet"))

    def answers(self) -> Path:
        return self._existing("labels/answers.parquet", "gather_answers rule")

    def sft_data(self) -> Path:
        return self._existing("sft/sft_data.parquet", "win_filter rule")

    def sft_adapter(self) -> Path:
        return self._existing("sft/adapter", "sft_adapter rule")

    def merged(self, name: str) -> Path:
        return self._existing(f"merged/{name}", f"merge rule of {name}")

    def rl_metrics(self, algorithm: str) -> Path:
        return self._existing(f"rl/{algorithm}/metrics.json", f"rl rule of {algorithm}")
