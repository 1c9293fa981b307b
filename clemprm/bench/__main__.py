"""The benchmarks' one door.

    python -m clemprm.bench --list                       every benchmark with what it measures
    python -m clemprm.bench NAME --help                  its options
    python -m clemprm.bench NAME [--workdir DIR] [--repeat N] [--json PATH] [its options]

Prints what the benchmark reports as it goes, then one table of its figures (min / median / max over the repeats;
ratios per repeat), and writes that table as JSON to ``--json``. The hub is switched off (``HF_HUB_OFFLINE``,
``TRANSFORMERS_OFFLINE``, where not set) for every benchmark but those that run whole pipelines (``learning``): there
the configs decide, as in any pipeline run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import tempfile
from pathlib import Path

import clemprm.bench as package

HUB_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
RUNS_PIPELINES = {"learning"}   # benchmarks that run snakemake, whose parse-time checks read HUB_OFFLINE


def names() -> list[str]:
    """Every benchmark: the package's modules but the door."""
    return sorted(info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_"))


def summary_line(name: str) -> str:
    doc = importlib.import_module(f"clemprm.bench.{name}").__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def parser_for(name: str, module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m clemprm.bench {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = parser.add_argument_group("shared by every benchmark")
    workdir = getattr(module, "WORKDIR", None)   # a benchmark that resumes in a folder of its own names it
    shared.add_argument("--workdir", type=Path, default=workdir, help="where the benchmark writes what it makes "
                        f"(default: {workdir or 'a new temporary folder'})")
    shared.add_argument("--repeat", type=int, default=1, help="repeats; each figure keeps a sample per repeat")
    shared.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures here")
    module.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in RUNS_PIPELINES:   # before the benchmark's imports read them
        for variable in HUB_OFFLINE:
            os.environ.setdefault(variable, "1")
    known = names()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv[0] == "--list":
        for name in known:
            print(f"{name:<16} {summary_line(name)}")
        return
    name = argv[0]
    if name not in known:
        raise SystemExit(f"no benchmark {name!r}: one of {', '.join(known)} (python -m clemprm.bench --list)")
    module = importlib.import_module(f"clemprm.bench.{name}")
    args = parser_for(name, module).parse_args(argv[1:])
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat}: at least 1")
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"clemprm-bench-{name}-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"{name}: load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; work folder {args.workdir}",
          flush=True)
    figures = module.run(args)
    for _ in range(0 if getattr(module, "REPEATS_ITSELF", False) else args.repeat - 1):
        figures.merge(module.run(args))
    figures.note(f"load average at the end {os.getloadavg()[0]:.2f}")
    print("\n" + figures.table())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures.as_json(), indent=1))
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
