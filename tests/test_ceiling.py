"""The labels' ceiling (clemprm.stages.label_ceiling) on siblings whose true values are known."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from clemprm.stages import label_ceiling
from clemprm.stages.prm_metrics import sibling_statistics, states_with_siblings


@dataclass
class Sibling:
    label: float
    key: tuple
    state_id: str
    row: int
    multiplicity: int = 1


def simulated(states: int = 400, siblings: int = 4, k: int = 4, seed: int = 0):
    """Siblings whose true values are drawn from Beta(0.6, 1.4) per state, each labelled by k Bernoulli
    continuations (scores 0 or 100): examples, rows and the true values."""
    rng = np.random.default_rng(seed)
    examples, rows, truth = [], [], []
    for state in range(states):
        for _ in range(siblings):
            value = rng.beta(0.6, 1.4)
            scores = [100.0 * s for s in rng.binomial(1, value, k)]
            rows.append({"label": sum(scores) / 100 / k, "rollout_scores": scores, "k": k, "terminal": False})
            examples.append(Sibling(rows[-1]["label"], ("g", "e", str(state % 50)), f"s{state}", len(rows) - 1))
            truth.append(value)
    return examples, rows, truth


def pairwise_accuracy(examples, scores) -> float:
    concordant = pairs = 0.0
    for group in states_with_siblings(examples):
        c, p, _ = sibling_statistics([scores[i] for i in group], [examples[i].label for i in group])
        concordant, pairs = concordant + c, pairs + p
    return concordant / pairs


def test_a_perfect_scorer_reaches_the_modelled_ceiling():
    examples, rows, truth = simulated()
    perfect = pairwise_accuracy(examples, truth)
    modelled = label_ceiling.modelled_ceiling(examples, rows, ci=0.95, seed=1, simulations=100)
    assert 0.6 < modelled["value"] < 0.95
    assert modelled["value"] == pytest.approx(perfect, abs=0.03)
    assert modelled["ci_low"] <= modelled["value"] <= modelled["ci_high"]


def test_the_split_half_agreement_and_a_constant_scorers_share():
    examples, rows, truth = simulated(states=200)
    halves = label_ceiling.split_half_agreement(examples, rows)
    assert 0.5 < halves["value"] < 1.0 and halves["pairs"] > 100
    for row in rows:   # identical halves order every pair alike
        row["rollout_scores"] = row["rollout_scores"][:2] * 2
    assert label_ceiling.split_half_agreement(examples, rows)["value"] == 1.0
    assert label_ceiling.learned_share(0.5, 0.8) == 0.0   # a constant scorer ties every pair: 0.5
    assert label_ceiling.learned_share(0.8, 0.8) == 1.0 and label_ceiling.learned_share(0.6, 0.5) is None


def test_terminal_siblings_keep_their_exact_label():
    examples, rows, _ = simulated(states=50)
    for row in rows[::4]:
        row.update(terminal=True, k=0, rollout_scores=[100.0], label=1.0)
    modelled = label_ceiling.modelled_ceiling(examples, rows, ci=0.95, seed=0, simulations=20)
    assert modelled["simulations"] == 20 and modelled["value"] > 0.5


def test_labels_with_no_pair_to_rank_have_no_ceiling():
    """Siblings that all carry one label (a first run's held-out states: no episode won) allow no ranking figure;
    the simulations' rare draws of a pair must not read as a ceiling of 1."""
    examples, rows, _ = simulated(states=40)
    for example, row in zip(examples, rows):
        row.update(label=0.0, rollout_scores=[0.0] * 4)
        example.label = 0.0
    for i in range(4):   # state 0's siblings: a prior with some spread, still one label per state
        rows[i].update(label=0.25, rollout_scores=[100.0, 0.0, 0.0, 0.0])
        examples[i].label = 0.25
    modelled = label_ceiling.modelled_ceiling(examples, rows, ci=0.95, seed=0, simulations=20)
    assert modelled == {"value": None, "ci_low": None, "ci_high": None, "simulations": 0}
    rows[4].update(label=0.25, rollout_scores=[100.0, 0.0, 0.0, 0.0])   # one pair to rank: a ceiling again
    examples[4].label = 0.25
    assert label_ceiling.modelled_ceiling(examples, rows, ci=0.95, seed=0, simulations=20)["value"] is not None


def test_metrics_carry_the_ceiling_and_the_train_side_and_the_summary_prints_them(tmp_path, test_cache_dir):
    from clemprm.evaluation import console, evaluate
    from tests.test_prm import prm_settings, synthetic_rows, train_and_measure, write_labels

    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows()[:32])
    metrics = train_and_measure(prm_settings(epochs=1, batch_size=8, grad_accum=1), labels, str(tmp_path / "adapter"),
                                str(tmp_path / "metrics.json"), test_cache_dir, on_failure="continue")
    assert {"split_half", "modelled", "learned_share"} <= set(metrics["ceiling"])
    assert metrics["ceiling"]["side"] == metrics["ranking"]["side"]
    assert set(metrics["ceiling"]["learned_share"]) == set(metrics["ranking"]["scorers"])
    assert metrics["ceiling"]["learned_share"]["constant_mean"] in (0.0, None)   # a constant scorer shows nothing
    train = metrics["train_ranking"]
    assert {"pairwise_accuracy", "top1_regret", "spread_ratio", "verdicts", "ceiling"} <= set(train)
    assert set(train["baselines"]) == {"constant_mean", "candidate_length"}
    assert set(train["ceiling"]["learned_share"]) == {"prm", "constant_mean", "candidate_length"}
    assert train["verdicts"]["n"] == metrics["examples"]["train"] and train["pairwise_accuracy"]["value"] is not None
    text = "\n".join(console.ceiling_lines(evaluate.prm_summary(metrics)))
    assert f"PRM pairwise accuracy {console.estimate(train['pairwise_accuracy'], 3)}" in text


def figure(value: float, half: float = 0.05) -> dict:
    return {"value": value, "ci_low": value - half, "ci_high": value + half}


def failed_gate(check: str = "pairwise_accuracy") -> dict:
    return {"status": "failed", "checks": [{"check": check, "passed": False, "message": "below length"}],
            "reported": [], "not_judged": []}


def train_side(accuracy: float, share: float | None, half: float = 0.05) -> dict:
    return {"pairwise_accuracy": figure(accuracy, half), "ceiling": {"learned_share": {"prm": share}}}


def test_a_failed_ranking_check_is_diagnosed_underfit_or_not_transferring_from_the_train_side():
    from clemprm.stages.prm_evaluation import gate_diagnosis
    from clemprm.stages.prm_metrics import gate_lines

    assert gate_diagnosis(failed_gate(), train_side(0.56, 0.2)).startswith("underfit")
    assert gate_diagnosis(failed_gate(), train_side(0.70, 0.67, half=0.25)).startswith("underfit")   # reaches 0.5
    transfer = gate_diagnosis(failed_gate("top1_regret"), train_side(0.72, 0.73))
    assert transfer.startswith("does not transfer")
    assert gate_diagnosis(failed_gate("spread"), train_side(0.56, 0.2)) is None   # no ranking check failed
    assert gate_diagnosis(failed_gate(), {}) is None   # the train side not measured
    assert f"DIAGNOSIS {transfer}" in gate_lines({**failed_gate(), "diagnosis": transfer}).splitlines()


def prm_with_ceiling() -> dict:
    """The parts of a summary's PRM the table, the report and the seeds table read of the ceiling."""
    ranking = {"ci": 0.95, "prefixes": 60, "pairs_with_different_labels": 97,
               "best_label": {"g": figure(0.3), "overall": figure(0.3)},
               "scorers": {name: {group: {"pairwise_accuracy": figure(accuracy), "top1_regret": figure(0.1),
                                          "pick_label": figure(0.2), "prefixes": 60}
                                  for group in ("g", "overall")}
                           for name, accuracy in (("prm", 0.65), ("constant_mean", 0.5))}}
    return {"input": "candidate", "ranking": ranking, "gate": {**failed_gate(), "diagnosis": "underfit: x"},
            "ceiling": {"side": "heldout", "split_half": {"value": 0.81, "pairs": 90},
                        "modelled": {**figure(0.8), "simulations": 200},
                        "learned_share": {"prm": 0.5, "constant_mean": 0.0}},
            "train_ranking": {"pairs_with_different_labels": 98, "pairwise_accuracy": figure(0.72),
                              "top1_regret": figure(0.08), "spread_ratio": 0.12, "verdicts": {"auroc": 0.57},
                              "baselines": {"constant_mean": {"pairwise_accuracy": figure(0.5)}},
                              "ceiling": {"modelled": figure(0.78), "learned_share": {"prm": 0.79}}}}


def test_the_summary_table_report_and_seeds_table_show_the_ceiling_and_each_learned_share(tmp_path):
    from clemprm.evaluation import console, report, seeds

    prm = prm_with_ceiling()
    rows = {row[0]: row for row in console.ranking_rows(prm)}
    assert rows["prm"][2] == "0.50" and rows["random pick"][2] == "0.00"
    text = console.summary_table({"split": "test", "bootstrap": {"ci": 0.95}, "prm": prm})
    assert "learned share" in text and "0.800 [0.750, 0.850]" in text and "split-half agreement 0.810" in text
    assert "PRM pairwise accuracy 0.720 [0.670, 0.770] (learned share 0.79)" in text
    assert "prediction spread 0.12 of the labels', verdict AUROC 0.570;" in text
    assert "gate diagnosis: underfit: x" in text

    report.plot_sibling_picks({"prm": prm}, tmp_path / "picks.png")
    drawn = report.figure_data(tmp_path / "picks.png")["ceiling"]
    assert drawn["modelled"]["value"] == 0.8 and drawn["prm_learned_share"] == 0.5
    assert drawn["train_pairwise_accuracy"] == 0.72 and drawn["train_learned_share"] == 0.79

    row = seeds.seed_row({"prm": prm}, {"head": {"change_over_initial_norm": 1.38}})
    assert row["blind/train/prm/spread_ratio"] == 0.12 and row["blind/train/prm/verdict_auroc"] == 0.57
    assert row["blind/head/change_over_initial_norm"] == 1.38
    assert row["blind/ceiling/modelled"] == 0.8 and row["blind/ceiling/modelled/ci"] == "95% [+0.750, +0.850]"
    assert row["blind/ceiling/split_half"] == 0.81 and row["blind/ranking/prm/learned_share"] == 0.5
    assert row["blind/train/prm/pairwise_accuracy"] == 0.72 and row["blind/train/prm/learned_share"] == 0.79
    assert "| blind/ranking/prm/learned_share | 0.500 |" in seeds.markdown(seeds.seeds_table({7: row}))
