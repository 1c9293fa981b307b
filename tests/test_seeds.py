"""The learning benchmark's table over seeds (clemprm.evaluation.seeds) on real summaries: the tiny pipeline's
prm_eval.json (blind: the default), the same summary with its PRM made worse, and a lookahead summary made from it."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest

from clemprm.evaluation import seeds
from tests.conftest import tiny_config


def test_the_table_over_seeds_averages_per_seed_figures_and_judges_claims_on_the_mean(completed_run):
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    assert summary["prm"]["input"] == "candidate" and seeds.prm_regime(summary) == "blind"
    row = seeds.seed_row(summary)
    prm_accuracy = summary["prm"]["ranking"]["scorers"]["prm"]["overall"]["pairwise_accuracy"]["value"]
    if prm_accuracy is None:   # the tiny run's held-out siblings may all share a label
        assert math.isnan(row["blind/ranking/prm/pairwise_accuracy"])
    else:
        assert row["blind/ranking/prm/pairwise_accuracy"] == prm_accuracy
    assert "blind/ranking/acceptance/pairwise_accuracy" in row   # the reference row beside the blind PRM
    # % played and clemscore are defined whatever was played (quality is not when nothing was); clemscore, the
    # headline, leads
    overall = summary["differences"]["random_of_n"]["best_of_n"]["overall"]
    best = overall["percent_played"]
    assert row["blind/difference/best_of_n-random_of_n/percent_played"] == best["value"]
    assert row["blind/difference/best_of_n-random_of_n/clemscore"] == overall["clemscore"]["value"]
    assert "blind: best_of_n beats random_of_n on clemscore" in seeds.claim_differences()
    assert row["blind/difference/best_of_n-random_of_n/percent_played/ci"] == (   # led by its level, eval.ci
        f"{100 * summary['bootstrap']['ci']:g}% [{best['ci_low']:+.3f}, {best['ci_high']:+.3f}]")
    assert row["blind/gate"] == summary["prm"]["gate"]["status"]
    # beside each difference the smallest the run could detect; each mode's own figures; the yardstick's size
    assert row["blind/difference/best_of_n-random_of_n/clemscore/detectable"] == overall["clemscore"]["detectable"]
    played = summary["modes"]["greedy_sft"]["results"]["overall"]["percent_played"]
    assert row["blind/mode/greedy_sft/percent_played"] == played["value"]
    bounds = f"[{played['ci_low']:+.3f}, {played['ci_high']:+.3f}]"
    assert row["blind/mode/greedy_sft/percent_played/ci"].endswith(bounds)
    assert row["blind/ranking/pairs_with_different_labels"] == summary["prm"]["ranking"]["pairs_with_different_labels"]
    assert not any(key.startswith("lookahead/") for key in row)   # no lookahead mode in the default run

    worse = copy.deepcopy(summary)
    overall = worse["prm"]["ranking"]["scorers"]["prm"]["overall"]
    overall["pairwise_accuracy"]["value"] = 0.0
    worse["differences"]["random_of_n"]["best_of_n"]["overall"]["percent_played"]["value"] = best["value"] - 10
    table = seeds.seeds_table({7: seeds.seed_row(summary), 11: {**seeds.seed_row(worse), "commit": "abc1234"}})
    assert set(table["seeds"]) == {7, 11}
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    assert table["mean"][key] == best["value"] - 5 and table["sd"][key] == math.sqrt(50)
    assert {claim["holds"] for claim in table["claims"].values()} == {None}   # two seeds judge no claim
    assert "commit" not in table["mean"]
    text = seeds.markdown(table)
    assert "| seed 7 | seed 11 | mean | sd |" in text
    line = next(line for line in text.splitlines() if line.startswith("| blind: best_of_n beats random_of_n on pe"))
    assert line.endswith("| not judged (2 seeds; 3 needed) |")
    assert "| commit | n/a | abc1234 |" in text
    assert "| lookahead: " not in text and "| blind-probe: " not in text   # regimes no seed ran: named, not listed
    assert "Not listed: the claims of blind-probe, lookahead, lookahead-probe, which no seed ran" in text
    three = seeds.seeds_table({**table["seeds"], 42: seeds.seed_row(summary)})
    claim = three["claims"]["blind: best_of_n beats random_of_n on percent_played"]
    assert claim["mean"]["value"] == pytest.approx(best["value"] - 10 / 3)
    assert claim["holds"] == (claim["mean"]["ci_low"] > 0)   # the interval clears 0, not the point estimate
    assert three["claims"]["lookahead: beam_search beats beam_search_rule on quality"]["holds"] is None   # not run
    # a table written as JSON (NaN included) reads back to the same rows: seeds run elsewhere join a later table
    again = seeds.seeds_table(seeds.rows_of(json.loads(json.dumps(table, allow_nan=True))))
    assert json.dumps(again, allow_nan=True, sort_keys=True) == json.dumps(table, allow_nan=True, sort_keys=True)


def test_a_mean_is_taken_over_the_same_seeds_only(completed_run):
    """A figure one seed lacks has no mean: two means in one claim never come from different seeds."""
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    row = seeds.seed_row(summary)
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    partial = {k: v for k, v in row.items() if not k.startswith(key)}
    table = seeds.seeds_table({7: row, 11: row, 42: partial})
    assert math.isnan(table["mean"][key]) and key in table["incomplete"]
    assert table["claims"]["blind: best_of_n beats random_of_n on percent_played"]["holds"] is None
    assert "No mean (a seed lacks the figure): " in seeds.markdown(table)


def test_a_lookahead_run_is_tabulated_apart_against_its_rule_control(completed_run):
    """A summary whose PRM read the game's reply: its ranking rows are lookahead rows, and a record of best_of_n
    read as lookahead (made before the regimes) never counts as a blind search."""
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    lookahead = copy.deepcopy(summary)
    lookahead["prm"]["input"] = "candidate_with_reply"
    lookahead["modes"]["best_of_n"]["regime"] = "lookahead"
    row = seeds.seed_row(lookahead)
    assert "lookahead/ranking/prm/pairwise_accuracy" in row and "lookahead/gate" in row
    assert not any(key.startswith("blind/ranking") or key.startswith("blind/difference/best_of_n") for key in row)
    # a seed's blind row from another table joined by its lookahead run here: both regimes' figures, each its own
    blind = {**seeds.seed_row(summary), "blind/commit": "abc1234"}
    joined = seeds.join_row(blind, {**row, "lookahead/commit": "def5678"})
    assert joined == {**blind, **row, "lookahead/commit": "def5678"}
    rerun = seeds.join_row(joined, {"blind/commit": "0123456"})   # a regime run here replaces all it held before
    assert not any(key.startswith("blind/") for key in rerun if key != "blind/commit")
    assert {key: value for key, value in rerun.items() if key.startswith("lookahead/")} == {
        **row, "lookahead/commit": "def5678"}
    legacy = copy.deepcopy(summary)
    del legacy["prm"]["input"]   # a PRM from before prm.input read the reply
    assert seeds.prm_regime(legacy) == "lookahead"


def test_a_claim_holds_when_the_mean_over_seeds_clears_0_not_when_its_point_estimate_does():
    """The blind best_of_n - random_of_n of seeds 7, 11 and 42 (docs/data/learning_seeds_2026-12-05.json): the mean is +7.2 %
    played, on the right side of 0, but its interval is not; a search that gains on every seed with tight intervals
    holds; the PRM's regret, where lower is better, holds when the interval lies below 0."""
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    measured = {7: (5.0, "[-10.000, +18.333]"), 11: (15.0, "[+1.667, +30.000]"), 42: (1.667, "[-13.333, +16.708]")}
    rows = {seed: {key: value, f"{key}/ci": interval} for seed, (value, interval) in measured.items()}
    claim = seeds.seeds_table(rows)["claims"]["blind: best_of_n beats random_of_n on percent_played"]
    assert claim["mean"]["value"] == pytest.approx(7.222, abs=1e-3) and claim["mean"]["ci_low"] < 0
    assert claim["holds"] is False
    regret = "blind/ranking/prm-candidate_length/top1_regret"
    rows = {seed: {key: gain, f"{key}/ci": f"[{gain - 2:+.3f}, {gain + 2:+.3f}]",
                   regret: -0.05, f"{regret}/ci": "[-0.070, -0.030]"}
            for seed, gain in ((7, 9.0), (11, 10.0), (42, 11.0))}
    claims = seeds.seeds_table(rows)["claims"]
    assert claims["blind: best_of_n beats random_of_n on percent_played"]["holds"] is True
    assert claims["blind: prm picks better than candidate_length (top-1 regret)"]["holds"] is True
    assert claims["blind: prm ranks siblings better than candidate_length (pairwise accuracy)"]["holds"] is None


def test_a_claim_reads_each_seed_interval_at_the_level_it_was_made_at():
    """The same bounds made at 90% stand for larger errors than at 95%: a claim whose seeds' own intervals decide
    holds at 95% made, not at 90% made; an interval written without a level (tables made before rows recorded it)
    is read at 95%."""
    key = "blind/difference/best_of_n-random_of_n/percent_played"
    claim = "blind: best_of_n beats random_of_n on percent_played"

    def rows(interval):
        return {seed: {key: 3.0, f"{key}/ci": interval} for seed in (7, 11, 42)}

    at_95 = seeds.seeds_table(rows("95% [+0.100, +5.900]"))["claims"][claim]
    at_90 = seeds.seeds_table(rows("90% [+0.100, +5.900]"))["claims"][claim]
    assert at_95["holds"] is True and at_90["holds"] is False
    assert at_90["mean"]["ci_low"] < at_95["mean"]["ci_low"]
    assert seeds.seeds_table(rows("[+0.100, +5.900]"))["claims"][claim] == at_95


# ------------------------------------------------------------------------- the probe PRM beside the LoRA PRM (issue 56)

def estimate(value: float, half: float) -> dict:
    return {"value": value, "ci_low": value - half, "ci_high": value + half}


def blind_summary(accuracy: float, regret: float, quality: float) -> dict:
    """The parts of a blind run's prm_eval.json the table reads: its PRM's ranking on held-out states (95% intervals)
    against length, and best_of_n against random_of_n."""
    ranking = {"ci": 0.95,
               "scorers": {"prm": {"overall": {"pairwise_accuracy": estimate(accuracy, 0.05),
                                               "top1_regret": estimate(regret, 0.02)}},
                           "candidate_length": {"overall": {"pairwise_accuracy": estimate(0.55, 0.05),
                                                            "top1_regret": estimate(0.11, 0.02)}}},
               "differences": {"candidate_length": {"overall": {"pairwise_accuracy": estimate(accuracy - 0.55, 0.04),
                                                                "top1_regret": estimate(regret - 0.11, 0.02)}}}}
    played = {"quality": estimate(quality, 4.0), "percent_played": estimate(2.0, 5.0)}
    return {"prm": {"input": "candidate", "ranking": ranking, "gate": {"status": "failed"}},
            "modes": {"best_of_n": {"regime": "blind"}, "random_of_n": {"regime": "blind"}},
            "differences": {"random_of_n": {"best_of_n": {"overall": played}}}, "bootstrap": {"ci": 0.95}}


PROBE = {"config": {"prm": {"kind": "probe"}},   # the probe PRM stage's metrics.json, as far as the table reads it
         "acceptance": {"accepted": 30, "examples": 60, "heldout": {"n": 20, "auroc": 0.91}}}
LORA = {"config": {"prm": {"kind": "lora"}},
        "verdicts": {"side": "validation", "n": 64, "accepted": 40, "auroc": 0.58}}


def test_a_probe_run_is_tabulated_as_its_own_regime_with_each_figure_and_its_interval():
    lora = seeds.seed_row(blind_summary(0.55, 0.10, 3.0), LORA)
    probe = seeds.seed_row(blind_summary(0.70, 0.05, 6.0), PROBE)
    assert lora["blind/ranking/prm/pairwise_accuracy"] == 0.55 and lora["blind/verdict_auroc"] == 0.58
    assert lora["blind/ranking/prm/pairwise_accuracy/ci"] == "95% [+0.500, +0.600]"   # a scorer's own interval
    assert probe["blind-probe/ranking/prm/pairwise_accuracy"] == 0.70
    assert probe["blind-probe/ranking/prm-candidate_length/top1_regret"] == pytest.approx(-0.06)
    assert probe["blind-probe/difference/best_of_n-random_of_n/quality"] == 6.0
    assert probe["blind-probe/gate"] == "failed"
    assert all(key.startswith("blind-probe/") for key in probe)   # no figure of the probe's run under blind/
    assert "blind-probe/verdict_auroc" not in probe   # these metrics carry no held-out verdicts
    assert probe["blind-probe/acceptance/heldout_auroc"] == 0.91   # the validity part on held-out answers
    assert "blind/acceptance/heldout_auroc" not in lora   # a PRM trained on no verdicts
    assert seeds.seed_row(blind_summary(0.55, 0.10, 3.0)) == {   # no metrics: a PRM from before the kinds, LoRA
        key: value for key, value in lora.items() if key != "blind/verdict_auroc"}
    assert seeds.regime_override("blind-probe") == {"prm": {"kind": "probe"}} and seeds.regime_override("blind") == {}
    assert seeds.split_regime("lookahead-probe") == ("lookahead", "probe")


def test_the_probe_is_judged_against_the_lora_prm_on_the_same_states_unpaired():
    """Per seed the probe's figure minus the LoRA PRM's, with the difference of their intervals (valid whatever the
    correlation); the claim holds on the mean over three seeds when that interval clears 0, and each kind's own
    claims are judged apart."""
    rows = {seed: {**seeds.seed_row(blind_summary(0.55 + shift, 0.10, 3.0), LORA),
                   **seeds.seed_row(blind_summary(0.75 + shift, 0.04, 6.0), PROBE)}
            for seed, shift in ((7, 0.0), (11, 0.02), (42, -0.02))}
    table = seeds.seeds_table(rows)
    key = "blind/ranking/probe-lora/pairwise_accuracy"
    assert table["seeds"][7][key] == pytest.approx(0.20)
    assert table["seeds"][7][f"{key}/ci"] == "95% [+0.100, +0.300]"   # 0.70 - 0.60, 0.80 - 0.50
    assert table["mean"][key] == pytest.approx(0.20)
    claims = table["claims"]
    accuracy = claims["blind: probe ranks siblings better than lora (pairwise accuracy, unpaired)"]
    assert accuracy["difference"] == key and accuracy["holds"] is True
    # regret 0.04 against 0.10, each +-0.02: the unpaired interval [-0.10, -0.02] clears 0
    assert claims["blind: probe picks better than lora (top-1 regret, unpaired)"]["holds"] is True
    assert claims["blind-probe: best_of_n beats random_of_n on quality"]["holds"] is True   # 6 +- 4 on every seed
    assert claims["blind: best_of_n beats random_of_n on quality"]["holds"] is False   # 3 +- 4
    assert claims["lookahead: probe ranks siblings better than lora (pairwise accuracy, unpaired)"]["holds"] is None

    close = {seed: {**seeds.seed_row(blind_summary(0.60, 0.10, 3.0), LORA),
                    **seeds.seed_row(blind_summary(0.65, 0.09, 3.0), PROBE)} for seed in (7, 11, 42)}
    accuracy_claim = "blind: probe ranks siblings better than lora (pairwise accuracy, unpaired)"
    claim = seeds.seeds_table(close)["claims"][accuracy_claim]
    assert claim["mean"]["value"] == pytest.approx(0.05) and claim["holds"] is False   # [-0.05, +0.15] per seed

    levels = {seed: {**row, "blind/ranking/prm/pairwise_accuracy/ci": "90% [+0.500, +0.600]"}
              for seed, row in close.items()}   # made at two levels: no interval, no verdict
    table = seeds.seeds_table(levels)
    assert f"{key}/ci" not in table["seeds"][7] and table["seeds"][7][key] == pytest.approx(0.05)
    assert table["claims"][accuracy_claim]["holds"] is None


def test_a_probe_run_joins_the_lora_run_of_its_seed_and_the_difference_is_made_anew():
    """A seed's LoRA row from another table joined by its probe run here: both kinds' figures, side by side in the
    Markdown, and the probe-lora difference made from them, never read from a row (a stale one is dropped)."""
    lora = {**seeds.seed_row(blind_summary(0.55, 0.10, 3.0), LORA), "blind/commit": "abc1234",
            "blind/ranking/probe-lora/pairwise_accuracy": 0.9}   # stale: made from an earlier probe run
    probe = {**seeds.seed_row(blind_summary(0.70, 0.05, 6.0), PROBE), "blind-probe/commit": "def5678"}
    joined = seeds.join_row(lora, probe)
    assert joined == {**lora, **probe}   # the blind figures stay: a regime run here replaces only its own
    table = seeds.seeds_table({7: joined, 11: joined, 42: joined})
    assert table["seeds"][7]["blind/ranking/probe-lora/pairwise_accuracy"] == pytest.approx(0.15)
    assert table["seeds"][7]["blind-probe/commit"] == "def5678"
    alone = seeds.seeds_table({7: lora})["seeds"][7]   # no probe figures: no difference
    assert not any("/probe-lora/" in key for key in alone)
    lines = seeds.markdown(table).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| blind/ranking/prm/pairwise_accuracy |"))
    assert lines[at + 1].startswith("| blind-probe/ranking/prm/pairwise_accuracy | 0.700 95% [+0.650, +0.750] |")
    assert lines[at + 4].startswith("| blind/ranking/probe-lora/pairwise_accuracy | 0.150 95% [+0.050, +0.250] |")
    assert any(line.startswith("| blind: probe ranks siblings better than lora (pairwise accuracy, unpaired) | "
                               "+0.150 ") for line in lines)


def write_run(run: Path, kind: str, scores: list[float]) -> None:
    """A run's results/prm/metrics.json of a PRM of ``kind`` whose held-out ranking is measured by the stage's own
    ranking_metrics (8 states of two siblings, labels 1 and 0, the PRM's ``scores`` in that order) and its real
    prm_eval.json (of no mode), made from it."""
    from clemprm.config import sections
    from clemprm.evaluation import evaluate
    from clemprm.stages.prm_data import Example
    from clemprm.stages.prm_metrics import ranking_metrics

    examples = [Example([1], False, float(i % 2 == 0), ("wordle", "0_high", str(i // 4)), state_id=str(i // 2))
                for i in range(16)]
    ranking = ranking_metrics(examples, {"prm": scores, "candidate_length": [float(i % 3) for i in range(16)]},
                              200, 0, 0.95)
    metrics = {"config": {"prm": {"kind": kind}}, "input": "candidate", "loss": "bce", "pairwise_weight": 1.0,
               "examples": {"heldout_instances": 4}, "ranking": {**ranking, "side": "heldout"}, "baselines": {},
               "evaluation": {"heldout": {"n": 16, "pearson": None, "spearman": None, "auroc": None}},
               "gate": {"status": "failed", "checks": [], "reported": [], "not_judged": []}}
    (run / "results" / "prm").mkdir(parents=True)
    (run / "results" / "prm" / "metrics.json").write_text(json.dumps(metrics))
    evaluate.summarize_eval(sections(tiny_config(), "seed", "model", "games", "eval"), [],
                            str(run / "results/prm_eval.json"), prm_metrics_path=str(run / "results/prm/metrics.json"))


def test_each_kind_is_read_from_its_own_folder_and_a_run_in_the_wrong_folder_is_refused(tmp_path):
    right = [1.0, 0.0] * 8   # every differently labelled pair ranked right
    write_run(seeds.seed_dir(tmp_path, 7, "blind"), "lora", [0.0, 1.0] * 8)
    write_run(seeds.seed_dir(tmp_path, 7, "blind-probe"), "probe", right)
    rows, warnings = seeds.measured_rows(tmp_path, [7], ["blind", "blind-probe"], {})
    assert warnings == []
    assert rows[7]["blind/ranking/prm/pairwise_accuracy"] == 0.0
    assert rows[7]["blind-probe/ranking/prm/pairwise_accuracy"] == 1.0
    assert rows[7]["blind/commit"] == rows[7]["blind-probe/commit"] == "unknown"
    assert seeds.seeds_table(rows)["seeds"][7]["blind/ranking/probe-lora/pairwise_accuracy"] == 1.0
    write_run(seeds.seed_dir(tmp_path, 11, "blind"), "probe", right)   # a probe PRM's run in the LoRA PRM's folder
    with pytest.raises(seeds.BenchmarkError, match=r"^seed 11, blind: .*prm_eval.json is of a blind-probe run .*, "
                                                   r"not of the blind regime its folder is: move it to .*blind-probe"):
        seeds.measured_rows(tmp_path, [7, 11], ["blind", "blind-probe"], {})


def test_a_probe_run_starts_from_the_lora_run_keeping_the_soft_labels_and_the_controls_episodes(tmp_path):
    """blind-probe starts as a copy of the blind run (mtimes and Snakemake's metadata kept) less the PRM (its adapter,
    predictions and metrics: the probe retrains and remeasures), what reads it, the summary and the report, and less
    the logs and times of the shared stages; lookahead keeps no mode of the blind run (it plays others); a run started
    before is left as it is."""
    blind = seeds.seed_dir(tmp_path, 7, "blind")
    metadata = "cmVzdWx0cy9wcm1fZXZhbC5qc29u"   # Snakemake's record of results/prm_eval.json
    made = ["results/labels/soft_labels.parquet", "results/rollouts/base_train.parquet", "results/prm/metrics.json",
            "results/prm/predictions.parquet", "results/prm/adapter/adapter_config.json", "results/prm_eval.json",
            "results/report/prm_calibration.png", "results/eval/random_of_n.parquet",
            "results/eval/best_of_n.parquet", "results/eval/best_of_n_logprob.parquet",
            "results/clembench/random_of_n/run/instance.json", "results/clembench/best_of_n/run/instance.json",
            "results/logs/soft_labels/0.log", "results/logs/prm_adapter.log", "results/logs/prm_metrics.log",
            "results/logs/eval/random_of_n.log",
            "results/logs/eval/best_of_n.log", "results/benchmarks/prm_adapter.tsv",
            "results/benchmarks/eval/random_of_n.tsv", "results/benchmarks/eval/best_of_n.tsv",
            f".snakemake/metadata/{metadata}"]
    for name in made:
        (blind / name).parent.mkdir(parents=True, exist_ok=True)
        (blind / name).write_text(name)
        os.utime(blind / name, (1_000_000, 1_000_000))

    def files(run: Path) -> set[str]:
        return {path.relative_to(run).as_posix() for path in run.rglob("*") if path.is_file()}

    seeds.start_run(tmp_path, 7, "blind-probe")
    probe = seeds.seed_dir(tmp_path, 7, "blind-probe")
    assert files(probe) == {"results/labels/soft_labels.parquet", "results/rollouts/base_train.parquet",
                            "results/eval/random_of_n.parquet", "results/eval/best_of_n_logprob.parquet",
                            "results/clembench/random_of_n/run/instance.json", "results/logs/eval/random_of_n.log",
                            "results/benchmarks/eval/random_of_n.tsv", f".snakemake/metadata/{metadata}"}
    assert (probe / "results/eval/random_of_n.parquet").stat().st_mtime == 1_000_000
    seeds.start_run(tmp_path, 7, "lookahead")
    assert files(seeds.seed_dir(tmp_path, 7, "lookahead")) == {
        "results/labels/soft_labels.parquet", "results/rollouts/base_train.parquet",
        f".snakemake/metadata/{metadata}"}
    (probe / "results/eval/best_of_n.parquet").write_text("played by the probe")
    seeds.start_run(tmp_path, 7, "blind-probe")   # started before: nothing copied again
    assert (probe / "results/eval/best_of_n.parquet").read_text() == "played by the probe"


def test_the_plan_needs_each_regime_s_source_run_and_leaves_the_prm_kind_to_the_regimes(tmp_path):
    config = tmp_path / "learning.yaml"
    config.write_text("seed: 7\n")
    with pytest.raises(seeds.BenchmarkError, match=r"^--regimes blind-probe: a blind-probe run starts from the seed's "
                                                   r"blind run, and seed\(s\) 7, 11 have none under .*: run --regimes "
                                                   r"blind blind-probe$"):
        seeds.check_plan(tmp_path, [7, 11], ["blind-probe"], {"--config": str(config)})
    with pytest.raises(seeds.BenchmarkError, match=r"^--regimes lookahead-probe: .* from the seed's lookahead run"):
        seeds.check_plan(tmp_path, [7], ["blind", "lookahead-probe"], {"--config": str(config)})
    seeds.check_plan(tmp_path, [7], ["blind", "blind-probe", "lookahead", "lookahead-probe"], {"--config": str(config)})
    for part in ("results", ".snakemake"):
        (seeds.seed_dir(tmp_path, 7, "blind") / part).mkdir(parents=True)
    seeds.check_plan(tmp_path, [7], ["blind-probe"], {"--config": str(config)})   # the blind run is there
    config.write_text("prm:\n  kind: probe\n")
    with pytest.raises(seeds.BenchmarkError, match=r"^--config: .*learning.yaml sets prm.kind probe, but the regimes "
                                                   r"choose the PRM's kind"):
        seeds.check_plan(tmp_path, [7], ["blind"], {"--config": str(config)})
    assert seeds.regimes_in_order(["lookahead-probe", "lookahead", "blind-probe", "blind"]) == [
        "blind", "blind-probe", "lookahead", "lookahead-probe"]
