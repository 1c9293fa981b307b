"""The results table a run ends with (``clemprm summary``, printed by the Snakefile when the run succeeds).

One screen, read from ``results/prm_eval.json``: per regime (blind first: the figures comparable with clembench;
then lookahead, whose candidates were played in forks) each mode's % played, quality and clemscore with their
intervals, then each search's difference to the controls of its regime; the PRM's within-state figures against its
baselines on held-out states, each pairwise accuracy's learned share of the labels' ceiling, the ceiling itself, the
same figures on the PRM's train side, and its quality gate's verdict (with the check that failed, and the gate's
diagnosis); where the report, transcripts and clembench results trees are.

Around the table: a file that is not a prm_eval.json is refused, naming what it is not (:func:`read_summary`); a
summary the run that prints it did not make, or one older than files it is made from, is named stale with its own
time, seed and split (:func:`staleness`); a run that fails ends with each failed job's own error line from its log,
not only Snakemake's CalledProcessError (:func:`failed_jobs`, the Snakefile's ``onerror``).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema

from clemprm.evaluation.evaluate import summary_schema
from clemprm.modes import MODES
from clemprm.stages.prm_metrics import left_out_text
from clemprm.stats import OVERALL

METRICS = ("percent_played", "quality", "clemscore")
RANKING_ROWS = ("prm", "candidate_length", "policy_logprob", "constant_mean", "acceptance", "rule")
ROW_NAMES = {"constant_mean": "random pick", "acceptance": "acceptance (reference)",
             "rule": "rule (reads the fork)"}
GATE_MARKS = {"failed": " (PRM failed its gate)", "not_judged": " (PRM gate not judged)"}   # beside a PRM's mode
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
        gate = GATE_MARKS.get(entry.get("prm_gate"), "")
        rows.setdefault(entry.get("regime", "lookahead"), []).append(
            (mode + gate, *(estimate(overall.get(metric)) for metric in METRICS)))
    return rows


def difference_rows(summary: dict) -> dict[str, list[tuple[str, ...]]]:
    """Per regime, one row per search (a mode with a scorer) and control of its regime: ``search - control``, the
    paired differences in % played, quality and clemscore, how many of the games the quality difference covers
    (those both modes played an episode of), and the smallest clemscore difference the run could detect
    (:func:`clemprm.stats.detectable_difference`: a difference inside it that is not seen was not there to see)."""
    rows: dict[str, list[tuple[str, ...]]] = {}
    for control, modes in summary.get("differences", {}).items():
        for mode, difference in modes.items():
            search = MODES.get(mode)
            if search is None or search.scorer is None or search.baseline or MODES[control].search != search.search:
                continue   # each search against the controls of its own kind (the rest is in the file)
            overall = difference.get(OVERALL) or {}
            regime = summary["modes"][mode].get("regime", "lookahead")
            covered = (overall.get("games") or {}).get("quality")   # none in a summary made before it was counted
            detectable = (overall.get("clemscore") or {}).get("detectable")
            rows.setdefault(regime, []).append(
                (f"{mode} - {control}", *(estimate(overall.get(metric), signed=True) for metric in METRICS),
                 "n/a" if covered is None else f"{covered} of {len(difference) - 1}",   # every group but overall
                 "n/a" if detectable is None else f"{detectable:.1f}"))
    return rows


def number(value: float | None, digits: int = 2) -> str:
    """A bare figure (a learned share, :func:`clemprm.stages.label_ceiling.learned_share`; a spread ratio; an AUROC)
    as ``0.42``, ``n/a`` where there is none."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def ranking_rows(prm: dict) -> list[tuple[str, str, str, str]]:
    """The PRM and its baselines within states on held-out siblings: pairwise accuracy, its learned share of the
    labels' ceiling, and top-1 regret."""
    scorers = (prm.get("ranking") or {}).get("scorers") or {}
    shares = (prm.get("ceiling") or {}).get("learned_share") or {}
    rows = []
    for name in RANKING_ROWS:
        overall = (scorers.get(name) or {}).get(OVERALL)
        if overall:
            rows.append((ROW_NAMES.get(name, name), estimate(overall.get("pairwise_accuracy"), 3),
                         number(shares.get(name)), estimate(overall.get("top1_regret"), 3)))
    return rows


def ceiling_lines(prm: dict) -> list[str]:
    """What these labels allow (a perfect scorer's pairwise accuracy against them, the split-half agreement), and
    the PRM on its own train side beside a random pick and the candidate's length: underfit and not transferring
    read apart; the gate's diagnosis."""
    ceiling, train = prm.get("ceiling") or {}, prm.get("train_ranking") or {}
    modelled, halves = ceiling.get("modelled") or {}, ceiling.get("split_half") or {}
    lines = []
    if modelled.get("value") is not None:
        agreement = "n/a" if halves.get("value") is None else f"{halves['value']:.3f}"
        lines.append(f"  labels' ceiling (a perfect scorer's pairwise accuracy against labels like these) "
                     f"{estimate(modelled, 3)}; split-half agreement {agreement} ({halves.get('pairs')} pairs); "
                     f"learned share = (accuracy - 0.5) / (ceiling - 0.5)")
    if train.get("pairwise_accuracy"):
        train_ceiling = train.get("ceiling") or {}
        shares = train_ceiling.get("learned_share") or {}
        baselines = "; ".join(f"{ROW_NAMES.get(name, name)} {estimate(entry.get('pairwise_accuracy'), 3)}"
                              for name, entry in (train.get("baselines") or {}).items())
        lines.append(f"  train side ({train.get('pairs_with_different_labels')} pairs, ceiling "
                     f"{estimate(train_ceiling.get('modelled'), 3)}): PRM pairwise accuracy "
                     f"{estimate(train['pairwise_accuracy'], 3)} (learned share {number(shares.get('prm'))}), top-1 "
                     f"regret {estimate(train.get('top1_regret'), 3)}, prediction spread "
                     f"{number(train.get('spread_ratio'))} of the labels', verdict AUROC "
                     f"{number((train.get('verdicts') or {}).get('auroc'), 3)}; {baselines}")
    if (prm.get("gate") or {}).get("diagnosis"):
        lines.append(f"  gate diagnosis: {prm['gate']['diagnosis']}")
    if (prm.get("gate") or {}).get("left_out"):
        lines.append(f"  left out of the gate's ranking checks: {left_out_text(prm['gate']['left_out'])}")
    return lines


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in [header, *rows]]


def gate_line(prm: dict) -> str:
    """The gate's verdict, the first check that failed and the first the data could not decide (a gate not judged
    is a warning: no evidence is no pass)."""
    gate = prm.get("gate") or {}
    status = gate.get("status") or "n/a"
    failed = [check for check in gate.get("checks", []) if not check["passed"]]
    line = f"quality gate: {status}"
    if failed:
        first = failed[0]
        line = f"quality gate: FAILED ({', '.join(c['check'] for c in failed)}): {first['check']}: {first['message']}"
    if status == "not_judged":
        line += ", WARNING: no evidence is no pass"
    if gate.get("not_judged"):
        line += f"; not judged: {gate['not_judged'][0]}"
    return line


FOR_AN_ANSWER = "for figures that answer something: configs/learning.yaml (docs/results.md)"


def reading_notes(summary: dict) -> list[str]:
    """Why a zero or an n/a is in the table, in words: modes that won no episode (quality and clemscore 0 are then
    the policy's, not a fault), and a PRM ranking with no held-out pair to rank (its siblings all carry one label)."""
    notes = []
    unwon = [mode for mode, entry in summary.get("modes", {}).items()
             if (((entry.get("results") or {}).get(OVERALL) or {}).get("success_rate") or {}).get("value") == 0]
    if unwon:
        notes.append(f"  {', '.join(unwon)} won no episode: their quality and clemscore are 0 because the policy "
                     f"never finished a game with a win (a small first run's policy rarely wins; {FOR_AN_ANSWER})")
    ranking = (summary.get("prm") or {}).get("ranking")
    if summary.get("prm") and not (ranking or {}).get("pairs_with_different_labels"):
        notes.append(f"  the PRM's ranking is n/a: its held-out siblings all carry the same label (their "
                     f"continuations all lost, or all won), so there is no pair to rank and the gate cannot judge; "
                     f"more held-out states (branch_points.validation_instances) or a policy that wins sometimes give "
                     f"pairs ({FOR_AN_ANSWER})")
    return ["", "reading this table:", *notes] if notes else []


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
            lines += table(differences[regime], ("search - control", "% played", "quality", "clemscore",
                                                 "quality over games", "detectable clemscore"))
    prm = summary.get("prm")
    if prm:
        reads = {"candidate": "the candidate (blind)"}.get(prm.get("input"), "the candidate and the game's reply "
                                                                             "(lookahead)")
        ranking = prm.get("ranking") or {}
        intervals = f", {round(100 * ranking['ci'])}% intervals" if ranking.get("ci") else ""
        lines += ["", f"PRM (reads {reads}) within states on held-out siblings: {ranking.get('prefixes', 0)} states, "
                      f"{ranking.get('pairs_with_different_labels', 0)} pairs with different labels{intervals}; "
                      f"{gate_line(prm)}"]
        rows = ranking_rows(prm)
        lines += (table(rows, ("scorer", "pairwise accuracy", "learned share", "top-1 regret")) if rows
                  else ["  not measured"])
        lines += ceiling_lines(prm)
    lines += reading_notes(summary)
    lines += ["", "report: snakemake --report report.html; transcripts: results/report/transcripts/; "
                  "clembench results trees (clem eval): results/clembench/<mode>/"]
    if summary.get("warnings"):
        lines.append(f"{len(summary['warnings'])} warning(s) in {path} (warnings, upstream_warnings)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ around the table


class SummaryError(ValueError):
    """A file ``clemprm summary`` cannot show (the message names it and what it is not)."""


REMAKE = "snakemake results/prm_eval.json makes it, snakemake --forcerun eval_summary remakes it"
JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true or false",
              type(None): "null"}


def read_summary(path: str | Path) -> dict:
    """The evaluation summary in ``path``, checked against prm_eval.json's schema (:func:`summary_schema`), or
    :class:`SummaryError` naming the file and what it is not: another JSON file of the run (results/prm/metrics.json),
    ``{}``, a list or ``null`` would show as a table of a "None split" with no rows, or not at all."""
    try:
        text = Path(path).read_bytes()   # json.loads decodes it: a file that is not UTF-8 is "not JSON" below
    except OSError as error:
        raise SummaryError(f"{path}: {error.strerror}") from error
    try:
        summary = json.loads(text)
    except ValueError as error:
        raise SummaryError(f"{path} is not a prm_eval.json: it is not JSON ({error}); {REMAKE}") from error
    if not isinstance(summary, dict):
        raise SummaryError(f"{path} is not a prm_eval.json: it holds {JSON_KINDS[type(summary)]}, not an evaluation "
                           f"summary (a JSON object); {REMAKE}")
    schema = summary_schema()
    missing = [key for key in schema["required"] if key not in summary]
    if missing:
        keys = f"its keys: {', '.join(sorted(summary))}" if summary else "it is {}"
        raise SummaryError(f"{path} is not a prm_eval.json: it has no {', '.join(missing)} ({keys}); {REMAKE}")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(summary))
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "its top level"
        message = error.message if len(error.message) <= 200 else error.message[:200] + "..."
        raise SummaryError(f"{path} does not match the schema of prm_eval.json at {where}: {message} (made by another "
                           f"version of clemprm?); {REMAKE}")
    return summary


def summary_inputs(path: str | Path, summary: dict) -> list[Path]:
    """The files beside ``path`` that its summary was made from (the eval_summary rule's inputs): each mode's
    episodes under eval/, and the PRM's metrics under prm/ where the summary shows the PRM."""
    folder = Path(path).parent
    modes = [*summary["modes"], *(["self_correct"] if "self_correction" in summary else [])]
    return [folder / "eval" / f"{mode}.parquet" for mode in modes] + ([folder / "prm" / "metrics.json"]
                                                                       if summary.get("prm") else [])


def staleness(path: str | Path, summary: dict, run_start: float | None = None) -> list[str]:
    """Warnings for a table that is not the answer of the run that prints it, with the summary's own time, split and
    seed (from which run it is): ``path`` older than ``run_start`` (the run did not remake it: one aimed at part of
    the DAG, e.g. one label shard), or older than files it was made from (:func:`summary_inputs`: they were remade
    since, and it was not). Empty when the summary is this run's and up to date with its inputs."""
    made = Path(path).stat().st_mtime
    origin = (f"made {time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(made))} ({summary['split']} split, seed "
              f"{summary['bootstrap']['seed']})")
    lines = []
    if run_start is not None and made < run_start:
        lines.append(f"WARNING: this run did not make {path}: the table below is that of the run that {origin}")
    newer = [str(file) for file in summary_inputs(path, summary) if file.is_file() and file.stat().st_mtime > made]
    if newer:
        lines.append(f"WARNING: the table below is STALE: {path}, {origin}, is older than {len(newer)} of the files "
                     f"it is made from ({', '.join(newer[:3])}{', ...' if len(newer) > 3 else ''}); "
                     f"snakemake results/prm_eval.json remakes it")
    return lines


ERROR_RULE = re.compile(r"Error in rule (\w+)|\s+rule (\w+):$")   # a job's error block; a group error's jobs
ERROR_LOG = re.compile(r"\s+log: (.+) \(check log file\(s\) for error details\)$")
TRACEBACK = "Traceback (most recent call last):"
LAUNCHER_ERRORS = ("ChildFailedError",)   # torchrun's report that a process failed: that process's error is above


def failed_jobs(main_logs: list[str]) -> list[str]:
    """One line per failed job of a run, read from Snakemake's main log (``main_logs``: the ``log`` an ``onerror``
    handler is given): its rule, its log and the job's own last error there (:func:`last_error`), e.g. the
    StageFailure or the "context too long: ... (model.max_context_tokens; ...)" that Snakemake's console shows only
    as a CalledProcessError."""
    lines = []
    for main_log in main_logs:
        rule = None
        for line in Path(main_log).read_text(errors="replace").splitlines():
            if match := ERROR_RULE.match(line):
                rule = match.group(1) or match.group(2)
            elif (match := ERROR_LOG.match(line)) and rule is not None:
                lines += [f"rule {rule} failed ({job_log}): {last_error(job_log)}"
                          for job_log in match.group(1).split(", ")]
            elif not line.startswith(" "):   # past the block
                rule = None
    return list(dict.fromkeys(lines))   # a job's error block can be logged twice


def last_error(job_log: str | Path) -> str:
    """The last exception in a job's log (``StageFailure: <its message>``, the class without its module), past
    torchrun's own report that a process failed; where the log holds no traceback (a job killed, or one that failed
    before its log was set up), its last line."""
    try:
        lines = Path(job_log).read_text(errors="replace").splitlines()
    except OSError as error:
        return f"its log cannot be read ({error.strerror}): see Snakemake's output above"
    errors = [next((line for line in lines[start + 1:] if line and not line[0].isspace()), None)
              for start, line in enumerate(lines) if line.startswith(TRACEBACK)]
    errors = [re.sub(r"^(?:\w+\.)+(\w+)(?=:|$)", r"\1", error) for error in errors if error]
    errors = [error for error in errors if error.split(":")[0] not in LAUNCHER_ERRORS]
    if errors:
        return errors[-1]
    written = [line for line in lines if line.strip()]
    if not written:
        return "its log is empty: see Snakemake's output above"
    return f"no traceback in its log, whose last line is: {written[-1]}"
