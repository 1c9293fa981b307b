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
    text = "\n".join(console.ceiling_lines(evaluate.prm_summary(metrics)))
    assert ("train side: pairwise accuracy" in text) == bool(train["pairwise_accuracy"])
