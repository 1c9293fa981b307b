"""The learning benchmark over seeds: one table from each seed's ``prm_eval.json``, blind and lookahead apart, each
with the LoRA PRM and the probe PRM side by side.

A claim of the pipeline holds when it holds on average over the seeds, each seed a different draw of train
instances, labels and episodes. Every figure is in one regime (:mod:`clemprm.search`):

* ``blind/...``: the PRM that reads the candidate alone, within states against the candidate's length, the policy's
  log-probability and a random pick, beside the game's acceptance of the candidate (a reference: what a blind
  scorer gets if it knows only the rules' validity verdict); blind ``best_of_n`` against ``random_of_n`` and
  ``best_of_n_logprob``. These are the figures comparable with clembench.
* ``lookahead/...``: the PRM that reads the game's answer, against the same baselines and the rule that reads the
  same answer with no model; ``best_of_n_lookahead`` against ``best_of_n_rule``, ``beam_search`` against
  ``beam_search_rule`` and ``beam_search_logprob``.

A regime's figures are those of the LoRA PRM (``prm.kind: lora``, the default); ``blind-probe/...`` and
``lookahead-probe/...`` are the same regimes with the probe PRM (``prm.kind: probe``), whose run starts as a copy of
the LoRA PRM's up to the soft labels (:func:`start_run`): the same held-out states and the same searches' controls.
``<regime>/ranking/probe-lora/...`` is the probe's figure minus the LoRA PRM's on those states, unpaired
(:func:`kind_differences`): the summaries carry each scorer's estimate, not its per-instance sums.

Every claim is a paired difference (the PRM minus a baseline within states, a search minus its control), judged
only on its mean over at least ``MIN_SEEDS`` seeds (fewer: not judged, whatever one seed shows): it holds when the
mean's 95% interval clears 0 in the claimed direction (:func:`clemprm.stats.mean_over_seeds`: the wider of the
seeds' spread and the seeds' own intervals, each read at the level it was made at and combined as fully correlated:
every seed is tested on the same test instances), not when the point estimate merely lies on the right side. A mean is
taken only over seeds that all have the figure (a figure missing in one seed has no mean), so that the two sides of
a claim always average the same seeds. ``scripts/learning_benchmark.py`` runs the seeds and writes the
table; its arguments are checked here before any seed runs (:func:`check_plan`, :func:`read_added`), and a table
with nothing measured is refused (:func:`measured_rows`).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np

from clemprm.config import ConfigError, read_config_file
from clemprm.evaluation.console import SummaryError, read_summary
from clemprm.modes import MODES, PRM_INPUT_REGIMES, PRM_KINDS   # a regime names any kind but the first (blind-probe)
from clemprm.stats import OVERALL, mean_over_seeds

MIN_SEEDS = 3   # a claim is judged on the mean over at least this many seeds
CLAIM_CI = 0.95   # the level of a claim's interval over seeds
# the level of a seed's interval written without one: the rows of tables made before a row recorded it, every one
# made at 0.95 (eval.ci and prm.ci of the config, which the learning benchmark keeps)
UNMARKED_LEVEL = 0.95
RANKING_METRICS = ("pairwise_accuracy", "top1_regret")
DIFFERENCE_METRICS = ("clemscore", "percent_played", "quality")   # clemscore first: what clembench ranks by
RANKING_BASELINES = {"blind": ("candidate_length", "policy_logprob", "constant_mean"),
                     "lookahead": ("candidate_length", "policy_logprob", "constant_mean", "rule")}
REFERENCES = {"blind": ("acceptance",), "lookahead": ()}   # tabulated, not claimed against
KIND_DIFFERENCE = "probe-lora"   # <regime>/ranking/probe-lora/<metric>: the probe PRM's figure minus the LoRA PRM's
SEARCH_CONTROLS = {   # regime -> search -> its controls
    "blind": {"best_of_n": ("random_of_n", "best_of_n_logprob")},
    "lookahead": {"best_of_n_lookahead": ("best_of_n_rule",),
                  "beam_search": ("beam_search_rule", "beam_search_logprob")},
}


def _number(value: float | None) -> float:
    """A bare figure as a seed row holds it: NaN where there is none."""
    return math.nan if value is None else float(value)


def _value(estimate: dict | None) -> float:
    return _number((estimate or {}).get("value"))


def _interval(estimate: dict | None, level: float | None = None) -> str | None:
    """``95% [-0.100, +0.200]``: an interval as a seed row holds it, led by the level it was made at."""
    if not estimate or estimate.get("ci_low") is None:
        return None
    bounds = f"[{estimate['ci_low']:+.3f}, {estimate['ci_high']:+.3f}]"
    return bounds if level is None else f"{100 * level:g}% {bounds}"


def _figure(key: str, estimate: dict | None, level: float | None) -> dict[str, float | str]:
    """``key``: the estimate's value, and ``key/ci``: its interval (:func:`_interval`) where it has one."""
    figure: dict[str, float | str] = {key: _value(estimate)}
    if interval := _interval(estimate, level):
        figure[f"{key}/ci"] = interval
    return figure


def _estimate(row: dict, key: str) -> dict:
    """A seed's figure under ``key`` with the interval :func:`_interval` wrote under ``key/ci`` and its level, read
    back (an interval without a level is read at :data:`UNMARKED_LEVEL`)."""
    value, interval = row.get(key, math.nan), row.get(f"{key}/ci")
    if isinstance(value, str) or math.isnan(value) or interval is None:
        return {"value": None, "ci_low": None, "ci_high": None}
    level, _, bounds = interval.rpartition(" [")
    low, high = (float(bound) for bound in bounds.strip("[]").split(","))
    return {"value": value, "ci_low": low, "ci_high": high,
            "level": float(level.rstrip("%")) / 100 if level else UNMARKED_LEVEL}


def regime_name(search: str, kind: str) -> str:
    """A run's name in the table and under WORKDIR/seed-<seed>/: its search regime (blind, lookahead), followed by its
    PRM's kind where that is not the default (``blind-probe``)."""
    return search if kind == PRM_KINDS[0] else f"{search}-{kind}"


def split_regime(name: str) -> tuple[str, str]:
    """The search regime and the PRM kind of a run's name (:func:`regime_name`)."""
    search, _, kind = name.partition("-")
    return search, kind or PRM_KINDS[0]


def prm_kind(prm_metrics: dict | None) -> str:
    """The kind of the PRM whose stage wrote ``prm_metrics`` (results/prm/metrics.json: its config's ``prm.kind``);
    the LoRA PRM without them or for a stage from before the kinds."""
    return (((prm_metrics or {}).get("config") or {}).get("prm") or {}).get("kind", PRM_KINDS[0])


def verdict_auroc(prm_metrics: dict | None) -> float | None:
    """The AUROC of the PRM's predictions for the game's verdicts on its held-out siblings (``verdicts`` in
    results/prm/metrics.json, :func:`clemprm.stages.prm_metrics.verdict_metrics`): the same figure for either kind;
    None where the metrics lack it or the game gave one verdict only."""
    return ((prm_metrics or {}).get("verdicts") or {}).get("auroc")


def answers_auroc(prm_metrics: dict | None) -> float | None:
    """The AUROC of the PRM's validity part on its own: its predictions for the game's verdicts on the played answers
    of the instances kept out of its verdict training (``acceptance.heldout`` in results/prm/metrics.json); None
    where the run trained on no verdicts."""
    return ((((prm_metrics or {}).get("acceptance") or {}).get("heldout")) or {}).get("auroc")


def prm_regime(summary: dict) -> str | None:
    """The regime of a summary's PRM: blind for one that read the candidate alone, lookahead for one that read the
    game's reply (a PRM from before ``prm.input`` existed read it); None without a PRM."""
    prm = summary.get("prm")
    if not prm:
        return None
    return PRM_INPUT_REGIMES.get(prm.get("input"), "lookahead")


def seed_row(summary: dict, prm_metrics: dict | None = None) -> dict[str, float | str]:
    """The benchmark's figures of one run's summary, flat, each key led by its regime (:func:`regime_name`: the
    search regime, and the PRM's kind read from ``prm_metrics``, its stage's metrics.json):
    ``<regime>/ranking/<scorer>/<metric>``, ``<regime>/ranking/prm-<scorer>/<metric>`` and
    ``<regime>/difference/<search>-<control>/<metric>`` (each figure with its interval as text under the same key +
    ``/ci``, led by its level: the summary's ``eval.ci``, the ranking's ``prm.ci``; a difference's is paired),
    the labels' ceiling and learned shares (:func:`ceiling_figures`), ``<regime>/gate``,
    ``<regime>/verdict_auroc`` (:func:`verdict_auroc`, where the metrics carry it) and
    ``<regime>/acceptance/heldout_auroc`` (:func:`answers_auroc`),
    ``<regime>/ranking/pairs_with_different_labels`` (the held-out yardstick's size) and
    ``<regime>/head/change_over_initial_norm`` (how far the LoRA PRM's score head left its start); beside each
    difference the smallest the run could detect (``.../detectable``), and each mode's own figures
    (``<regime>/mode/<mode>/<metric>``, under the regime of the run's PRM). A run holds one PRM, so one regime's
    ranking; its modes may hold either regime's searches (each mode's own mark decides)."""
    row: dict[str, float | str] = {}
    kind = prm_kind(prm_metrics)
    regime = prm_regime(summary) and regime_name(prm_regime(summary), kind)   # None: a run of no PRM
    eval_level = (summary.get("bootstrap") or {}).get("ci")   # eval.ci
    if regime is not None:
        prm = summary["prm"]
        ranking = prm.get("ranking") or {}
        for scorer, groups in (ranking.get("scorers") or {}).items():
            for metric in RANKING_METRICS:   # each at prm.ci
                row.update(_figure(f"{regime}/ranking/{scorer}/{metric}", (groups.get(OVERALL) or {}).get(metric),
                                   ranking.get("ci")))
        for scorer, groups in (ranking.get("differences") or {}).items():
            for metric in RANKING_METRICS:
                row.update(_figure(f"{regime}/ranking/prm-{scorer}/{metric}",
                                   (groups.get(OVERALL) or {}).get(metric), ranking.get("ci")))
        if (pairs := ranking.get("pairs_with_different_labels")) is not None:
            row[f"{regime}/ranking/pairs_with_different_labels"] = float(pairs)
        row.update(ceiling_figures(prm, regime))
        row[f"{regime}/gate"] = (prm.get("gate") or {}).get("status") or "n/a"
        if (auroc := verdict_auroc(prm_metrics)) is not None:
            row[f"{regime}/verdict_auroc"] = auroc
        if (auroc := answers_auroc(prm_metrics)) is not None:
            row[f"{regime}/acceptance/heldout_auroc"] = float(auroc)
        if (moved := ((prm_metrics or {}).get("head") or {}).get("change_over_initial_norm")) is not None:
            row[f"{regime}/head/change_over_initial_norm"] = float(moved)
    differences = summary.get("differences") or {}
    modes = summary.get("modes") or {}
    for mode_regime, searches in SEARCH_CONTROLS.items():
        for search, controls in searches.items():
            if (modes.get(search) or {}).get("regime") != mode_regime:
                continue   # not run, or (best_of_n records made before the regimes) read as lookahead
            for control in controls:
                overall = ((differences.get(control) or {}).get(search) or {}).get(OVERALL) or {}
                for metric in DIFFERENCE_METRICS:
                    key = f"{regime_name(mode_regime, kind)}/difference/{search}-{control}/{metric}"
                    row.update(_figure(key, overall.get(metric), eval_level))
                    if (detectable := (overall.get(metric) or {}).get("detectable")) is not None:
                        row[f"{key}/detectable"] = float(detectable)
    for mode, entry in modes.items():
        if entry.get("regime") not in SEARCH_CONTROLS:
            continue   # a mode of no search regime (none is played today), or a record from before the regimes
        overall = (entry.get("results") or {}).get(OVERALL) or {}
        for metric in DIFFERENCE_METRICS:
            # under the run's regime: a lookahead run's greedy_sft is that run's, and its row never replaces the
            # blind run's figures when the two are joined (join_row)
            key = f"{regime or regime_name(entry['regime'], kind)}/mode/{mode}/{metric}"
            row.update(_figure(key, overall.get(metric), eval_level))
    return row


def ceiling_figures(prm: dict, regime: str) -> dict[str, float | str]:
    """The labels' ceiling beside a seed's ranking figures (``ceiling`` and ``train_ranking`` of the summary's PRM,
    :mod:`clemprm.stages.label_ceiling`): ``<regime>/ceiling/modelled`` (with its interval), ``.../split_half``,
    ``<regime>/ranking/<scorer>/learned_share``, and the PRM's train side ``<regime>/train/prm/pairwise_accuracy``
    (with its interval), ``.../learned_share``, ``.../spread_ratio`` and ``.../verdict_auroc``; none for a PRM
    measured without them."""
    ceiling, train = prm.get("ceiling") or {}, prm.get("train_ranking") or {}
    level = (prm.get("ranking") or {}).get("ci")
    figures: dict[str, float | str] = {}
    if ceiling.get("modelled"):
        figures.update(_figure(f"{regime}/ceiling/modelled", ceiling["modelled"], level))
        figures[f"{regime}/ceiling/split_half"] = _value(ceiling.get("split_half"))
    for scorer, value in (ceiling.get("learned_share") or {}).items():
        figures[f"{regime}/ranking/{scorer}/learned_share"] = _number(value)
    if train.get("pairwise_accuracy"):
        figures.update(_figure(f"{regime}/train/prm/pairwise_accuracy", train["pairwise_accuracy"], level))
        share = ((train.get("ceiling") or {}).get("learned_share") or {}).get("prm")
        figures[f"{regime}/train/prm/learned_share"] = _number(share)
        figures[f"{regime}/train/prm/spread_ratio"] = _number(train.get("spread_ratio"))
        figures[f"{regime}/train/prm/verdict_auroc"] = _number((train.get("verdicts") or {}).get("auroc"))
    return figures


def kind_differences(row: dict) -> dict[str, float | str]:
    """The probe PRM's ranking figures minus the LoRA PRM's, per search regime where a seed's row holds both
    (``<regime>/ranking/probe-lora/<metric>``): the same held-out states (the probe's run starts from the LoRA PRM's
    soft labels), but unpaired, since a summary carries each scorer's estimate and not its per-instance sums. Its
    interval is the difference of the two intervals (the probe's low minus the LoRA's high, the probe's high minus
    the LoRA's low), at their level: it holds whatever the two errors' correlation, and is wider than a paired
    interval would be. Without an interval where the two were made at different levels."""
    differences: dict[str, float | str] = {}
    for search in RANKING_BASELINES:
        for metric in RANKING_METRICS:
            lora, probe = (_estimate(row, f"{regime_name(search, kind)}/ranking/prm/{metric}") for kind in PRM_KINDS)
            if lora["value"] is None or probe["value"] is None:
                continue
            key = f"{search}/ranking/{KIND_DIFFERENCE}/{metric}"
            differences[key] = probe["value"] - lora["value"]
            if probe["level"] == lora["level"]:
                differences[f"{key}/ci"] = _interval({"ci_low": probe["ci_low"] - lora["ci_high"],
                                                      "ci_high": probe["ci_high"] - lora["ci_low"]}, lora["level"])
    return differences


def seeds_table(rows: dict[int, dict]) -> dict:
    """Per seed the figures of :func:`seed_row` (``rows``: seed -> row; a row may carry text such as the gate, an
    interval or the commit that ran it) with :func:`kind_differences` made anew from them; their mean and standard
    deviation over the seeds, only where every seed has the figure (``incomplete`` lists the others); and the
    claims of :func:`claims`."""
    rows = {seed: {**{key: value for key, value in row.items() if f"/ranking/{KIND_DIFFERENCE}/" not in key},
                   **kind_differences(row)} for seed, row in sorted(rows.items())}
    keys = sorted({key for row in rows.values() for key, value in row.items() if not isinstance(value, str)})
    mean, sd, incomplete = {}, {}, []
    for key in keys:
        values = np.array([row.get(key, math.nan) for row in rows.values()], dtype=float)
        if np.isnan(values).any():
            incomplete.append(key)
            mean[key] = sd[key] = math.nan
            continue
        mean[key] = float(values.mean())
        sd[key] = float(values.std(ddof=1)) if values.size > 1 else math.nan
    return {"seeds": rows, "mean": mean, "sd": sd, "incomplete": incomplete, "claims": claims(rows)}


def rows_of(table: dict) -> dict[int, dict]:
    """The per-seed rows of a table :func:`seeds_table` made, read back from its JSON (seeds run elsewhere: another
    machine, a cluster job, an earlier run)."""
    return {int(seed): row for seed, row in table["seeds"].items()}


def join_row(joined: dict, run_here: dict) -> dict:
    """A seed's row joined from elsewhere (``joined``) updated by the regimes run here: a regime in ``run_here``
    replaces all of that regime's figures, the other regime's stay (a lookahead run on one machine beside the blind
    run of the same seed on another)."""
    regimes_here = {key.split("/", 1)[0] for key in run_here}
    return {**{key: value for key, value in joined.items() if key.split("/", 1)[0] not in regimes_here}, **run_here}


def claim_differences() -> dict[str, tuple[str, int]]:
    """The benchmark's claims, per search regime and PRM kind, then the probe against the LoRA PRM in that regime:
    claim -> (the difference it rests on, the sign it needs)."""
    result = {}
    for search, baselines in RANKING_BASELINES.items():
        for regime in (regime_name(search, kind) for kind in PRM_KINDS):
            for baseline in baselines + REFERENCES[search]:
                reference = " (reference)" if baseline in REFERENCES[search] else ""
                result[f"{regime}: prm ranks siblings better than {baseline}{reference} (pairwise accuracy)"] = (
                    f"{regime}/ranking/prm-{baseline}/pairwise_accuracy", +1)
                result[f"{regime}: prm picks better than {baseline}{reference} (top-1 regret)"] = (
                    f"{regime}/ranking/prm-{baseline}/top1_regret", -1)
            for mode, controls in SEARCH_CONTROLS[search].items():
                for control in controls:
                    for metric in DIFFERENCE_METRICS:
                        result[f"{regime}: {mode} beats {control} on {metric}"] = (
                            f"{regime}/difference/{mode}-{control}/{metric}", +1)
        key = f"{search}/ranking/{KIND_DIFFERENCE}"
        result[f"{search}: probe ranks siblings better than lora (pairwise accuracy, unpaired)"] = (
            f"{key}/pairwise_accuracy", +1)
        result[f"{search}: probe picks better than lora (top-1 regret, unpaired)"] = (f"{key}/top1_regret", -1)
    return result


def claims(rows: dict[int, dict]) -> dict[str, dict]:
    """Each claim's paired difference, its mean over the seeds with a :data:`CLAIM_CI` (95%) interval
    (:func:`clemprm.stats.mean_over_seeds`), and whether it holds: the interval clears 0 in the claimed direction
    (None: not judged, with fewer than ``MIN_SEEDS`` seeds or where a seed lacks the figure)."""
    result = {}
    for claim, (key, sign) in claim_differences().items():
        mean = mean_over_seeds([_estimate(row, key) for row in rows.values()], CLAIM_CI)
        holds = None
        if len(rows) >= MIN_SEEDS and mean["value"] is not None:
            holds = bool(mean["ci_low"] > 0 if sign > 0 else mean["ci_high"] < 0)
        result[claim] = {"difference": key, "mean": mean, "holds": holds}
    return result


def _table_order(key: str) -> tuple:
    """Blind figures first, then lookahead, then keys of no regime; within a search regime each figure of the LoRA
    PRM's run beside the same figure of the probe's."""
    regime, _, figure = key.partition("/")
    search, kind = split_regime(regime)
    if search not in RANKING_BASELINES or kind not in PRM_KINDS:
        return len(RANKING_BASELINES), key, 0
    return list(RANKING_BASELINES).index(search), figure, PRM_KINDS.index(kind)


def markdown(table: dict) -> str:
    """The table as Markdown: one column per seed (a figure with its interval), then the mean and the standard
    deviation over the seeds; blind figures first, then lookahead, each kind of PRM beside the other
    (:func:`_table_order`); then the claims of the regimes some seed ran."""
    seeds = list(table["seeds"])
    keys = sorted({key for row in table["seeds"].values() for key in row if not key.endswith("/ci")},
                  key=_table_order)

    def show(value) -> str:
        return value if isinstance(value, str) else "n/a" if value is None or math.isnan(value) else f"{value:.3f}"

    def cell(row: dict, key: str) -> str:
        interval = row.get(f"{key}/ci")
        return show(row.get(key, math.nan)) + (f" {interval}" if interval else "")

    lines = ["| figure | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean | sd |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for key in keys:
        cells = [cell(table["seeds"][seed], key) for seed in seeds]
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {show(table['mean'].get(key, ''))} | "
                     f"{show(table['sd'].get(key, ''))} |")
    if table.get("incomplete"):
        lines += ["", "No mean (a seed lacks the figure): " + ", ".join(table["incomplete"])]
    unjudged = (f"not judged ({len(seeds)} seed{'s' if len(seeds) != 1 else ''}; {MIN_SEEDS} needed)"
                if len(seeds) < MIN_SEEDS else "n/a")
    level = f"{100 * CLAIM_CI:g}%"
    lines += ["", f"| claim (on the mean over at least {MIN_SEEDS} seeds: its {level} interval clears 0) "
              f"| mean difference [{level} interval] | holds |", "|---|---|---|"]
    ran = {key.split("/", 1)[0] for row in table["seeds"].values() for key in row}
    unrun = sorted({judged["difference"].split("/", 1)[0] for judged in table["claims"].values()} - ran)
    for claim, judged in table["claims"].items():
        if judged["difference"].split("/", 1)[0] in unrun:
            continue   # a regime no seed ran: named below the table, not listed as "not judged"
        mean = judged["mean"]
        shown = "n/a" if mean["value"] is None else f"{mean['value']:+.3f} {_interval(mean)}"
        holds = unjudged if judged["holds"] is None else "yes" if judged["holds"] else "no"
        lines.append(f"| {claim} | {shown} | {holds} |")
    if unrun:
        lines += ["", f"Not listed: the claims of {', '.join(unrun)}, which no seed ran (the table's JSON keeps them)."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ the benchmark's runs


class BenchmarkError(ValueError):
    """An argument of scripts/learning_benchmark.py that cannot be used (the message names it and what to do)."""


# the order the regimes run in, each after the regime its run starts from (SOURCES)
REGIMES = ("blind", "blind-probe", "lookahead", "lookahead-probe")
# regime -> the regime whose run it starts as a copy of (start_run): lookahead shares the blind run's soft labels, a
# probe PRM's run the soft labels and the searches' controls of the LoRA PRM's run in its search regime
SOURCES = {"blind-probe": "blind", "lookahead": "blind", "lookahead-probe": "lookahead"}
# what a started run never takes from its source's results/: the PRM (adapter, predictions, metrics), the summary
REMADE = ("prm", "prm_eval.json", "report")
PER_MODE = ("eval", "clembench", "logs/eval", "benchmarks/eval")   # results/ folders of one entry per mode


def seed_dir(workdir: Path, seed: int, regime: str) -> Path:
    """The run of one seed in one regime: ``WORKDIR/seed-<seed>/<regime>/``."""
    return Path(workdir) / f"seed-{seed}" / regime


def regimes_in_order(regimes: list[str]) -> list[str]:
    """``--regimes`` in the order they run, whatever order they were given in (:data:`REGIMES`)."""
    return [regime for regime in REGIMES if regime in regimes]


def regime_override(regime: str) -> dict:
    """What a regime sets on top of the benchmark's config files: the probe PRM for a probe regime."""
    kind = split_regime(regime)[1]
    return {} if kind == PRM_KINDS[0] else {"prm": {"kind": kind}}


def start_run(workdir: Path, seed: int, regime: str) -> None:
    """A seed's run of a regime of :data:`SOURCES` as a copy of its source run (once): Snakemake's metadata and every
    file of results/ with its mtime, so that nothing upstream reruns, less the PRM, the summary and the report
    (:data:`REMADE`), the logs and times of the stages up to the soft labels (they stay the source's), and in the
    folders per mode (:data:`PER_MODE`) every mode but those that read no PRM when the run plays the source's modes
    (the same search regime): a probe PRM's run keeps the LoRA PRM's controls, their very episodes."""
    run = seed_dir(workdir, seed, regime)
    if run.exists() or regime not in SOURCES:
        return
    source = seed_dir(workdir, seed, SOURCES[regime])
    same_modes = split_regime(regime)[0] == split_regime(SOURCES[regime])[0]
    kept = {name for name, mode in MODES.items() if mode.scorer != "prm"} if same_modes else set()
    results = source / "results"

    def ignored(folder: str, names: list[str]) -> list[str]:
        where = Path(folder).relative_to(results).as_posix()
        if where == ".":
            return [name for name in names if name in REMADE]
        if where in ("logs", "benchmarks"):
            return [name for name in names if name != "eval"]
        return [name for name in names if name.split(".")[0] not in kept] if where in PER_MODE else []

    shutil.copytree(source / ".snakemake" / "metadata", run / ".snakemake" / "metadata")
    shutil.copytree(results, run / "results", ignore=ignored)   # copy2 keeps each file's mtime


def check_plan(workdir: Path, seed_list: list[int], regimes: list[str], configs: dict[str, str]) -> None:
    """Before any seed runs (a benchmark of hours fails now, not at its last seed): each config file
    (``configs``: option -> file) reads as a config file (:func:`clemprm.config.read_config_file`) and leaves the
    PRM's kind to the regimes; and where a regime of :data:`SOURCES` runs without its source, each seed's source run
    is there to start from (its results and Snakemake's metadata) or its own run was started before.
    :class:`BenchmarkError` naming the option."""
    for option, path in configs.items():
        try:
            config = read_config_file(path)
        except ConfigError as error:
            raise BenchmarkError(f"{option}: {error}") from error
        kind = prm_kind({"config": config})
        if kind != PRM_KINDS[0]:
            raise BenchmarkError(f"{option}: {path} sets prm.kind {kind}, but the regimes choose the PRM's kind "
                                 f"({', '.join(REGIMES)}: a regime named -probe runs the probe PRM): leave prm.kind "
                                 f"out of {path}, and run --regimes with the probe regimes")
    for regime in regimes:
        source = SOURCES.get(regime)
        if source is None or source in regimes:
            continue
        lacking = [seed for seed in seed_list if not seed_dir(workdir, seed, regime).exists() and not all(
            (seed_dir(workdir, seed, source) / part).is_dir() for part in ("results", ".snakemake"))]
        if lacking:
            raise BenchmarkError(f"--regimes {regime}: a {regime} run starts from the seed's {source} run, and "
                                 f"seed(s) {', '.join(map(str, lacking))} have none under {workdir} (e.g. "
                                 f"{seed_dir(workdir, lacking[0], source)}): run --regimes {source} {regime}")


def read_added(paths: list[str]) -> dict[int, dict]:
    """The per-seed rows of the tables ``--add`` names (seeds.json files :func:`seeds_table` made elsewhere), a later
    file's seed over an earlier one's; :class:`BenchmarkError` naming a file that is missing, not JSON, or no such
    table."""
    rows = {}
    for path in paths:
        try:
            table = json.loads(Path(path).read_bytes())
        except OSError as error:
            raise BenchmarkError(f"--add {path}: cannot read it ({error.strerror})") from error
        except ValueError as error:
            raise BenchmarkError(f"--add {path}: not JSON ({error}); give a seeds.json of this benchmark") from error
        per_seed = table.get("seeds") if isinstance(table, dict) else None
        if (not isinstance(per_seed, dict) or not per_seed or not all(seed.isdigit() for seed in per_seed)
                or not all(isinstance(row, dict) for row in per_seed.values())):
            raise BenchmarkError(f"--add {path}: not a table of this benchmark with a seed in it (a seeds.json holds "
                                 f"\"seeds\": {{seed: its figures}}); give the WORKDIR/seeds.json that "
                                 f"scripts/learning_benchmark.py wrote")
        rows.update(rows_of(table))
    return rows


def measured_rows(workdir: Path, seed_list: list[int], regimes: list[str],
                  added: dict[int, dict]) -> tuple[dict[int, dict], list[str]]:
    """The table's rows: ``added`` (:func:`read_added`) joined with each seed's runs under ``workdir`` in
    ``regimes`` (:func:`seed_row` of its prm_eval.json and its PRM's metrics.json, and the commit that made it); and a
    warning for each run whose summary is missing and that no added row stands for (its figures are n/a in the
    table). :class:`BenchmarkError` for a summary that is not a prm_eval.json, one whose PRM is not its folder's
    regime (a probe PRM's run under blind/ would overwrite the LoRA PRM's figures), and when nothing at all was
    measured: a table of n/a says nothing."""
    rows, warnings = dict(added), []
    for seed in seed_list:
        row = {}
        for regime in regimes:
            path = seed_dir(workdir, seed, regime) / "results" / "prm_eval.json"
            if not path.is_file():
                if not any(key.startswith(f"{regime}/") for key in added.get(seed, {})):
                    warnings.append(f"seed {seed}, {regime}: no {path}: its figures are n/a in the table (run it "
                                    f"without --table-only, or --add the seeds.json of a run elsewhere)")
                continue
            try:
                summary = read_summary(path)
            except SummaryError as error:
                raise BenchmarkError(f"seed {seed}, {regime}: {error}") from error
            prm_metrics = _prm_metrics(path.parent / "prm" / "metrics.json", seed, regime)
            made = prm_regime(summary) and regime_name(prm_regime(summary), prm_kind(prm_metrics))
            if made not in (None, regime):
                raise BenchmarkError(f"seed {seed}, {regime}: {path} is of a {made} run (its PRM's input and kind), "
                                     f"not of the {regime} regime its folder is: move it to "
                                     f"{seed_dir(workdir, seed, made)}, or rerun the seed")
            ran_on = path.parent.parent / "commit.txt"
            row.update(seed_row(summary, prm_metrics))
            row[f"{regime}/commit"] = ran_on.read_text().strip() if ran_on.is_file() else "unknown"
        if row:
            rows[seed] = join_row(rows.get(seed, {}), row)
    if not rows:
        raise BenchmarkError(f"nothing to tabulate: no seed of --seeds {' '.join(map(str, seed_list))} has a "
                             f"prm_eval.json under {workdir} ({seed_dir(workdir, '<seed>', '<regime>')}/results/"
                             f"prm_eval.json) and --add gave no table: run the seeds (without --table-only), or give "
                             f"--workdir the folder that holds them")
    return rows, warnings


def _prm_metrics(path: Path, seed: int, regime: str) -> dict | None:
    """A run's results/prm/metrics.json beside its summary (None where there is none: a run of no PRM)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes())
    except ValueError as error:
        raise BenchmarkError(f"seed {seed}, {regime}: {path} is not JSON ({error}): rerun the seed's prm_adapter "
                             f"stage") from error
