"""The figures of the Snakemake report (``snakemake --report report.html``): the ``eval_report_figures`` stage.

* eval scores: % played, quality and clemscore per mode, per game and overall, with the bootstrap CIs of
  ``results/prm_eval.json`` (% played and quality side by side: clemscore alone hides which one moved);
* soft labels: the histogram of the branch points' labels per game (``results/labels/soft_labels.parquet``);
* PRM calibration: mean label against mean prediction per prediction bin, on the held-out branch points
  (``results/prm/metrics.json``);
* training curves: train and eval loss per epoch of the SFT and PRM adapters (their metrics' ``history``);
* sibling picks: per game, the mean label of the sibling the PRM picks against a random pick, the best sibling and
  the candidate-aware baselines' picks, on the PRM's held-out states (``prm`` of ``results/prm_eval.json``); its
  title the labels' ceiling and the PRM's pairwise accuracy and learned share of it, held-out and on its train side.

Before them, ``warnings.html`` (:func:`write_warnings_page`, included at the top of the report's front page): every
fail-fast condition a stage went on despite (``on_failure: continue``; ``upstream_warnings`` of the summary), the
summary's other warnings (a mode that searched with a PRM whose gate failed or was not judged), and the differences
whose overall covers fewer games than were played.

Inputs are read defensively: a figure whose data is missing says so instead of failing the report.

Each PNG carries the numbers it was drawn from as JSON in its ``clemprm:data`` text chunk
(:func:`figure_data` reads them back): what a figure shows can be checked without looking at it.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from clemprm.checks.run_time import WARNING_CONDITIONS

log = logging.getLogger(__name__)

DATA_KEY = "clemprm:data"   # the PNG text chunk holding a figure's data

MODE_ORDER = ("greedy_base", "greedy_sft", "random_of_n", "best_of_n", "beam_search")   # bars from plain play to search
SCORE_PANELS = (("percent_played", "% played"), ("quality", "quality (mean BENCH_SCORE of played)"),
                ("clemscore", "clemscore"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _read_json(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        log.warning("report: cannot read %s: %s", path, error)
        return {}


def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _save(plt, fig, path: str | Path, drawn: dict) -> None:
    """Write the figure with ``drawn`` (the numbers it shows) in its PNG metadata."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={DATA_KEY: json.dumps(drawn, sort_keys=True)})
    plt.close(fig)


def figure_data(path: str | Path) -> dict:
    """The numbers a report figure was drawn from (see the module docstring)."""
    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.text[DATA_KEY])


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def plot_eval_scores(summary: dict, path: str | Path) -> None:
    """Grouped bars: one panel per metric, groups = games + overall, one bar per mode, CI whiskers at eval.ci."""
    plt = _pyplot()
    entries = summary.get("modes") or {}
    modes = {mode: entries[mode].get("results") or {}
             for mode in sorted(entries, key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER))}
    groups = sorted({group for results in modes.values() for group in results} - {"overall"}) + ["overall"]
    fig, axes = plt.subplots(len(SCORE_PANELS), 1, figsize=(max(6, 2 + 0.45 * len(groups) * max(1, len(modes))), 9))
    drawn = {"groups": groups if modes else [], "modes": {mode: {} for mode in modes}}
    for ax, (metric, title) in zip(axes, SCORE_PANELS):
        if not modes:
            _no_data(ax)
            continue
        width = 0.8 / len(modes)
        for m, (mode, results) in enumerate(modes.items()):
            estimates = [results.get(group, {}).get(metric) or {} for group in groups]
            values = [_number(e.get("value")) for e in estimates]
            errors = [[max(0.0, v - _number(e.get("ci_low"))) for v, e in zip(values, estimates)],
                      [max(0.0, _number(e.get("ci_high")) - v) for v, e in zip(values, estimates)]]
            positions = [g + (m - (len(modes) - 1) / 2) * width for g in range(len(groups))]
            regime = entries[mode].get("regime", "lookahead")
            blind = regime == "blind"
            ax.bar(positions, values, width, yerr=errors, capsize=3, label=mode if blind else f"{mode} (lookahead)",
                   hatch=None if blind else "//")
            drawn["modes"][mode][metric] = {"values": values, "errors": errors}
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel(title)
        ax.set_ylim(0, 105)
    if modes:
        axes[0].legend(fontsize="small", ncol=len(modes))
    axes[0].set_title(f"{summary.get('split', '?')} split: bars = point estimate, whiskers = "
                      f"{round(100 * (summary.get('bootstrap') or {}).get('ci', 0.95))}% bootstrap CI over instances")
    if summary.get("warnings"):  # failed stages that went on (on_failure: continue), a PRM gate: say so on the figure
        fig.suptitle("WARNING (warnings in prm_eval.json):\n" + "\n".join(
            warning[:140] for warning in summary["warnings"][:5]), color="red", fontsize="small")
    _save(plt, fig, path, drawn)


def write_warnings_page(summary: dict, path: str | Path) -> None:
    """An HTML block for the top of the report's front page: the summary's ``upstream_warnings`` (stage, game,
    condition, count, first error) in red, or one line saying that no stage went on after a failure; then, in red,
    the warnings they imply or that stand beside them (a mode that searched with a PRM whose gate failed or was not
    judged); then the differences whose overall covers fewer games than were played (:func:`partial_differences`)."""
    import html

    def cell(mark, column):
        return html.escape("-" if mark.get(column) is None else str(mark[column]))

    box = '<div style="border: 3px solid #c00; color: #900; padding: 0.5em 1em; margin-bottom: 1em">\n'
    marks = summary.get("upstream_warnings") or []
    columns = ("stage", "game", "condition", "count", "first_error")
    # what the marks imply beyond them, and the PRM gate's verdict (a mode that searched with a PRM that did not pass)
    implied = [w for w in summary.get("warnings") or [] if w not in {mark.get("message") for mark in marks}]
    if marks:
        header = "".join(f"<th>{column.replace('_', ' ')}</th>" for column in columns)
        rows = "".join("<tr>" + "".join(f"<td>{cell(mark, column)}</td>" for column in columns) + "</tr>\n"
                       for mark in marks)
        failed = [mark for mark in marks if mark.get("condition") not in WARNING_CONDITIONS]
        said = ([f"{len(failed)} failed stage check(s) went on (on_failure: continue)"] if failed else []) + (
            [f"{len(marks) - len(failed)} warning(s) on what the run measured"] if len(marks) > len(failed) else [])
        text = (box + f"<p><strong>WARNING: {' and '.join(said)}; the results of this report are built on "
                f"them.</strong></p>\n"
                f"<table>\n<tr>{header}</tr>\n{rows}</table>\n</div>\n")
    else:
        text = "<p>No stage went on after a failure: every fail-fast check passed.</p>\n"
    if implied:
        text += box + "".join(f"<p><strong>WARNING:</strong> {html.escape(warning)}</p>\n" for warning in implied)
        text += "</div>\n"
    partial = partial_differences(summary)
    if partial:
        text += ("<p>Differences over the games both modes have a figure for (the mean of the per-game differences; "
                 "a mode that played no episode of a game has no quality there):</p>\n<ul>\n"
                 + "".join(f"<li>{html.escape(line)}</li>\n" for line in partial) + "</ul>\n")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def partial_differences(summary: dict) -> list[str]:
    """One line per overall difference of ``prm_eval.json`` that covers fewer games than its modes were played on
    (its ``games``), e.g. ``best_of_n - best_of_n_logprob: quality over 2 of 3 games``."""
    lines = []
    for control, modes in (summary.get("differences") or {}).items():
        for mode, groups in modes.items():
            total = len(groups) - 1   # every group but overall
            for metric, games in ((groups.get("overall") or {}).get("games") or {}).items():
                if games < total:
                    lines.append(f"{mode} - {control}: {metric} over {games} of {total} games")
    return lines


def read_soft_labels(path: str | Path) -> dict[str, list[float]]:
    """Labels per game, or {} when the file cannot be read."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["game", "label"]).to_pydict()
    except Exception as error:  # a missing or foreign file: the figure says "no data"
        log.warning("report: cannot read soft labels %s: %s", path, error)
        return {}
    labels: dict[str, list[float]] = {}
    for game, label in zip(table["game"], table["label"]):
        if label is not None and not math.isnan(label):
            labels.setdefault(game, []).append(label)
    return dict(sorted(labels.items()))


def plot_soft_labels(labels: dict[str, list[float]], path: str | Path) -> None:
    """One histogram of the soft labels per game (10 bins over [0, 1])."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, max(1, len(labels)), figsize=(4 * max(1, len(labels)), 3.2), squeeze=False)
    bins = [i / 10 for i in range(11)]
    drawn = {"bins": bins, "counts": {}}
    if not labels:
        _no_data(axes[0][0], "no soft labels")
    for ax, (game, values) in zip(axes[0], labels.items()):
        counts, _, _ = ax.hist(values, bins=bins, edgecolor="black")
        drawn["counts"][game] = [int(count) for count in counts]
        ax.set_title(f"{game} (n={len(values)})")
        ax.set_xlabel("soft label (mean continuation score / 100)")
        ax.yaxis.get_major_locator().set_params(integer=True)
    axes[0][0].set_ylabel("branch points")
    _save(plt, fig, path, drawn)


def calibration_bins(prm_metrics: dict) -> tuple[str, list[dict]]:
    """(which side, bins) of the PRM calibration table: a top-level "calibration", else the held-out side's (the
    validation-split branch points, else the validation slice of train instances), else the train side's; ("", [])
    when there is none."""
    if isinstance(prm_metrics.get("calibration"), list):
        return "", prm_metrics["calibration"]
    evaluation = prm_metrics.get("evaluation") or {}
    for side in ("heldout", "validation", "train"):
        bins = (evaluation.get(side) or {}).get("calibration")
        if isinstance(bins, list):
            return side, bins
    return "", []


def plot_calibration(side: str, bins: list[dict], path: str | Path) -> None:
    """Reliability diagram: mean label against mean prediction per bin, point area by count; the diagonal is a
    perfectly calibrated PRM."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    points = [(_number(b.get("mean_prediction")), _number(b.get("mean_label")), _number(b.get("count")))
              for b in bins if isinstance(b, dict)]
    points = [p for p in points if not any(math.isnan(v) for v in p) and p[2] > 0]
    if not points:
        _no_data(ax, "no calibration data")
    else:
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
        ax.plot([p[0] for p in points], [p[1] for p in points], color="C0")
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=[20 + 200 * p[2] / max(q[2] for q in points)
                                                                      for p in points], color="C0", zorder=3)
        for x, y, count in points:
            ax.annotate(str(int(count)), (x, y), textcoords="offset points", xytext=(5, -10), fontsize="small")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="mean PRM prediction", ylabel="mean soft label")
        ax.legend(loc="upper left", fontsize="small")
    ax.set_title(f"PRM calibration ({side or 'as reported'} branch points)")
    _save(plt, fig, path, {"side": side, "points": points})


def plot_training_curves(histories: dict[str, list[dict]], path: str | Path) -> None:
    """Per adapter: train loss (mean over the epoch's steps) and eval loss (at the epoch's end; epoch 0 = before
    training) against epoch."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(histories), figsize=(4.5 * len(histories), 3.5), squeeze=False)
    drawn = {}
    for ax, (name, history) in zip(axes[0], histories.items()):
        rows = [row for row in history if isinstance(row, dict) and row.get("epoch") is not None]
        curves = {key: [(row["epoch"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
                  for key in ("train_loss", "eval_loss")}
        drawn[name] = curves
        if not any(curves.values()):
            _no_data(ax, f"{name}: no training history")
            continue
        for key, points in curves.items():
            if points:
                ax.plot(*zip(*points), marker="o", label=key.replace("_", " "))
        ax.set(title=name, xlabel="epoch", ylabel="loss")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize="small")
    _save(plt, fig, path, drawn)


# bars of the sibling-picks figure: (label, where its estimates are in the summary's prm.ranking)
PICK_BARS = (("best sibling", ("best_label",)), ("PRM pick", ("scorers", "prm")),
             ("random pick", ("scorers", "constant_mean")), ("policy log-prob pick", ("scorers", "policy_logprob")),
             ("candidate-length pick", ("scorers", "candidate_length")))


def _pick_estimates(ranking: dict, where: tuple[str, ...], group: str) -> dict:
    entry = ranking
    for key in where:
        entry = (entry or {}).get(key) or {}
    entry = entry.get(group) or {}
    return entry if "value" in entry else entry.get("pick_label") or {}


def plot_sibling_picks(summary: dict, path: str | Path) -> None:
    """One panel per game (and overall): the mean soft label of the best sibling, of the PRM's pick, of a random
    pick (the mean sibling) and of the baselines' picks, with their bootstrap CIs, on the PRM's held-out states."""
    plt = _pyplot()
    ranking = (summary.get("prm") or {}).get("ranking") or {}
    groups = sorted(set(ranking.get("best_label") or {}) - {"overall"})
    groups += ["overall"] if groups else []
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(3.2 * max(1, len(groups)) + 1, 3.8), squeeze=False,
                             sharey=True)
    drawn = {"groups": groups, "bars": {}}
    if not groups:
        _no_data(axes[0][0], "no states with siblings (branch_points.siblings > 1)")
    for ax, group in zip(axes[0], groups):
        for b, (label, where) in enumerate(PICK_BARS):
            estimate = _pick_estimates(ranking, where, group)
            value = _number(estimate.get("value"))
            error = [[max(0.0, value - _number(estimate.get("ci_low")))],
                     [max(0.0, _number(estimate.get("ci_high")) - value)]]
            ax.bar([b], [value], 0.8, yerr=error, capsize=3, color=f"C{b}", label=label)
            drawn["bars"].setdefault(label, {"values": [], "errors": []})
            drawn["bars"][label]["values"].append(value)
            drawn["bars"][label]["errors"].append([error[0][0], error[1][0]])
        prefixes = ((ranking.get("scorers") or {}).get("prm") or {}).get(group, {}).get("prefixes")
        ax.set_title(f"{group} ({prefixes} states)")
        ax.set_xticks([])
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("mean soft label of the pick")
    if groups:
        axes[0][-1].legend(fontsize="small", loc="upper right")
    if ceiling := ceiling_data(summary.get("prm") or {}):
        fig.suptitle(ceiling_title(ceiling), fontsize="small")
        drawn["ceiling"] = ceiling
    _save(plt, fig, path, drawn)


def ceiling_data(prm: dict) -> dict | None:
    """What the sibling-picks figure says of the labels' ceiling (``ceiling`` of the summary's PRM): the modelled
    ceiling with its interval, the split-half agreement, the PRM's held-out pairwise accuracy and learned share, and
    its train side's; None for a PRM measured without it."""
    ceiling = prm.get("ceiling") or {}
    if (ceiling.get("modelled") or {}).get("value") is None:
        return None
    train = prm.get("train_ranking") or {}
    prm_overall = (((prm.get("ranking") or {}).get("scorers") or {}).get("prm") or {}).get("overall") or {}
    return {"modelled": ceiling["modelled"], "split_half": (ceiling.get("split_half") or {}).get("value"),
            "prm_pairwise_accuracy": (prm_overall.get("pairwise_accuracy") or {}).get("value"),
            "prm_learned_share": (ceiling.get("learned_share") or {}).get("prm"),
            "train_pairwise_accuracy": (train.get("pairwise_accuracy") or {}).get("value"),
            "train_learned_share": (((train.get("ceiling") or {}).get("learned_share")) or {}).get("prm")}


def ceiling_title(ceiling: dict) -> str:
    """The figure's title line of :func:`ceiling_data`."""
    def show(value, digits=3):
        return "n/a" if value is None else f"{value:.{digits}f}"

    modelled = ceiling["modelled"]
    return (f"labels' ceiling {show(modelled['value'])} [{show(modelled['ci_low'])}, {show(modelled['ci_high'])}] "
            f"(split-half {show(ceiling['split_half'])}); PRM pairwise accuracy held-out "
            f"{show(ceiling['prm_pairwise_accuracy'])} (learned share {show(ceiling['prm_learned_share'], 2)}), "
            f"train {show(ceiling['train_pairwise_accuracy'])} ({show(ceiling['train_learned_share'], 2)})")


def report_figures(summary_path: str, soft_labels_path: str, prm_metrics_path: str, sft_metrics_path: str,
                   outputs: dict[str, str]) -> None:
    """Write the five figures; ``outputs`` maps scores, soft_labels, calibration, training, sibling_picks to PNG
    paths (and warnings, when given, to the HTML page of :func:`write_warnings_page`)."""
    prm_metrics = _read_json(prm_metrics_path)
    summary = _read_json(summary_path)
    if "warnings" in outputs:
        write_warnings_page(summary, outputs["warnings"])
    plot_eval_scores(summary, outputs["scores"])
    plot_sibling_picks(summary, outputs["sibling_picks"])
    plot_soft_labels(read_soft_labels(soft_labels_path), outputs["soft_labels"])
    plot_calibration(*calibration_bins(prm_metrics), outputs["calibration"])
    plot_training_curves({"SFT adapter": _read_json(sft_metrics_path).get("history") or [],
                          "PRM adapter": prm_metrics.get("history") or []}, outputs["training"])
    log.info("report figures: %s", ", ".join(outputs.values()))


SELF_CORRECTION_BARS = (("accuracy_t1", "Acc@t1"), ("accuracy_t2", "Acc@t2"), ("delta_i_to_c", "Δ i→c"),
                        ("delta_c_to_i", "Δ c→i"), ("percent_played_t1", "played t1"),
                        ("percent_played_t2", "played t2"))


def plot_self_correction(summary: dict, score_metrics: dict, path: str | Path) -> None:
    """Eval mode ``self_correct`` and SCoRe's training: left, overall accuracy at attempts 1 and 2, the wrong -> right
    and right -> wrong shares and % played per attempt, SFT vs SCoRe policy, with CI whiskers (eval.ci); right, the mean
    reward of attempts 1 and 2 per training step, stage I then stage II."""
    plt = _pyplot()
    fig, (bars, curve) = plt.subplots(1, 2, figsize=(11, 4))
    policies = (summary.get("self_correction") or {}).get("policies") or {}
    drawn = {"bars": {}, "steps": []}
    if not policies:
        _no_data(bars, "no self_correct results")
    width = 0.8 / max(1, len(policies))
    for p, (role, entry) in enumerate(sorted(policies.items(), key=lambda item: item[0] != "sft")):
        overall = (entry.get("results") or {}).get("overall") or {}
        estimates = [overall.get(metric) or {} for metric, _ in SELF_CORRECTION_BARS]
        values = [_number(e.get("value")) for e in estimates]
        errors = [[max(0.0, v - _number(e.get("ci_low"))) for v, e in zip(values, estimates)],
                  [max(0.0, _number(e.get("ci_high")) - v) for v, e in zip(values, estimates)]]
        positions = [i + (p - (len(policies) - 1) / 2) * width for i in range(len(values))]
        bars.bar(positions, values, width, yerr=errors, capsize=3, label=f"{role} policy")
        drawn["bars"][role] = {"values": values, "errors": errors}
    if policies:
        bars.set_xticks(range(len(SELF_CORRECTION_BARS)), [label for _, label in SELF_CORRECTION_BARS],
                        fontsize="small")
        bars.set(ylim=(0, 105), ylabel="% of episodes", title="self_correct (greedy), overall")
        bars.legend(fontsize="small")
    history = [entry for entry in score_metrics.get("history") or [] if isinstance(entry, dict)]
    drawn["steps"] = [[entry.get("step"), entry.get("stage"), entry.get("reward_t1"), entry.get("reward_t2")]
                      for entry in history]
    if not history:
        _no_data(curve, "no SCoRe training history")
    else:
        steps = [entry["step"] for entry in history]
        for key, label in (("reward_t1", "reward t1"), ("reward_t2", "reward t2")):
            curve.plot(steps, [_number(entry.get(key)) for entry in history], marker="o", label=label)
        switch = next((entry["step"] for entry in history if entry.get("stage") == 2), None)
        if switch is not None:
            curve.axvline(switch - 0.5, color="grey", linestyle="--", label="stage II starts")
        curve.set(xlabel="SCoRe step", ylabel="mean success_binary reward (0-1)", title="SCoRe training", ylim=(0, 1))
        curve.xaxis.get_major_locator().set_params(integer=True)
        curve.legend(fontsize="small")
    _save(plt, fig, path, drawn)


def self_correction_figure(summary_path: str, score_metrics_path: str, output: str) -> None:
    """Write the self-correction figure (:func:`plot_self_correction`)."""
    plot_self_correction(_read_json(summary_path), _read_json(score_metrics_path), output)
    log.info("report figure: %s", output)
