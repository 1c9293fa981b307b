"""The learning benchmark over seeds: the pipeline once per seed and regime, then one table of the PRMs and searches.

    python -m clemprm.bench learning [--seeds 7 11 42] [--split test]
                                     [--regimes blind blind-probe lookahead lookahead-probe]
                                     [--config configs/learning.yaml] [--lookahead configs/lookahead.yaml]
                                     [--workdir runs/learning] [--cores 2] [--table-only] [--rerun-finished]
                                     [--add SEEDS_JSON ...]

(``python scripts/learning_benchmark.py`` with the same options is an alias: it calls :func:`main`.)
Each seed runs ``snakemake results/prm_eval.json`` in ``WORKDIR/seed-<seed>/blind/`` with the benchmark config and
``{seed: <seed>, eval: {split: <split>}, on_failure: continue}`` on top (a PRM that fails its gate is a result): the
blind regime, the PRM reading the candidate alone. A seed's run that finished (its summary and the commit that made
it are there) is kept as measured and not run again, even when the code changed since (Snakemake would rerun it
from the first rule: hours of a seed lost to a commit in between); ``--rerun-finished`` runs it again. Then
``WORKDIR/seed-<seed>/lookahead/`` starts as a copy of the blind run up to the soft labels (mtimes and Snakemake's
metadata kept: nothing upstream reruns) and runs with ``--lookahead`` on top: the PRM trained again to read the
game's reply, and the lookahead searches with their rule controls. ``blind-probe`` and ``lookahead-probe`` are the
same regimes with the probe PRM (``{prm: {kind: probe}}`` on top), each started as a copy of the LoRA PRM's run of
its regime that keeps the searches that read no PRM: only the PRM and the searches that read it run again, on the
same soft labels and against the same controls. ``WORKDIR/seeds.md`` and ``seeds.json`` get the table of
:mod:`clemprm.evaluation.seeds`: per seed and on the mean over the seeds, blind rows first, each figure of the LoRA
PRM beside the probe's, and the probe minus the LoRA PRM on the same held-out states (unpaired). A claim holds
when the 95% interval of its paired difference's mean over at least three seeds clears 0; ``--split test`` (the
untouched split) is the final check.
Each seed's row names the commit that ran it; ``--add`` joins the rows of tables made elsewhere (another machine, a
cluster job, an earlier run) to the table; a regime run here replaces that regime's figures of a joined seed.
The arguments are checked before any seed runs (config files, ``--add`` tables, the run a regime starts from); a
seed without a summary is a warning, and a table with nothing measured an error (:mod:`clemprm.evaluation.seeds`).
A seed whose pipeline fails is named with its exit status (its error is above it), its later regimes are skipped
and the other seeds run; the table is written for what was measured and the benchmark exits 1 naming every failure.
The seeds are the repeats: ``--repeat`` stays 1. Its figures (the door's table) count the seeds and claims; the
benchmark's own table is ``seeds.md``. It runs from a source checkout (the Snakefile beside ``clemprm/``) and leaves
the hub settings (``HF_HUB_OFFLINE``) as they are: the configs decide.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from clemprm.bench import Figures
from clemprm.evaluation import seeds

REPO = Path(__file__).resolve().parents[2]
WORKDIR = Path("runs/learning")   # the door's --workdir default for this benchmark: its seeds resume there
REPEATS_ITSELF = True             # the seeds are its repeats (a finished seed is up to date: a repeat measures nothing)
DOOR = "python -m clemprm.bench learning"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 11, 42])
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--regimes", nargs="+", default=list(seeds.REGIMES), choices=seeds.REGIMES,
                        help="run in this order whatever the order given: blind, blind-probe (the probe PRM, "
                             "started from the blind run), lookahead (started from the blind run), lookahead-probe "
                             "(started from the lookahead run)")
    parser.add_argument("--config", default=str(REPO / "configs" / "learning.yaml"))
    parser.add_argument("--lookahead", default=str(REPO / "configs" / "lookahead.yaml"),
                        help="the config on top of --config for the lookahead regime")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--table-only", action="store_true", help="only tabulate the seeds already run")
    parser.add_argument("--rerun-finished", action="store_true",
                        help="run a seed's finished run again on this checkout (by default it is kept as measured, "
                             "whatever commit made it: its row names that commit)")
    parser.add_argument("--add", nargs="+", default=[], metavar="SEEDS_JSON",
                        help="seeds.json files of seeds run elsewhere, joined to the table (a regime run here wins)")


def run_seed(seed: int, regime: str, args: argparse.Namespace) -> Path:
    """The pipeline for one seed in one regime, in its own folder; returns its summary's path. A finished run is
    kept (the module's docstring says why) unless ``--rerun-finished``."""
    workdir = seeds.seed_dir(Path(args.workdir), seed, regime)
    summary, made_by = workdir / "results" / "prm_eval.json", workdir / "commit.txt"
    if summary.is_file() and made_by.is_file() and not args.rerun_finished:
        print(f"[learning benchmark] seed {seed}, {regime}: finished at commit {made_by.read_text().strip()}, kept "
              "(--rerun-finished runs it again on this checkout)", flush=True)
        return summary
    seeds.start_run(Path(args.workdir), seed, regime)
    workdir.mkdir(parents=True, exist_ok=True)
    override = workdir / "seed.yaml"
    # a PRM that fails its quality gate is a result here: the searches run on it and the table shows the gate
    override.write_text(yaml.safe_dump({"seed": seed, "eval": {"split": args.split}, "on_failure": "continue",
                                        **seeds.regime_override(regime)}))
    lookahead = seeds.split_regime(regime)[0] == "lookahead"
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--cores", str(args.cores),
               "--directory", str(workdir), "--rerun-incomplete", "results/prm_eval.json",
               "--configfile", str(Path(args.config).resolve()),
               *([str(Path(args.lookahead).resolve())] if lookahead else []), str(override)]
    made_before = summary.stat().st_mtime_ns if summary.is_file() else None
    start = time.perf_counter()
    print(f"[learning benchmark] seed {seed}, {regime}: {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)
    print(f"[learning benchmark] seed {seed}, {regime}: done in {time.perf_counter() - start:.0f} s", flush=True)
    if summary.stat().st_mtime_ns != made_before:   # an up-to-date seed keeps the commit that made its summary
        made_by.write_text(commit() + "\n")
    return summary


def run_seeds(args: argparse.Namespace, regimes: list[str]) -> list[str]:
    """Every seed in every regime (blind first); returns what failed. A seed whose pipeline fails is reported by its
    last lines and the run's log, and its later regimes are skipped (each starts from the one before); the other
    seeds go on: hours of other seeds' runs are not lost to one failure."""
    failed = []
    for seed in args.seeds:
        for regime in regimes:
            try:
                run_seed(seed, regime, args)
            except subprocess.CalledProcessError as error:
                logs = seeds.seed_dir(Path(args.workdir), seed, regime) / ".snakemake" / "log"
                failed.append(f"seed {seed}, {regime}: snakemake failed (exit status {error.returncode}; its error is "
                              f"above, Snakemake's log of the run in {logs}/)"
                              + (f", so {', '.join(regimes[regimes.index(regime) + 1:])} did not run"
                                 if regime != regimes[-1] else ""))
                print(f"[learning benchmark] {failed[-1]}", file=sys.stderr, flush=True)
                break
    return failed


def commit() -> str:
    """The commit of the code that runs the seeds (``-dirty`` when it has uncommitted changes)."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (head.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def run(args: argparse.Namespace, prog: str = DOOR) -> Figures:
    """The seeds run (unless ``--table-only``) and tabulated into ``WORKDIR/seeds.md`` and ``seeds.json``; the
    figures count the seeds and the claims. ``SystemExit`` led by ``prog`` for an argument that cannot be used
    (before any seed runs) and, after the table is written, naming every seed whose pipeline failed."""
    if getattr(args, "repeat", 1) != 1:
        sys.exit(f"{prog}: --repeat {args.repeat}: the seeds are this benchmark's repeats (a finished seed is up to "
                 "date and would measure nothing again): leave --repeat at 1, give more --seeds")
    start = time.perf_counter()
    out, regimes = Path(args.workdir), seeds.regimes_in_order(args.regimes)   # blind first
    lookahead = any(seeds.split_regime(regime)[0] == "lookahead" for regime in regimes)
    configs = {"--config": args.config, **({"--lookahead": args.lookahead} if lookahead else {})}
    failed = []
    try:   # the arguments checked before any seed runs
        added = seeds.read_added(args.add)
        if not args.table_only:
            if not (REPO / "Snakefile").is_file():
                raise seeds.BenchmarkError(f"no Snakefile in {REPO}: the learning benchmark runs the pipeline of a "
                                           "source checkout (pip install -e . in a clone)")
            seeds.check_plan(out, args.seeds, regimes, configs)
            failed = run_seeds(args, regimes)
        rows, warnings = seeds.measured_rows(out, args.seeds, regimes, added)
    except seeds.BenchmarkError as error:
        sys.exit(f"{prog}: " + "; ".join([*failed, str(error)]))
    for warning in warnings:
        print(f"{prog}: WARNING: {warning}", file=sys.stderr)
    table = seeds.seeds_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.json").write_text(json.dumps(table, indent=1, sort_keys=True, allow_nan=True) + "\n")
    (out / "seeds.md").write_text(seeds.markdown(table))
    print(seeds.markdown(table))
    if failed:
        sys.exit(f"{prog}: " + "; ".join(failed))
    return figures_of(table, out, time.perf_counter() - start)


def figures_of(table: dict, out: Path, seconds: float) -> Figures:
    """The door's figures of a seeds table: seeds, claims judged and holding, the wall time; the claims that hold
    named in the notes."""
    verdicts = [claim["holds"] for claim in table["claims"].values()]
    figures = Figures("learning")
    figures.add("seeds tabulated", len(table["seeds"]), "seeds")
    figures.add("claims judged", sum(verdict is not None for verdict in verdicts), "claims")
    figures.add("claims that hold", sum(verdict is True for verdict in verdicts), "claims")
    figures.add("wall time", seconds, "s")
    figures.note(f"the table: {out / 'seeds.md'} and {out / 'seeds.json'}; a claim holds when the 95% interval of "
                 f"its mean over at least {seeds.MIN_SEEDS} seeds clears 0")
    for name, claim in table["claims"].items():
        if claim["holds"]:
            figures.note(f"holds: {name}")
    return figures


def main(argv: list[str] | None = None, prog: str = "learning_benchmark.py") -> None:
    """The benchmark with its own options and ``--workdir`` (default ``runs/learning``), as
    ``scripts/learning_benchmark.py`` runs it: the seeds table printed, no door table; messages led by ``prog``."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=WORKDIR, help=f"the seeds' runs and the table (default "
                        f"{WORKDIR})")
    add_arguments(parser)
    run(parser.parse_args(argv), prog)
