"""The results table a run ends with (``clemprm summary``, printed by the Snakefile when the run succeeds).

One screen, read from ``results/prm_eval.json``: per regime (blind first: the figures comparable with clembench;
then lookahead, whose candidates were played in forks) each mode's % played, quality and clemscore with their
intervals, then each search's difference to the controls of its regime; the PRM's within-state figures against its
baselines on held-out states and its quality gate's verdict (with the check that failed); where the report,
transcripts and clembench results trees are.
"""

from __future__ import annotations

from clemprm.modes import MODES
from clemprm.stats import OVERALL

METRICS = ("percent_played", "quality", "clemscore")
RANKING_ROWS = ("prm", "candidate_length", "policy_logprob", "constant_mean", "acceptance", "rule")
ROW_NAMES = {"constant_mean": "random pick", "acceptance": "acceptance (reference)",
             "rule": "rule (reads the fork)"}
REGIME_TITLES = {"blind": "BLIND: one answer per turn reaches the game (comparable with clembench)",
                 "lookahead": "LOOKAHEAD: every candidate played in a fork first (no clembench score)"}


def estimate(value: dict | None, digits: int = 1, signed: bool = False) -> str:
    """``12.3 [4.5, 20.1]``, ``n/a`` where there is no value."""
    if not value or value.get("value") is None:
        return "n/a"
    sign = "+" if signed else ""
    return (f"{value['value']:{sign}.{digits}f} [{value['ci_low']:{sign}.{digits}f}, "
            f"{value['ci_high']:{sign}.{digits}f}]")


def mode_rows(summary: dict) -> dict[str, list[tuple[str, ...]]]:
    """Per regime, one row per mode: its name and its overall % played, quality and clemscore."""
    rows: dict[str, list[tuple[str, ...]]] = {}
    for mode, entry in sorted(summary.get("modes", {}).items(), key=lambda item: list(MODES).index(item[0])):
        overall = (entry.get("results") or {}).get(OVERALL) or {}
        gate = " (PRM failed its gate)" if entry.get("prm_gate") == "failed" else ""
        rows.setdefault(entry.get("regime", "lookahead"), []).append(
            (mode + gate, *(estimate(overall.get(metric)) for metric in METRICS)))
    return rows


def difference_rows(summary: dict) -> dict[str, list[tuple[str, ...]]]:
    """Per regime, one row per search (a mode with a scorer) and control of its regime: ``search - control`` and
    the paired differences in % played, quality and clemscore."""
    rows: dict[str, list[tuple[str, ...]]] = {}
    for control, modes in summary.get("differences", {}).items():
        for mode, difference in modes.items():
            search = MODES.get(mode)
            if search is None or search.scorer is None or search.baseline or MODES[control].search != search.search:
                continue   # each search against the controls of its own kind (the rest is in the file)
            overall = difference.get(OVERALL) or {}
            regime = summary["modes"][mode].get("regime", "lookahead")
            rows.setdefault(regime, []).append(
                (f"{mode} - {control}", *(estimate(overall.get(metric), signed=True) for metric in METRICS)))
    return rows


def ranking_rows(prm: dict) -> list[tuple[str, str, str]]:
    """The PRM and its baselines within states on held-out siblings: pairwise accuracy and top-1 regret."""
    scorers = (prm.get("ranking") or {}).get("scorers") or {}
    rows = []
    for name in RANKING_ROWS:
        overall = (scorers.get(name) or {}).get(OVERALL)
        if overall:
            rows.append((ROW_NAMES.get(name, name), estimate(overall.get("pairwise_accuracy"), 3),
                         estimate(overall.get("top1_regret"), 3)))
    return rows


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [header, *rows]]


def gate_line(prm: dict) -> str:
    """The gate's verdict, the first check that failed and the first the data could not decide."""
    gate = prm.get("gate") or {}
    status = gate.get("status") or "n/a"
    failed = [check for check in gate.get("checks", []) if not check["passed"]]
    line = f"quality gate: {status}"
    if failed:
        first = failed[0]
        line = f"quality gate: FAILED ({', '.join(c['check'] for c in failed)}): {first['check']}: {first['message']}"
    if gate.get("not_measured"):
        line += f"; not judged: {gate['not_measured'][0]}"
    return line


def summary_table(summary: dict, path: str = "results/prm_eval.json") -> str:
    """The results table of one ``prm_eval.json`` (see the module doc)."""
    bootstrap = summary.get("bootstrap") or {}
    level = round(100 * bootstrap.get("ci", 0.95))
    lines = [f"clemprm results: {summary.get('split')} split, {level}% intervals over instances ({path})"]
    modes, differences = mode_rows(summary), difference_rows(summary)
    for regime in ("blind", "lookahead"):
        if regime not in modes:
            continue
        lines += ["", REGIME_TITLES[regime]]
        lines += table(modes[regime], ("mode", "% played", "quality", "clemscore"))
        if differences.get(regime):
            lines += table(differences[regime], ("search - control", "% played", "quality", "clemscore"))
    prm = summary.get("prm")
    if prm:
        reads = {"candidate": "the candidate (blind)"}.get(prm.get("input"), "the candidate and the game's reply "
                                                                             "(lookahead)")
        ranking = prm.get("ranking") or {}
        lines += ["", f"PRM (reads {reads}) within states on held-out siblings: {ranking.get('prefixes', 0)} states, "
                      f"{ranking.get('pairs_with_different_labels', 0)} pairs with different labels; {gate_line(prm)}"]
        rows = ranking_rows(prm)
        lines += table(rows, ("scorer", "pairwise accuracy", "top-1 regret")) if rows else ["  not measured"]
    lines += ["", "report: snakemake --report report.html; transcripts: results/report/transcripts/; "
                  "clembench results trees (clem eval): results/clembench/<mode>/"]
    if summary.get("warnings"):
        lines.append(f"{len(summary['warnings'])} warning(s) in {path} (warnings, upstream_warnings)")
    return "\n".join(lines)
