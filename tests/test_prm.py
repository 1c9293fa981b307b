"""The PRM stage on the tiny model (CPU): the pair text, the instance split, training (BCE and MSE, seeded), the
metrics against the baselines, and the scorer (batching, left truncation, a reloaded adapter)."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import pytest
import torch

from clemprm import records, stats
from clemprm.models import prm as prm_model
from clemprm.models import scoring
from clemprm.stages import prm, prm_data, prm_evaluation, prm_metrics
from clemprm.models.loader import ModelConfig
from clemprm.play.chat import render_answered
from clemprm.play.contract import Pair
from clemprm.training import schedule_factor, split_instances
from tests.conftest import tiny_config

MARKER = "apple"
WORDS = ["river", "chair", "table", "green", "house", "seven", "tree", "stone"]
POSITIVE, NEGATIVE = 0.875, 0.125      # soft labels (7 of 8 and 1 of 8 continuations won)


def soft_label_row(game: str, experiment: str, game_id: int, turn: int, prefix: list[dict], candidate: str,
                   label: float) -> dict:
    episode_id = f"{game}/{experiment}/{game_id}/0"
    scores = [100.0] * round(8 * label) + [0.0] * (8 - round(8 * label))
    # the turns of an instance share their prefix: siblings of one state
    return {"bp_id": f"{episode_id}/{turn}", "prefix_id": f"{episode_id}/0", "episode_id": episode_id, "game": game,
            "experiment": experiment, "game_id": game_id, "split": "train", "turn_idx": turn, "player": "Player 1",
            "game_role": "Guesser",
            "prefix": prefix, "candidate": candidate, "history": [candidate], "parse_ok": True,
            "reply": "", "seed": turn,
            "episode_bench_score": 0.0, "episode_success": False, "episode_aborted": False, "k": 8, "terminal": False,
            "rollout_scores": scores, "n_aborted": 0, "n_success": round(8 * label), "n_capped": 0, "new_tokens": 0,
            "label": label, "multiplicity": 1}


def synthetic_rows() -> list[dict]:
    """Two games x two experiments (the same game ids in both) x 6 instances x 2 turns: a candidate naming the
    marker word is labelled high, any other low. g1 has more marked candidates than g2, so the game alone tells
    something, but not everything."""
    rows = []
    for game, marked_share in (("g1", 3), ("g2", 1)):
        for experiment in ("e0", "e1"):
            for game_id in range(6):
                prefix = [{"role": "system", "content": "You play a word game."},
                          {"role": "user", "content": f"Round {game_id}."},
                          {"role": "user", "content": "Name a word."}]     # merged with the one before
                for turn in range(2):
                    marked = (2 * game_id + turn) % 4 < marked_share
                    word = WORDS[(game_id + 3 * turn) % len(WORDS)]
                    candidate = f"I say {word} {MARKER}" if marked else f"I say {word} {WORDS[(game_id + 5) % 8]}"
                    rows.append(soft_label_row(game, experiment, game_id, turn, prefix, candidate,
                                               POSITIVE if marked else NEGATIVE))
    return rows


def prm_settings(merge: dict | None = None, **prm_overrides) -> dict:
    config = tiny_config(prm={"warmup_ratio": 0.0, "max_examples": None, **prm_overrides},
                         **({"merge": merge} if merge else {}))
    return {name: config[name] for name in ("seed", "model", "prm")}


def train_and_measure(settings: dict, labels: str, adapter: str, metrics_path: str, cache_dir: str | None = None, *,
                      on_failure: str = "stop", probabilities: bool = False, **training) -> dict:
    """Both PRM rules as the pipeline runs them: prm_adapter's training (its predictions beside ``metrics_path``), then
    prm_metrics's measuring and gate; returns the metrics."""
    predictions = str(Path(metrics_path).with_suffix(".predictions.parquet"))
    prm.train_prm(settings, labels, adapter, predictions, cache_dir, **training)
    return prm_evaluation.measure_prm(settings, labels, predictions, metrics_path, on_failure, probabilities)


def write_labels(path, rows) -> str:
    records.write_records(path, rows, records.SOFT_LABELS, {})
    return str(path)


def pairs_of(rows) -> list[Pair]:
    """The rows as a lookahead search gives them to a scorer (the game's reply and verdict included)."""
    return [Pair(row["prefix"], row["candidate"], row["reply"], row["parse_ok"]) for row in rows]


def instance_key_of(row: dict) -> tuple[str, ...]:
    return records.instance_key(row["game"], row["experiment"], row["game_id"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, test_cache_dir):
    tmp = tmp_path_factory.mktemp("prm")
    rows = synthetic_rows()
    settings = prm_settings(lr=3e-3, epochs=12, batch_size=8, grad_accum=1, validation_fraction=0.25,
                            early_stopping_patience=4)   # AUROC 1.0 on held-out instances for seeds 1-8
    metrics = train_and_measure(settings, write_labels(tmp / "labels.parquet", rows), str(tmp / "adapter"),
                                str(tmp / "metrics.json"), test_cache_dir)
    scorer = prm_model.load_prm(settings["model"], settings["prm"], str(tmp / "adapter"), test_cache_dir)
    return {"settings": settings, "metrics": metrics, "dir": tmp, "rows": rows, "scorer": scorer}


# ------------------------------------------------------------------------------------ no model


def test_micro_batches_are_length_sorted_under_the_budget():
    lengths = [5, 40, 12, 40, 7, 100]
    batches = scoring.micro_batches(lengths, token_budget=80)
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    assert batches[0] == [5]                                             # longer than the budget: alone
    assert all(len(batch) * lengths[batch[0]] <= 80 for batch in batches[1:])
    assert [lengths[i] for batch in batches for i in batch] == sorted(lengths, reverse=True)


def test_shared_prefix_groups_keep_a_token_of_each_pair_and_a_minimum_length():
    assert scoring.common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
    assert scoring.common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2                  # identical: the last token stays
    assert scoring.common_prefix_length([[1, 2], [9, 2]]) == 0
    base = list(range(100, 100 + scoring.MIN_SHARED_TOKENS))
    sequences = [base + [1], base + [2, 3], base[1:] + [4], [7] * 30, base + [5]]
    groups, alone = scoring.shared_prefix_groups(sequences, keys=["a", "a", "b", "c", "a"])
    assert [(g.shared, g.rows, g.longest) for g in groups] == [(len(base), [0, 1, 4], len(base) + 2)]
    assert alone == [2, 3]                                                       # a key's only pair
    groups, alone = scoring.shared_prefix_groups(sequences, keys=["a", "a", "a", "b", "b"])
    assert groups == [] and alone == [0, 1, 2, 3, 4]     # a shifted start (left truncation) shares nothing
    assert scoring.shared_prefix_groups(sequences, keys=None) == ([], [0, 1, 2, 3, 4])
    groups = [scoring.PrefixGroup(shared, [0, 1], shared + 10) for shared in (20, 50, 40)]
    assert [[g.shared for g in batch] for batch in scoring.group_batches(groups, 100)] == [[50, 40], [20]]
    assert [[g.shared for g in batch] for batch in scoring.group_batches(groups, 1000)] == [[50, 40, 20]]
    many_rows = [scoring.PrefixGroup(20, list(range(8)), 40), scoring.PrefixGroup(18, [0, 1], 38)]
    assert len(scoring.group_batches(many_rows, 100)) == 2                   # 10 suffixes of 20 tokens: over budget


def test_metric_functions():
    assert stats.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert stats.pearson([1, 1, 1], [0, 1, 0]) is None                    # a constant side
    assert stats.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert stats.auroc([0.9, 0.8, 0.1, 0.2], [1, 0.75, 0, 0.25]) == 1.0
    assert stats.auroc([0.1, 0.9], [1, 0]) == 0.0 and stats.auroc([0.5, 0.5], [1, 0]) == 0.5
    assert stats.auroc([0.2, 0.4], [0.7, 0.9]) is None                    # one class only
    table = prm_metrics.calibration([0.05, 0.07, 0.95, 1.0], [0, 1, 1, 1])
    assert len(table) == 10 and [row["count"] for row in table] == [2] + [0] * 8 + [2]
    assert table[0]["mean_prediction"] == pytest.approx(0.06) and table[0]["mean_label"] == 0.5
    assert table[5]["mean_prediction"] is None
    metrics = prm_metrics.prediction_metrics([0.5, 0.5], [1.0, 0.0])
    assert metrics["bce"] == pytest.approx(0.6931, abs=1e-4) and metrics["mse"] == 0.25
    assert prm_metrics.prediction_metrics([], []) is None
    assert prm.effective_grad_accum(batch_size=8, grad_accum=16, n_train=20) == 3   # 3 batches per epoch
    assert prm.effective_grad_accum(batch_size=8, grad_accum=2, n_train=1000) == 2


def test_gradient_accumulation_over_processes_is_kept_or_refused_never_changed_silently(monkeypatch):
    """As SFT: over 2 processes grad_accum 1 cannot keep the effective batch (it would double): refused by key."""
    from clemprm import distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ValueError, match="prm.grad_accum 1 is not a multiple of the job's 2 processes"):
        prm.effective_grad_accum(batch_size=8, grad_accum=1, n_train=1000)
    assert prm.effective_grad_accum(batch_size=8, grad_accum=4, n_train=20) == 2   # capped at 3 batches, even
    assert prm.effective_grad_accum(batch_size=8, grad_accum=4, n_train=1000) == 4


def test_no_prm_optimizer_step_runs_at_learning_rate_0(tmp_path, test_cache_dir):
    """One optimizer step, all of it warmup: transformers' schedule ran it at lr 0 and trained nothing (the stage then
    said "untrained"); the PRM's schedule starts its warmup above 0."""
    settings = prm_settings(warmup_ratio=0.5, epochs=1, batch_size=64, grad_accum=1, validation_fraction=0.0)
    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows()[:24])
    metrics = train_and_measure(settings, labels, str(tmp_path / "adapter"), str(tmp_path / "metrics.json"),
                                test_cache_dir, on_failure="continue")
    assert metrics["status"] == "trained" and metrics["steps"] == 1
    assert metrics["learning_rates"]["min"] == pytest.approx(settings["prm"]["lr"] / 2)


def test_schedule_factor_never_runs_a_step_at_zero():
    for kind in ("linear", "cosine", "constant_with_warmup"):
        factors = [schedule_factor(kind, 3, 20)(step) for step in range(20)]
        assert min(factors) > 0 and max(factors) == 1.0 and factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert [schedule_factor("linear", 0, 4)(step) for step in range(4)] == [1.0, 0.75, 0.5, 0.25]
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'polynomial'"):
        schedule_factor("polynomial", 0, 4)


def test_the_head_fitted_on_frozen_features_and_its_own_lr_leave_the_random_start(tmp_path, test_cache_dir):
    """The LoRA PRM's head barely moved from N(0, 0.02) in a short run at lr 5e-4 (change 0.0x of its norm); fitted
    on the frozen features first (prm.head_init: probe) and trained at prm.head_lr it moves by more than its
    initial norm, and the record says how far."""
    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows()[:32])
    moved = {}
    for name, overrides in {"random": {}, "probe": {"head_init": "probe", "head_lr": 1e-2}}.items():
        settings = prm_settings(epochs=1, batch_size=8, grad_accum=1, validation_fraction=0.0, **overrides)
        metrics = train_and_measure(settings, labels, str(tmp_path / name), str(tmp_path / f"{name}.json"),
                                    test_cache_dir, on_failure="continue")
        moved[name] = metrics["head"]["change_over_initial_norm"]
        assert metrics["head"]["initial_std"] == pytest.approx(0.02, rel=0.3)
    assert moved["random"] < 0.5 < 1.0 < moved["probe"]
    assert metrics["head_init"]["examples"] == 32 and metrics["head_init"]["l2"] in settings["prm"]["probe"]["l2"]
    assert metrics["head_init"]["criterion"] in ("pairwise_accuracy", "loss", None)
    assert "marks" not in metrics["head_init"]   # its warning went to the metrics' marks


def played_episodes(tmp_path, scripted_policy) -> str:
    """Episode records of the built-in games' train and validation instances played by a policy that breaks the
    rules on every other turn (guessnumber answers a number or nonsense; the others nonsense or a move)."""
    from clemprm.play.catalog import GameCatalog
    from clemprm.play.contract import Sampling
    from clemprm.play.engine import RolloutEngine
    from tests.conftest import binary_search_answer

    def answer(messages):
        if len(messages) % 4 == 3:
            return "I have no idea."
        return binary_search_answer(messages) if "GUESS" in messages[0]["content"] else "ANSWER: apple"

    catalog = GameCatalog(tiny_config()["games"])
    engine = RolloutEngine(catalog, Sampling(max_new_tokens=16))
    rows = engine.play(catalog.all_instances("train") + catalog.all_instances("validation"),
                       [scripted_policy(answer)], repeats=1, base_seed=3, stage="test", policy_name="scripted")
    path = tmp_path / "episodes.parquet"
    records.write_records(path, rows, records.EPISODES, {})
    return str(path)


def played_answers(tmp_path, scripted_policy) -> str:
    """The answers records (clemprm.stages.answers) of :func:`played_episodes`' train episodes."""
    from clemprm.stages import answers

    rows = answers.deduplicated(answers.episode_plays(played_episodes(tmp_path, scripted_policy), "base_rollouts"))
    path = tmp_path / "answers.parquet"
    records.write_records(path, rows, records.ANSWERS, {})
    return str(path)


def test_acceptance_examples_are_train_answers_labelled_by_the_game_verdict(trained, tmp_path, scripted_policy):
    path = played_answers(tmp_path, scripted_policy)
    rows = records.read_records(path, records.ANSWERS)
    assert {row["parse_ok"] for row in rows} == {True, False}
    tokenizer = trained["scorer"].tokenizer
    examples = prm_data.acceptance_examples(path, tokenizer, None, 1024, limit=8, seed=0)
    assert len(examples) == 8 and sum(e.label for e in examples) == 4   # as many of each verdict as there are
    verdicts_of = collections.defaultdict(set)   # an answer's verdicts (the same answer in other states)
    for row in rows:
        verdicts_of[row["response"]].add(row["parse_ok"])
    for example in examples:   # each is an answer played, labelled as the game judged it
        text = tokenizer.decode(example.input_ids)
        response = max((r for r in verdicts_of if text.endswith(f"{r}<|im_end|>\n")), key=len)
        assert bool(example.label) in verdicts_of[response]
    assert [e.input_ids for e in prm_data.acceptance_examples(path, tokenizer, None, 1024, 8, 0)] == [
        e.input_ids for e in examples]                                # drawn by the seed alone
    everything = prm_data.acceptance_examples(path, tokenizer, None, 1024, limit=10_000, seed=0)
    assert len(everything) == len(rows)
    held_out = tmp_path / "held_out.parquet"   # answers records of another split are refused, naming the file
    records.write_records(held_out, [{**row, "split": "validation"} for row in rows], records.ANSWERS, {})
    with pytest.raises(records.RecordFileError, match="held_out.parquet holds .* validation rows"):
        prm_data.acceptance_examples(str(held_out), tokenizer, None, 1024, 8, 0)


def test_the_game_verdicts_train_beside_the_soft_labels_in_one_schedule(tmp_path, test_cache_dir, scripted_policy):
    path = played_answers(tmp_path, scripted_policy)
    settings = prm_settings(epochs=1, batch_size=8, grad_accum=1, acceptance_examples=16)
    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows()[:16])
    metrics = train_and_measure(settings, labels, str(tmp_path / "adapter"), str(tmp_path / "m.json"), test_cache_dir,
                                on_failure="continue", answers_path=path)
    verdicts = metrics["acceptance"]
    heldout = verdicts["heldout"]   # the answers of a quarter of the instances, measured, not trained on
    assert verdicts["examples"] + heldout["n"] == 16 and heldout["n"] > 0
    assert 0 < verdicts["accepted"] < verdicts["examples"] and 0.0 <= heldout["auroc"] <= 1.0
    train_pairs = metrics["examples"]["train"]   # one epoch over both: their batches are its steps
    assert metrics["status"] == "trained" and metrics["steps"] == math.ceil((train_pairs + verdicts["examples"]) / 8)
    with pytest.raises(ValueError, match=r"prm.acceptance_examples needs the answers records \(results/labels/"
                                         r"answers.parquet, rule gather_answers"):
        train_and_measure(settings, labels, str(tmp_path / "a2"), str(tmp_path / "m2.json"), test_cache_dir)


def test_corrupt_or_invalid_labels_file_is_an_error_naming_it(tmp_path, test_cache_dir):
    corrupt = tmp_path / "soft_labels.parquet"
    corrupt.write_bytes(b"not a parquet file")
    with pytest.raises(records.RecordFileError, match="soft_labels.parquet"):
        train_and_measure(prm_settings(), str(corrupt), str(tmp_path / "a"), str(tmp_path / "m.json"), test_cache_dir)
    rows = synthetic_rows()[:2]
    rows[1]["label"] = 1.5
    bad = write_labels(tmp_path / "bad_labels.parquet", rows)
    with pytest.raises(records.RecordFileError, match=r"bad_labels.parquet, row 1 .*1.5"):
        prm_data.read_labels(bad)


# ------------------------------------------------------------------------------------- tiny model


def test_pair_text_merges_roles_and_appends_the_candidate_and_the_game_reply(trained):
    tokenizer = trained["scorer"].tokenizer
    prefix = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    text = render_answered(tokenizer, prefix, "GUESS: 5", {"enable_thinking": False})
    assert text.startswith("<|im_start|>user\na\n\nb<|im_end|>\n<|im_start|>assistant\n")
    assert text.endswith("GUESS: 5<|im_end|>\n") and text.count("<|im_start|>") == 2
    replied = render_answered(tokenizer, prefix, "GUESS: 5", {"enable_thinking": False}, reply="Higher.")
    # the reply follows as the user's next message (the template drops the empty think block of a non-final answer)
    assert replied == ("<|im_start|>user\na\n\nb<|im_end|>\n<|im_start|>assistant\nGUESS: 5<|im_end|>\n"
                       "<|im_start|>user\nHigher.<|im_end|>\n")
    # sequence classification pools the last non-pad token: pad must differ from the end-of-turn token
    model = trained["scorer"].model
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.pad_token_id == model.config.text_config.pad_token_id == tokenizer.pad_token_id


def test_training_separates_the_labels_and_beats_the_baselines(trained):
    metrics = trained["metrics"]
    assert metrics == json.loads((trained["dir"] / "metrics.json").read_text())
    assert metrics["status"] == "trained" and metrics["loss"] == "bce" and metrics["steps"] > 0
    history = metrics["history"]
    assert history[0]["epoch"] == 0 and history[0]["eval_loss"] > 0.5
    assert history[-1]["train_loss"] < 0.8 * history[1]["train_loss"]
    assert metrics["eval_loss"] < 0.7 * metrics["initial_eval_loss"]
    validation = metrics["evaluation"]["validation"]
    assert validation["auroc"] > 0.95 and validation["pearson"] > 0.8 and validation["spearman"] > 0.8
    baselines = metrics["baselines"]
    validation_keys = set(metrics["examples"]["validation_instance_keys"])
    train_labels = [row["label"] for row in trained["rows"] if "/".join(instance_key_of(row)) not in validation_keys]
    assert baselines["constant_mean"]["value"] == pytest.approx(sum(train_labels) / len(train_labels))
    assert baselines["constant_mean"]["validation"]["auroc"] == 0.5
    assert baselines["constant_mean"]["validation"]["pearson"] is None      # constant predictions
    assert set(baselines["game_mean"]["values"]) == {"g1", "g2"}
    assert validation["bce"] < baselines["game_mean"]["validation"]["bce"] < 0.75
    assert validation["auroc"] > baselines["game_mean"]["validation"]["auroc"]


def test_siblings_are_ranked_by_the_prm_and_the_baselines_on_held_out_prefixes(trained):
    metrics = trained["metrics"]
    ranking = metrics["ranking"]
    assert ranking["side"] == "validation" and ranking["prefixes"] == ranking["instances"] > 0
    assert ranking["siblings"] == 2 * ranking["prefixes"] and ranking["pairs_with_different_labels"] > 0
    assert set(ranking["scorers"]) == {"prm", "constant_mean", "game_mean", "candidate_length", "policy_logprob",
                                       "acceptance", "rule"}
    assert set(ranking["differences"]) == set(ranking["scorers"]) - {"prm"}
    overall = {name: entry["overall"] for name, entry in ranking["scorers"].items()}
    assert overall["prm"]["pairwise_accuracy"]["value"] == 1.0 and overall["prm"]["top1_regret"]["value"] == 0.0
    # the game accepted every synthetic candidate and none ended a game: what a fork shows ties them too
    for blind in ("constant_mean", "game_mean", "acceptance", "rule"):  # the random pick's expectation
        assert overall[blind]["pairwise_accuracy"] == {"value": 0.5, "ci_low": 0.5, "ci_high": 0.5}
        assert overall[blind]["top1_regret"]["value"] == pytest.approx(
            (POSITIVE - NEGATIVE) / 2 * overall[blind]["pairs"] / overall[blind]["prefixes"])
    for name, entry in overall.items():
        low, value, high = (entry["top1_regret"][k] for k in ("ci_low", "value", "ci_high"))
        assert low <= value <= high, name
    assert set(ranking["scorers"]["prm"]) == {"g1", "g2", "overall"} == set(ranking["best_label"])
    best = ranking["best_label"]["overall"]["value"]
    assert overall["prm"]["pick_label"]["value"] == pytest.approx(best)   # the PRM picks the best sibling
    for name, entry in overall.items():  # the pick's label is the best label minus the regret
        assert entry["pick_label"]["value"] == pytest.approx(best - entry["top1_regret"]["value"]), name
    for name in ("candidate_length", "policy_logprob"):
        assert set(metrics["baselines"][name]["validation"]) == {"n", "pearson", "spearman", "auroc"}


def test_eval_summary_repeats_the_held_out_ranking_and_the_report_draws_the_picks(trained, tmp_path):
    import jsonschema

    from clemprm.evaluation import evaluate, report

    metrics = trained["metrics"]
    summary = evaluate.prm_summary(json.loads((trained["dir"] / "metrics.json").read_text()))
    schema = evaluate.summary_schema()
    jsonschema.validate(summary, {"$defs": schema["$defs"], "$ref": "#/$defs/prm_summary"})
    assert summary["ranking"]["scorers"] == metrics["ranking"]["scorers"]
    assert summary["instances"] == metrics["examples"]["validation_instances"] == 6
    assert set(summary["global"]) == {"prm", "constant_mean", "game_mean", "candidate_length", "policy_logprob",
                                      "acceptance", "rule"}
    assert summary["global"]["prm"]["auroc"] == metrics["evaluation"]["validation"]["auroc"]
    assert "bce" not in summary["global"]["policy_logprob"]
    assert evaluate.prm_summary({"ranking": None}) is None
    assert "prm: pairwise accuracy 1.000" in evaluate.ranking_lines(summary)

    report.plot_sibling_picks({"prm": summary}, tmp_path / "picks.png")
    drawn = report.figure_data(tmp_path / "picks.png")
    ranking = summary["ranking"]
    assert drawn["groups"] == ["g1", "g2", "overall"]
    expected = {"best sibling": [ranking["best_label"][group]["value"] for group in drawn["groups"]]}
    for label, scorer in (("PRM pick", "prm"), ("random pick", "constant_mean"),
                          ("candidate-length pick", "candidate_length")):
        expected[label] = [ranking["scorers"][scorer][group]["pick_label"]["value"] for group in drawn["groups"]]
    for label, values in expected.items():
        assert drawn["bars"][label]["values"] == pytest.approx(values), label
    assert drawn["bars"]["PRM pick"]["values"] == pytest.approx(expected["best sibling"])
    report.plot_sibling_picks({}, tmp_path / "none.png")
    assert report.figure_data(tmp_path / "none.png") == {"groups": [], "bars": {}}


def test_verdict_metrics_rank_the_accepted_candidates():
    assert prm_metrics.verdict_metrics([0.9, 0.2, 0.7, 0.4], [1.0, 0.0, 1.0, 0.0]) == {"n": 4, "accepted": 2,
                                                                                     "auroc": 1.0}
    assert prm_metrics.verdict_metrics([0.1, 0.9, 0.5], [1.0, 0.0, 0.0])["auroc"] == 0.0
    assert prm_metrics.verdict_metrics([0.3, 0.6], [1.0, 1.0])["auroc"] is None


def test_sibling_statistics_count_ties_half_and_regret_the_mean_of_tied_picks():
    assert prm_metrics.sibling_statistics([0.9, 0.1, 0.5], [1.0, 0.0, 0.0]) == (2.0, 2, 0.0)
    assert prm_metrics.sibling_statistics([0.1, 0.9], [1.0, 0.0]) == (0.0, 1, 1.0)
    assert prm_metrics.sibling_statistics([0.5, 0.5, 0.5], [1.0, 0.5, 0.0]) == (1.5, 3, 0.5)


def test_sibling_statistics_weigh_each_answer_by_its_multiplicity():
    """A state whose 4 samples are A, A, A (label 0) and B (label 1): as siblings A (multiplicity 3) and B. A pair
    weighs m_a * m_b (3 pairs of samples), a random pick (a tie) has the multiplicity-weighted mean label 1/4, so
    its regret is 3/4 (1/2 when the repeats were lost), and a tie at the top is broken by a random sample."""
    assert prm_metrics.sibling_statistics([0.9, 0.1], [0.0, 1.0], [3, 1]) == (0.0, 3, 1.0)
    assert prm_metrics.sibling_statistics([0.1, 0.9], [0.0, 1.0], [3, 1]) == (3.0, 3, 0.0)
    assert prm_metrics.sibling_statistics([0.5, 0.5], [0.0, 1.0], [3, 1]) == (1.5, 3, 0.75)
    assert prm_metrics.sibling_statistics([0.5, 0.5], [0.0, 1.0]) == (0.5, 1, 0.5)    # each answer once
    # B and C (label 1 and 1/2, once each) against A (0, three times): the PRM orders A last and B below C
    concordant, pairs, regret = prm_metrics.sibling_statistics([0.0, 0.2, 0.9], [0.0, 1.0, 0.5], [3, 1, 1])
    assert (concordant, pairs, regret) == (6.0, 7, 0.5)   # A-B 3, A-C 3 right, B-C 1 wrong


def test_ranking_metrics_random_pick_and_accuracy_weigh_by_multiplicity():
    """Held-out states of A, A, A (label 0) and B (label 1): the random pick (constant_mean ties every sibling) picks
    B in 1 of 4 samples, so its regret is 0.75, and a PRM that prefers A ranks 3 pairs of samples wrong per state."""
    examples = []
    for state in range(4):
        key = ("g", "e", str(state))
        examples += [prm_data.Example([1], False, 0.0, key, state_id=f"p{state}", row=2 * state, multiplicity=3),
                     prm_data.Example([1], False, 1.0, key, state_id=f"p{state}", row=2 * state + 1, multiplicity=1)]
    scorers = {"prm": [0.9, 0.1] * 4, "constant_mean": [0.5] * 8}
    ranking = prm_metrics.ranking_metrics(examples, scorers, 50, 0, 0.95)
    assert ranking["pairs_with_different_labels"] == 4                          # distinct answer pairs: the evidence
    prm_block, random_block = (ranking["scorers"][name]["overall"] for name in ("prm", "constant_mean"))
    assert prm_block["pairs"] == 12 and prm_block["pairwise_accuracy"]["value"] == 0.0
    assert random_block["top1_regret"]["value"] == 0.75 and random_block["pick_label"]["value"] == 0.25
    assert prm_block["top1_regret"]["value"] == 1.0
    assert ranking["differences"]["constant_mean"]["overall"]["top1_regret"]["value"] == 0.25


def test_a_baseline_is_oriented_the_way_its_train_siblings_rank():
    examples = [prm_data.Example([1], False, label, ("g", "e", "0"), state_id=f"p{i // 2}", row=i)
                for i, label in enumerate([1.0, 0.0, 0.5, 0.0, 0.2, 0.2])]     # the last state's labels tie
    shorter_is_better = [1.0, 5.0, 2.0, 9.0, 3.0, 1.0]
    assert prm_metrics.orientation(examples, shorter_is_better) == -1
    assert prm_metrics.orientation(examples, [-x for x in shorter_is_better]) == 1
    assert prm_metrics.orientation(examples, [1.0] * 6) == 1      # ties: not worse than chance
    assert prm_metrics.orientation([], []) == 1 and prm_metrics.orientation(examples[:1], [1.0]) == 1   # no siblings


def test_a_baseline_is_oriented_on_the_samples_its_train_siblings_are():
    """Longer answers win 1 state of 3, but that state's losing answer is 3 samples: 3 pairs of samples of 5 say
    longer is better."""
    labels, lengths, counts = [0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 5.0, 1.0, 5.0, 1.0, 5.0], [3, 1, 1, 1, 1, 1]
    examples = [prm_data.Example([1], False, label, ("g", "e", "0"), state_id=f"p{i // 2}", row=i, multiplicity=count)
                for i, (label, count) in enumerate(zip(labels, counts))]
    assert prm_metrics.orientation(examples, lengths) == 1
    once = [prm_data.Example([1], False, e.label, e.key, state_id=e.state_id, row=e.row) for e in examples]
    assert prm_metrics.orientation(once, lengths) == -1


def test_pairwise_loss_orders_siblings_of_one_state_only():
    logits = torch.tensor([2.0, 0.0, -1.0, 3.0], requires_grad=True)
    labels = torch.tensor([1.0, 0.5, 0.5, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    # pairs with different labels inside a state: (0, 1) gap 0.5 and (2, 3) gap 0.5; (1, 2) are of two states
    expected = (0.5 * torch.nn.functional.softplus(torch.tensor(-2.0))
                + 0.5 * torch.nn.functional.softplus(torch.tensor(4.0))) / 2   # the second misordered
    loss = prm.pairwise_loss(logits, labels, groups)
    assert loss.item() == pytest.approx(expected.item())
    loss.backward()
    assert logits.grad[0] < 0 < logits.grad[1] and logits.grad[2] < 0 < logits.grad[3]   # raise the higher label
    assert prm.pairwise_loss(logits, labels, torch.arange(4)).item() == 0.0               # no siblings, no term
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    assert prm.prm_loss(logits, labels, groups, "bce", 0.0).item() == pytest.approx(bce.item())
    assert prm.prm_loss(logits, labels, groups, "bce", 2.0).item() == pytest.approx(bce.item() + 2 * expected.item())


def test_sampling_keeps_sibling_groups_whole():
    examples = [prm_data.Example([1], False, 0.0, ("g", "e", str(i // 3)), state_id=f"p{i // 3}", row=i) for i in range(12)]
    sampled = prm_data.sample_whole_groups(examples, 7, seed=3)
    assert len(sampled) == 6 and all(len(group) == 3 for group in prm_data.sibling_groups(sampled))
    assert prm_data.sample_whole_groups(examples, 7, seed=3) == sampled
    assert prm_data.sample_whole_groups(examples, None, 3) == examples


def test_pairwise_training_batches_whole_states_and_ranks_held_out_siblings(tmp_path, test_cache_dir):
    """With prm.pairwise_weight > 0 a micro-batch holds whole states: 18 train states of 2 siblings in batches of
    4 states make 5 steps an epoch (pairs: 9); the PRM still ranks the held-out siblings right."""
    settings = prm_settings(lr=3e-3, epochs=6, batch_size=4, grad_accum=1, validation_fraction=0.25,
                            pairwise_weight=1.0, early_stopping_patience=6)
    metrics = train_and_measure(settings, write_labels(tmp_path / "labels.parquet", synthetic_rows()),
                                str(tmp_path / "adapter"), str(tmp_path / "metrics.json"), test_cache_dir)
    assert metrics["pairwise_weight"] == 1.0 and metrics["examples"]["train"] == 36
    assert metrics["shared_prefixes"]   # a state's siblings trained on their shared prefix
    assert metrics["steps"] == 5 * metrics["epochs_run"]
    assert metrics["ranking"]["scorers"]["prm"]["overall"]["pairwise_accuracy"]["value"] == 1.0


def test_metrics_json_has_every_key(trained):
    metrics = trained["metrics"]
    for key in ("status", "model", "loss", "examples", "tokens", "steps", "epochs_run", "max_epochs", "stopped_early",
                "best_epoch", "batch_size", "grad_accum", "effective_batch", "train_loss", "eval_loss",
                "initial_eval_loss", "history", "evaluation", "baselines", "ranking", "train_seconds", "seconds",
                "peak_memory_mb", "config", "versions", "gate", "label_weighting", "verdicts", "head"):
        assert key in metrics, key
    # the game accepted every synthetic held-out candidate: one verdict, no AUROC
    assert metrics["verdicts"] == {"side": "validation", "n": metrics["examples"]["validation"],
                                   "accepted": metrics["examples"]["validation"], "auroc": None}
    block_keys = {"n", "mean_label", "mean_prediction", "std_label", "std_prediction", "bce", "mse", "pearson",
                  "spearman", "auroc", "calibration"}
    for side in ("train", "validation"):
        assert set(metrics["evaluation"][side]) == block_keys
        for baseline in ("constant_mean", "game_mean"):
            assert set(metrics["baselines"][baseline][side]) == block_keys
    calibration = metrics["evaluation"]["validation"]["calibration"]
    assert len(calibration) == 10 and sum(row["count"] for row in calibration) == metrics["examples"]["validation"]
    assert set(calibration[0]) == {"bin", "count", "mean_prediction", "mean_label"}
    assert all({"epoch", "train_loss", "eval_loss"} <= set(row) for row in metrics["history"][1:])
    assert metrics["model"]["device"] == "cpu" and metrics["model"]["spec"] == "tiny:0"
    assert metrics["peak_memory_mb"]["rss"] > 0 and metrics["config"]["prm"]["lr"] == 3e-3
    assert {"peft", "transformers", "torch"} <= set(metrics["versions"])
    adapter_config = json.loads((trained["dir"] / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["task_type"] == "SEQ_CLS" and adapter_config["base_model_name_or_path"] == "tiny:0"
    assert set(adapter_config["target_modules"]) == {"q_proj", "v_proj"}
    assert "score" in adapter_config["modules_to_save"]


def test_held_out_split_is_by_instance(trained):
    metrics = trained["metrics"]
    validation = set(metrics["examples"]["validation_instance_keys"])
    keys = {"/".join(instance_key_of(row)) for row in trained["rows"]}
    assert len(keys) == 24 and len(validation) == 6 and validation < keys    # g1/e0/3 and g1/e1/3 are two instances
    assert metrics["examples"]["validation"] == 2 * len(validation) and metrics["examples"]["train"] == 2 * 18
    assert metrics["examples"]["validation_instances"] == 6 and metrics["examples"]["train_instances"] == 18
    assert validation == {"/".join(key) for key in split_instances(
        [instance_key_of(row) for row in trained["rows"]], 0.25, trained["settings"]["seed"])}


def test_reloaded_adapter_reproduces_the_scores(trained):
    metrics, scorer = trained["metrics"], trained["scorer"]
    validation = set(metrics["examples"]["validation_instance_keys"])
    rows = [row for row in trained["rows"] if "/".join(instance_key_of(row)) in validation]
    scores = scorer.score(pairs_of(rows))
    recomputed = prm_metrics.prediction_metrics(scores, [row["label"] for row in rows])
    for key in ("bce", "mse", "mean_prediction", "auroc"):
        assert recomputed[key] == pytest.approx(metrics["evaluation"]["validation"][key], abs=1e-6)
    assert all(0.0 < s < 1.0 for s in scores)
    assert scorer.stats.pairs == len(rows) and scorer.stats.calls == 1 and scorer.stats.seconds > 0


def test_scores_do_not_depend_on_batching(trained, test_cache_dir):
    scorer = trained["scorer"]
    pairs = pairs_of(trained["rows"][::3])
    pairs[0] = pairs[0]._replace(perspective=pairs[0].perspective + [{"role": "user", "content": "Think hard. " * 20}],
                                 candidate=pairs[0].candidate + " and more")
    batched = scorer.score(pairs)
    single = prm_model.PRMScorer(scorer.cfg, token_budget=1, tokenizer=scorer.tokenizer, model=scorer.model)
    alone = single.score(pairs)
    assert single.stats.pairs == len(pairs)
    assert torch.allclose(torch.tensor(batched), torch.tensor(alone), atol=1e-5, rtol=0)
    assert single.score(pairs[:1] + pairs[:1])[0] == pytest.approx(alone[0], abs=1e-5)


def best_of_n_pairs() -> list[Pair]:
    """Prefixes of different lengths with four candidates of different lengths each, a pair alone and a pair twice."""
    pairs = []
    for n, row in enumerate(synthetic_rows()[::7]):
        prefix = row["prefix"] + [{"role": "assistant", "content": "I say river"},
                                  {"role": "user", "content": "Wrong. " * (3 * n) + "Again."}]
        pairs += [Pair(prefix, f"I say {WORDS[k]}" + f" {MARKER}" * k, f"Reply {k}.", True) for k in range(4)]
    return pairs + [Pair(pairs[0][0] + [{"role": "user", "content": "Alone."}], "I say tree", "", True)] + pairs[:1]


def test_shared_prefixes_give_the_full_sequence_scores(trained):
    """Scores with shared prefixes equal full-sequence scores: across micro-batches (a small budget), with pairs
    alone, duplicates (a one-token suffix) and left truncation (a 40-token limit shifts the starts)."""
    scorer = trained["scorer"]
    pairs = best_of_n_pairs()
    for max_length, token_budget in ((1024, 4096), (1024, 300), (40, 4096)):
        shared = prm_model.PRMScorer(scorer.cfg, max_length=max_length, token_budget=token_budget,
                               tokenizer=scorer.tokenizer, model=scorer.model)
        full = prm_model.PRMScorer(scorer.cfg, max_length=max_length, token_budget=token_budget,
                             tokenizer=scorer.tokenizer, model=scorer.model, share_prefixes=False)
        assert shared.share_prefixes and not full.share_prefixes
        with_sharing, without = shared.score(pairs), full.score(pairs)
        assert torch.allclose(torch.tensor(with_sharing), torch.tensor(without), atol=1e-5, rtol=0), max_length
        assert full.stats.shared_tokens == 0
        if max_length > 40:                                      # most tokens are prefix tokens, computed once
            assert shared.stats.shared_tokens > shared.stats.tokens // 2
    assert shared.stats.truncated == full.stats.truncated > 0


def test_training_on_shared_prefixes_gives_the_full_forward_loss_and_gradients(trained):
    """The training forward with a state's siblings on their shared prefix (rows grouped as the collator groups
    them, a pair alone among them): the loss with the pairwise term and every LoRA and score-head gradient equal
    those of the full padded forward."""
    scorer = trained["scorer"]
    model, tokenizer = scorer.model, scorer.tokenizer
    pairs = best_of_n_pairs()[:9]   # two states of four siblings and a pair alone
    sequences = [prm_model.encode_pair(tokenizer, pair.perspective, pair.candidate, pair.reply, None, 1024)[0]
                 for pair in pairs]
    input_ids, attention_mask = scoring.pad_right(sequences, tokenizer.pad_token_id)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2])
    labels = torch.tensor([0.0, 1.0, 0.5, 0.0, 0.25, 0.0, 1.0, 0.0, 1.0])
    shared_groups, alone = scoring.shared_prefix_groups(sequences, groups.tolist())
    assert [group.rows for group in shared_groups] == [[0, 1, 2, 3], [4, 5, 6, 7]] and alone == [8]
    # the loaded scorer is frozen: its LoRA and score head train here as in the PRM stage
    trainable = [p for name, p in model.named_parameters() if "lora_" in name or "score" in name]
    for parameter in trainable:
        parameter.requires_grad_(True)
    model.eval()   # LoRA dropout off: the two forwards draw no masks
    results = []
    try:
        for shared in (True, False):
            model.zero_grad()
            if shared:
                logits = scoring.logits_sharing_prefixes(model, input_ids, attention_mask, groups.tolist(),
                                                         tokenizer.pad_token_id)
            else:
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            loss = prm.prm_loss(logits.squeeze(-1).float(), labels, groups, "bce", 1.0)
            loss.backward()
            results.append((loss.item(), [None if p.grad is None else p.grad.clone() for p in trainable]))
    finally:
        model.zero_grad()
        for parameter in trainable:
            parameter.requires_grad_(False)
    (shared_loss, shared_grads), (full_loss, full_grads) = results
    assert shared_loss == pytest.approx(full_loss, abs=1e-5)
    # (the score head's frozen original, kept by PEFT beside its trained copy, gets none)
    assert [g is None for g in shared_grads] == [g is None for g in full_grads]
    used = [(shared, full) for shared, full in zip(shared_grads, full_grads) if full is not None]
    assert len(used) > 2 and all(full.abs().max() > 0 for _, full in used)
    for shared_grad, full_grad in used:
        assert torch.allclose(shared_grad, full_grad, atol=1e-5, rtol=1e-3)


def test_a_model_without_a_shareable_cache_scores_in_full(trained, monkeypatch, caplog):
    scorer = trained["scorer"]
    monkeypatch.setattr(prm_model, "prefix_sharing_problem", lambda model: "cache layers SomeLayer")
    with caplog.at_level("INFO", logger="clemprm.models.prm"):
        fallback = prm_model.PRMScorer(scorer.cfg, tokenizer=scorer.tokenizer, model=scorer.model)
        pairs = best_of_n_pairs()
        scores = fallback.score(pairs) + fallback.score(pairs)
    assert not fallback.share_prefixes and fallback.stats.shared_tokens == 0
    assert [r.getMessage() for r in caplog.records if "without shared prefixes" in r.getMessage()] == [
        f"prm {scorer.cfg.short_name}: every pair scored in full, without shared prefixes: cache layers SomeLayer"]
    assert scores == pytest.approx(scorer.score(pairs) * 2, abs=1e-5)


def test_truncation_keeps_the_end(trained):
    scorer = trained["scorer"]
    tokenizer, kwargs = scorer.tokenizer, scorer.cfg.chat_template_kwargs
    prefix = [{"role": "user", "content": f"Old turn number {i} of a long game."} for i in range(40)]
    candidate = f"I say river {MARKER}"
    full, cut = prm_model.encode_pair(tokenizer, prefix, candidate, "Reply.", kwargs, 10_000)
    ids, truncated = prm_model.encode_pair(tokenizer, prefix, candidate, "Reply.", kwargs, 64)
    assert not cut and truncated and len(full) > 64 and ids == full[-64:]
    text = tokenizer.decode(ids)
    assert text.endswith(f"{candidate}<|im_end|>\n<|im_start|>user\nReply.<|im_end|>\n")
    assert "number 39" in text and "number 0 " not in text
    short = prm_model.PRMScorer(scorer.cfg, input="candidate_with_reply", max_length=64, tokenizer=tokenizer,
                                model=scorer.model)
    assert short.score([Pair(prefix, candidate, "Reply.", True)]) == pytest.approx(scorer.score_ids([full[-64:]]),
                                                                                   abs=1e-6)
    assert short.stats.truncated == 1


def test_a_prm_reads_the_input_it_was_trained_for(trained):
    """prm.input: candidate (blind) reads the prefix and the candidate, whatever the pair carries; a PRM trained on
    the game's reply refuses a blind pair, which has none."""
    scorer = trained["scorer"]
    rows = synthetic_rows()[:4]
    for row, reply in zip(rows, ["Wrong, try again.", "Game over: won.", "Higher.", ""]):
        row["reply"] = reply
    blind = prm_data.build_examples(rows, scorer.tokenizer, None, 1024, "candidate")
    assert all(scorer.tokenizer.decode(e.input_ids).endswith(f"{row['candidate']}<|im_end|>\n")
               for e, row in zip(blind, rows))
    reading = prm_data.build_examples(rows, scorer.tokenizer, None, 1024, "candidate_with_reply")
    assert scorer.tokenizer.decode(reading[1].input_ids).endswith("Game over: won.<|im_end|>\n")
    assert scorer.score(pairs_of(rows)) == pytest.approx(scorer.score([Pair(p.perspective, p.candidate)
                                                                       for p in pairs_of(rows)]), abs=1e-6)
    with_reply = prm_model.PRMScorer(scorer.cfg, input="candidate_with_reply", tokenizer=scorer.tokenizer,
                                     model=scorer.model)
    with pytest.raises(ValueError, match="lookahead pairs only"):
        with_reply.score([Pair(rows[0]["prefix"], rows[0]["candidate"])])


def test_a_4bit_nf4_base_trains_and_scores_like_full_precision(trained, tmp_path, test_cache_dir):
    """The QLoRA path on CPU (bitsandbytes NF4, fp32 compute): the same data and settings as the full-precision
    PRM give the same quality and nearly the same scores; the full-precision adapter on the NF4 base scores close."""
    full = trained["settings"]
    settings = {**full, "model": {**full["model"], "quantization": "nf4"}}
    metrics = train_and_measure(settings, str(trained["dir"] / "labels.parquet"), str(tmp_path / "adapter"),
                                str(tmp_path / "metrics.json"), test_cache_dir)
    assert metrics["status"] == "trained" and metrics["model"]["quantization"] == "nf4"
    scorer = prm_model.load_prm(settings["model"], settings["prm"], str(tmp_path / "adapter"), test_cache_dir)
    on_full_adapter = prm_model.load_prm(settings["model"], full["prm"], str(trained["dir"] / "adapter"),
                                         test_cache_dir)
    for model in (scorer.model, on_full_adapter.model):
        quantized = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
        assert quantized and any(hasattr(m, "lora_A") and type(m.base_layer).__name__ == "Linear4bit"
                                 for m in model.modules() if hasattr(m, "base_layer"))
    nf4, reference = metrics["evaluation"]["validation"], trained["metrics"]["evaluation"]["validation"]
    assert nf4["auroc"] > 0.95 and nf4["bce"] == pytest.approx(reference["bce"], abs=0.03)
    pairs = pairs_of(trained["rows"])
    full_scores = trained["scorer"].score(pairs)
    nf4_scores = scorer.score(pairs)
    assert stats.pearson(full_scores, nf4_scores) > 0.99
    assert max(abs(a - b) for a, b in zip(full_scores, nf4_scores)) < 0.1
    assert max(abs(a - b) for a, b in zip(full_scores, on_full_adapter.score(pairs))) < 0.05


def test_mse_loss_small_data_caps_grad_accum_and_is_deterministic(tmp_path, test_cache_dir, caplog):
    """20 pairs, batches of 4 and grad_accum 64: capped at 5 (one optimizer step per epoch), a warning in the log
    and a mark the summary lists (it was an INFO line only); two runs with one seed give the same adapter."""
    from safetensors.torch import load_file

    from clemprm.config import sections
    from clemprm.evaluation import evaluate, report

    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows()[:20])
    settings = prm_settings(loss="mse", lr=1e-2, epochs=2, batch_size=4, grad_accum=64, validation_fraction=0.0)
    runs = []
    for name in ("a", "b"):
        metrics = train_and_measure(settings, labels, str(tmp_path / name), str(tmp_path / f"{name}.json"),
                                    test_cache_dir)
        runs.append((metrics, load_file(str(tmp_path / name / "adapter_model.safetensors"))))
    (metrics, weights), (other_metrics, other_weights) = runs
    assert metrics["loss"] == "mse" and metrics["grad_accum"] == 5 and metrics["effective_batch"] == 20
    capped = [mark for mark in metrics["failure_marks"] if mark["condition"] == "grad_accum_capped"]
    assert len(capped) == 1 and "capped at 5 (of prm.grad_accum 64)" in capped[0]["message"], metrics["failure_marks"]
    assert any(record.levelname == "WARNING" and "prm.grad_accum 64" in record.getMessage()
               for record in caplog.records)
    summary = evaluate.summarize_eval(sections(tiny_config(), "seed", "model", "games", "eval"), [],
                                      str(tmp_path / "prm_eval.json"), prm_metrics_path=str(tmp_path / "a.json"))
    assert capped[0] in summary["upstream_warnings"] and capped[0]["message"] in summary["warnings"]
    report.write_warnings_page(summary, tmp_path / "warnings.html")   # the report's front page: a warning, no failure
    page = (tmp_path / "warnings.html").read_text()
    assert "WARNING: 1 warning(s) on what the run measured; the results" in page and "failed stage" not in page
    assert metrics["steps"] == 2 and metrics["examples"]["validation"] == 0
    assert metrics["evaluation"]["validation"] is None and metrics["eval_loss"] is None
    assert metrics["train_loss"] < 0.25 and metrics["history"] == other_metrics["history"]
    assert any(name.endswith("score.weight") for name in weights)            # the head is saved with the LoRA
    assert weights.keys() == other_weights.keys()
    assert all(torch.equal(weights[name], other_weights[name]) for name in weights)


def test_validation_split_branch_points_are_the_held_out_set_never_trained_or_selected_on(tmp_path, test_cache_dir):
    """Rows of validation-split instances (``branch_points.validation_instances``) are ranked and scored as
    ``heldout``: the trainer neither trains on them nor chooses its epoch on them, and the summary repeats them."""
    import jsonschema

    from clemprm.evaluation import evaluate

    rows = synthetic_rows()
    for row in rows:
        if row["game_id"] >= 4:    # 2 of 6 instances per experiment and game
            row["split"] = "validation"
    settings = prm_settings(lr=3e-3, epochs=2, batch_size=8, grad_accum=1, validation_fraction=0.0)
    # two short epochs: what is checked is which rows are held out, not how well it learned (its gate may fail)
    metrics = train_and_measure(settings, write_labels(tmp_path / "labels.parquet", rows), str(tmp_path / "adapter"),
                                str(tmp_path / "m.json"), test_cache_dir, on_failure="continue")
    heldout = [row for row in rows if row["split"] == "validation"]
    assert metrics["examples"]["train"] == len(rows) - len(heldout) and metrics["examples"]["validation"] == 0
    assert metrics["examples"]["heldout"] == len(heldout) and metrics["examples"]["heldout_instances"] == 8
    assert metrics["eval_loss"] is None and metrics["evaluation"]["validation"] is None   # no epoch chosen on them
    assert metrics["evaluation"]["heldout"]["n"] == len(heldout)
    ranking = metrics["ranking"]
    assert ranking["side"] == "heldout" and ranking["instances"] == 8 and ranking["prefixes"] == 8
    assert metrics["baselines"]["policy_logprob"]["heldout"]["n"] == len(heldout)
    assert set(ranking["orientation"]) == {"candidate_length", "policy_logprob"}
    assert metrics["baselines"]["policy_logprob"]["orientation"] == ranking["orientation"]["policy_logprob"]
    summary = evaluate.prm_summary(json.loads((tmp_path / "m.json").read_text()))
    schema = evaluate.summary_schema()
    jsonschema.validate(summary, {"$defs": schema["$defs"], "$ref": "#/$defs/prm_summary"})
    assert summary["side"] == "heldout" and summary["instances"] == 8
    assert summary["global"]["prm"]["auroc"] == metrics["evaluation"]["heldout"]["auroc"]


def test_empty_labels_file_writes_an_untrained_adapter(tmp_path, test_cache_dir):
    settings = prm_settings()
    labels = write_labels(tmp_path / "labels.parquet", [])
    metrics = train_and_measure(settings, labels, str(tmp_path / "adapter"), str(tmp_path / "m.json"), test_cache_dir)
    assert metrics["status"].startswith("untrained") and metrics["examples"]["train"] == 0
    assert json.loads((tmp_path / "m.json").read_text())["status"] == metrics["status"]
    scorer = prm_model.load_prm(settings["model"], settings["prm"], str(tmp_path / "adapter"), test_cache_dir)
    assert isinstance(scorer.cfg, ModelConfig) and scorer.cfg.adapter == str(tmp_path / "adapter")
    scores = scorer.score(pairs_of(synthetic_rows()[:3]))
    assert len(scores) == 3 and all(0.0 < s < 1.0 for s in scores)


# ------------------------------------------------------------------------------------- quality gate, label weights


def gate_settings(**overrides) -> dict:
    return {"min_spread_ratio": 0.25, "max_mean_gap": 0.05, **overrides}


def ranking_of(width: float = 0.01, **accuracy_and_regret) -> dict:
    """A ranking block as ranking_metrics writes it: overall pairwise accuracy and top-1 regret per scorer, and the
    PRM's paired difference to each other scorer, every interval ``width`` either side of its value."""
    def estimate(value):
        return {"value": value, "ci_low": None if value is None else value - width,
                "ci_high": None if value is None else value + width}

    prm_values = accuracy_and_regret["prm"]
    scorers = {name: {"overall": {"pairwise_accuracy": estimate(accuracy), "top1_regret": estimate(regret)}}
               for name, (accuracy, regret) in accuracy_and_regret.items()}
    differences = {name: {"overall": {metric: estimate(None if own is None or value is None else own - value)
                                      for metric, own, value in (("pairwise_accuracy", prm_values[0], accuracy),
                                                                 ("top1_regret", prm_values[1], regret))}}
                   for name, (accuracy, regret) in accuracy_and_regret.items() if name != "prm"}
    return {"scorers": scorers, "differences": differences, "pairs_with_different_labels": 40}


def test_the_quality_gate_fails_a_collapsed_prm_and_one_that_ranks_below_a_baseline():
    held_out = {"mean_label": 0.096, "mean_prediction": 0.022, "std_label": 0.2, "std_prediction": 0.01}
    ranking = ranking_of(prm=(0.42, 0.144), candidate_length=(0.68, 0.087), policy_logprob=(0.55, 0.12),
                         constant_mean=(0.5, 0.137))
    gate = prm_metrics.quality_gate(held_out, ranking, gate_settings())
    assert gate["status"] == "failed" and not any(check["passed"] for check in gate["checks"])
    by_check = {check["check"]: check for check in gate["checks"]}
    assert by_check["spread"]["value"] == pytest.approx(0.05)
    assert by_check["pairwise_accuracy"]["baseline"] == "candidate_length"
    assert "candidate_length 0.680" in by_check["pairwise_accuracy"]["message"]
    assert by_check["top1_regret"]["baseline"] == "candidate_length"
    learned = prm_metrics.quality_gate({**held_out, "mean_prediction": 0.1, "std_prediction": 0.15},
                                       ranking_of(prm=(0.7, 0.05), candidate_length=(0.68, 0.087),
                                                  constant_mean=(0.5, 0.137)), gate_settings())
    assert learned["status"] == "passed" and len(learned["checks"]) == 3 and len(learned["reported"]) == 1
    alike = prm_metrics.quality_gate(None, {**ranking_of(prm=(None, 0.0), constant_mean=(None, 0.0)),
                                           "pairs_with_different_labels": 0}, gate_settings())
    assert alike["status"] == "not_judged"          # siblings all labelled alike: no pick is better
    nothing = prm_metrics.quality_gate(None, None, gate_settings())
    assert nothing == {"status": "not_judged", "checks": [], "reported": [], "not_judged": nothing["not_judged"]}
    assert len(nothing["not_judged"]) == 3
    few = prm_metrics.quality_gate(None, {**ranking_of(prm=(1.0, 0.0), constant_mean=(0.5, 0.1), width=0.0),
                                         "pairs_with_different_labels": prm_metrics.MIN_RANKED_PAIRS - 1},
                                   gate_settings())
    assert few["status"] == "not_judged"
    assert "5 held-out sibling pairs with different labels" in few["not_judged"][1]
    assert "FAIL spread" in prm_metrics.gate_lines(gate)


def test_beating_a_baseline_means_the_paired_interval_clears_zero():
    held_out = {"mean_label": 0.1, "mean_prediction": 0.1, "std_label": 0.2, "std_prediction": 0.15}
    scores = {"prm": (0.70, 0.05), "candidate_length": (0.68, 0.087), "constant_mean": (0.5, 0.137)}
    assert prm_metrics.quality_gate(held_out, ranking_of(0.01, **scores), gate_settings())["status"] == "passed"
    lucky = prm_metrics.quality_gate(held_out, ranking_of(0.05, **scores), gate_settings())   # ahead by 0.02 +- 0.05
    failed = {c["check"]: c for c in lucky["checks"] if not c["passed"]}
    assert set(failed) == {"pairwise_accuracy", "top1_regret"}
    assert {check["baseline"] for check in failed.values()} == {"candidate_length"}
    assert "not clearly better than candidate_length" in failed["pairwise_accuracy"]["message"]


def test_a_prm_that_reads_the_game_reply_must_beat_the_rule_reading_it():
    held_out = {"mean_label": 0.1, "mean_prediction": 0.1, "std_label": 0.2, "std_prediction": 0.15}
    ranking = ranking_of(prm=(0.765, 0.037), candidate_length=(0.676, 0.087), policy_logprob=(0.447, 0.13),
                         constant_mean=(0.5, 0.137), rule=(0.812, 0.036))
    assert prm_metrics.quality_gate(held_out, ranking, gate_settings(), "candidate")["status"] == "passed"
    reading = prm_metrics.quality_gate(held_out, ranking, gate_settings(), "candidate_with_reply")
    assert reading["status"] == "failed"
    assert {c["baseline"] for c in reading["checks"] if not c["passed"]} == {"rule"}


def test_a_diverged_prm_fails_the_gate_by_name():
    gate = prm_metrics.quality_gate(None, None, gate_settings(), nonfinite={"train": 4, "heldout": 2})
    assert gate["status"] == "failed" and [c["check"] for c in gate["checks"]] == ["finite"]
    assert "6 predictions are not finite" in gate["checks"][0]["message"] and "prm.lr" in gate["checks"][0]["message"]


def test_a_prm_whose_predictions_are_nan_fails_its_gate_by_name_not_in_scikit_learn(tmp_path, test_cache_dir,
                                                                                       monkeypatch):
    """A diverged PRM predicts NaN: the stage names it ("not finite") instead of dying in an AUROC."""
    from clemprm.checks.run_time import StageFailure

    monkeypatch.setattr(prm.PRMScorer, "score_ids", lambda self, sequences, keys=None: [math.nan] * len(sequences))
    settings = prm_settings(epochs=1, batch_size=8, grad_accum=1)
    settings["prm"]["gate"] = {**settings["prm"]["gate"], "on_failure": "stop"}
    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows()[:16])
    with pytest.raises(StageFailure, match=r"finite: \d+ predictions are not finite numbers .*lower prm.lr"):
        train_and_measure(settings, labels, str(tmp_path / "adapter"), str(tmp_path / "m.json"), test_cache_dir)


def test_a_gate_whose_ranking_was_not_measured_is_not_judged_not_passed():
    """The issue's case: predictions that spread and sit on the mean label, 3 differently labelled held-out pairs: the
    ranking checks cannot be judged, and a gate with no ranking evidence does not pass. Neither does one whose
    evidence sits in one instance per game (a bootstrap over one instance has no width)."""
    held_out = {"mean_label": 0.3, "mean_prediction": 0.3, "std_label": 0.2, "std_prediction": 0.15}
    ranking = {**ranking_of(prm=(1.0, 0.0), candidate_length=(0.5, 0.2), policy_logprob=(0.5, 0.2),
                            constant_mean=(0.5, 0.2), width=0.0), "pairs_with_different_labels": 3}
    gate = prm_metrics.quality_gate(held_out, ranking, gate_settings())
    assert gate["status"] == "not_judged" and all(check["passed"] for check in gate["checks"])
    assert [check["check"] for check in gate["checks"]] == ["spread"]
    assert "3 held-out sibling pairs with different labels" in gate["not_judged"][0]
    one_each = prm_metrics.quality_gate(held_out, {**ranking, "pairs_with_different_labels": 12,
                                                   "ranked_instances": {"g1": 1, "g2": 4}}, gate_settings())
    assert one_each["status"] == "not_judged" and "g1 1;" in one_each["not_judged"][0]
    assert "NOT JUDGED pairwise_accuracy" in prm_metrics.gate_lines(one_each)
    enough = {**ranking, "pairs_with_different_labels": 12, "ranked_instances": {"g1": 3, "g2": 4}}
    assert prm_metrics.quality_gate(held_out, enough, gate_settings())["status"] == "passed"


def test_a_game_too_thin_for_an_interval_is_left_out_of_the_ranking_checks_not_blocking_them():
    """Held-out pairs in 2 instances of g1 and 4 of g2: the ranking checks judge g2's states alone and name g1 left
    out; with g2 thin too, nothing is left to judge on and the gate says so (prm_metrics.gate_ranking)."""
    def examples_of(instances: dict[str, int]) -> list:
        examples = []
        for game, count in instances.items():
            for instance in range(count):
                examples += [prm_data.Example([1], False, label, (game, "e", str(instance)),
                                              state_id=f"{game}/{instance}", row=len(examples) + j)
                             for j, label in enumerate([0.0, 0.25, 0.75, 1.0])]
        return examples

    held_out = {"mean_label": 0.5, "mean_prediction": 0.5, "std_label": 0.4, "std_prediction": 0.4}
    for instances, left_out in (({"g1": 2, "g2": 4}, {"g1": 2}), ({"g1": 2, "g2": 2}, None)):
        examples = examples_of(instances)
        scorers = {"prm": [e.label for e in examples], "candidate_length": [-e.label for e in examples],
                   "policy_logprob": [-e.label for e in examples], "constant_mean": [0.0] * len(examples)}
        ranking = prm_metrics.ranking_metrics(examples, scorers, 200, 0, 0.95)
        judged = prm_metrics.gate_ranking(examples, scorers, ranking, 200, 0, 0.95)
        gate = prm_metrics.quality_gate(held_out, judged or ranking, gate_settings())
        if left_out is None:
            assert judged is None and gate["status"] == "not_judged" and "left_out" not in gate
            assert "g1 2, g2 2; at least 3 per game" in gate["not_judged"][0]
            continue
        assert judged["left_out"] == left_out and judged["ranked_instances"] == {"g2": 4}
        assert judged["pairs_with_different_labels"] == 4 * 6 < ranking["pairs_with_different_labels"]
        assert gate["status"] == "passed" and gate["left_out"] == left_out and not gate["not_judged"]
        assert {check["check"] for check in gate["checks"]} == {"spread", "pairwise_accuracy", "top1_regret"}
        assert ("LEFT OUT of the ranking checks: g1 (2 held-out instances with differently labelled siblings)"
                in prm_metrics.gate_lines(gate))


def test_a_gate_not_judged_stops_a_run_that_asks_to_stop_and_warns_in_one_that_goes_on(caplog):
    from clemprm.checks.run_time import StageFailure

    gate = prm_metrics.quality_gate(None, None, gate_settings())
    with pytest.raises(StageFailure, match=r"quality gate was not judged: spread and mean: no held-out labels .*"
                                           r"prm.gate.on_failure: continue"):
        prm_evaluation.gate_marks(gate, "stop")
    with caplog.at_level("WARNING", logger=prm_evaluation.log.name):
        assert prm_evaluation.gate_marks(gate, "continue") == []
    assert "PRM QUALITY GATE NOT JUDGED" in caplog.text


def test_calibration_decides_the_gate_only_where_a_search_multiplies_the_prm_values():
    """A PRM that ranks siblings well but sits 0.2 off the mean label: an argmax among siblings (best_of_n) or a beam's
    last score does not read the offset, beam search's product does."""
    from clemprm.modes import probability_search

    held_out = {"mean_label": 0.1, "mean_prediction": 0.3, "std_label": 0.2, "std_prediction": 0.15}
    ranking = ranking_of(prm=(0.8, 0.02), candidate_length=(0.6, 0.1), policy_logprob=(0.55, 0.12),
                         constant_mean=(0.5, 0.137))
    argmax = prm_metrics.quality_gate(held_out, ranking, gate_settings())
    assert argmax["status"] == "passed" and "mean" not in {check["check"] for check in argmax["checks"]}
    assert [(check["check"], check["passed"]) for check in argmax["reported"]] == [("mean", False)]
    assert "REPORTED mean" in prm_metrics.gate_lines(argmax)
    product = prm_metrics.quality_gate(held_out, ranking, gate_settings(), probabilities=True)
    assert product["status"] == "failed" and product["reported"] == []
    assert [check["check"] for check in product["checks"] if not check["passed"]] == ["mean"]
    beam = {"modes": ["greedy_sft", "beam_search", "beam_search_rule"], "aggregation": "prod"}
    assert probability_search(beam)
    assert not probability_search({**beam, "aggregation": "last"})
    assert not probability_search({"modes": ["best_of_n", "beam_search_logprob"], "aggregation": "prod"})


def random_heldout_ranking(seed: int, games: int, instances_per_game: int, samples: int) -> dict:
    """``ranking_metrics`` on held-out-like states with random labels, a random PRM and random candidate-aware
    baselines: ``games`` games of ``instances_per_game`` instances, each of 1-3 states of 4 siblings."""
    import random

    rng = random.Random(seed)
    examples = []
    for game in range(games):
        for instance in range(instances_per_game):
            for state in range(rng.randint(1, 3)):
                examples += [prm_data.Example([1], False, rng.choice([0.0, 0.25, 0.5, 1.0]),
                                         (f"g{game}", "e", str(instance)), state_id=f"{game}/{instance}/{state}",
                                         row=len(examples) + j)
                             for j in range(4)]
    scorers = {"prm": [rng.random() for _ in examples], "candidate_length": [rng.random() for _ in examples],
               "policy_logprob": [rng.random() for _ in examples], "constant_mean": [0.0] * len(examples)}
    return prm_metrics.ranking_metrics(examples, scorers, samples, seed, 0.95)


def test_a_random_prm_on_random_labels_passes_the_gate_in_at_most_5_percent_of_draws():
    """The issue's simulation. With one held-out instance per game the within-game bootstrap has no width, and a
    random PRM ahead on the point estimates passed (22 of 100 draws before instances were counted): now that is too
    little evidence, not judged (40 draws). With 3 instances per game (prm_metrics.MIN_RANKED_INSTANCES) it
    passes in at most 5 of 100; ahead of both candidate-aware baselines on points alone, it is in many more."""
    held_out = {"mean_label": 0.4, "mean_prediction": 0.4, "std_label": 0.3, "std_prediction": 0.3}
    single = [random_heldout_ranking(seed, 3, 1, 200) for seed in range(40)]
    verdicts = [prm_metrics.quality_gate(held_out, ranking, gate_settings())["status"] for ranking in single]
    assert "passed" not in verdicts and "not_judged" in verdicts
    several = [random_heldout_ranking(seed, 3, prm_metrics.MIN_RANKED_INSTANCES, 200) for seed in range(100)]
    passed = [prm_metrics.quality_gate(held_out, ranking, gate_settings())["status"] == "passed"
              for ranking in several]
    ahead_on_points = [all(r["scorers"]["prm"]["overall"]["pairwise_accuracy"]["value"] >
                           r["scorers"][name]["overall"]["pairwise_accuracy"]["value"]
                           for name in ("candidate_length", "policy_logprob")) for r in several]
    assert sum(passed) <= 5 < sum(ahead_on_points)
    differences = several[0]["differences"]
    assert set(differences) == {"candidate_length", "policy_logprob", "constant_mean"}
    point = several[0]["scorers"]["prm"]["overall"]["pairwise_accuracy"]["value"] - several[0]["scorers"][
        "candidate_length"]["overall"]["pairwise_accuracy"]["value"]
    assert differences["candidate_length"]["overall"]["pairwise_accuracy"]["value"] == pytest.approx(point)


def test_balanced_label_weights_give_each_class_half_of_the_loss():
    examples = [prm_data.Example([1], False, label, ("g", "e", "0"), row=i) for i, label in enumerate([0, 0, 0, 0.25])]
    weights = prm.label_weights(examples, "balanced")
    assert weights == {0: pytest.approx(2 / 3), 1: pytest.approx(2 / 3), 2: pytest.approx(2 / 3), 3: 2.0}
    assert sum(weights.values()) == pytest.approx(len(examples))
    assert set(prm.label_weights(examples, "none").values()) == {1.0}
    assert set(prm.label_weights(examples[:3], "balanced").values()) == {1.0}      # one class: nothing to balance
    logits, labels = torch.tensor([0.3, -1.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 0.25])
    per_pair = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    w = torch.tensor([weights[i] for i in range(4)])
    groups = torch.zeros(4, dtype=torch.long)
    assert prm.prm_loss(logits, labels, groups, "bce", 0.0, w) == pytest.approx(float((w * per_pair).sum() / w.sum()))
    assert prm.prm_loss(logits, labels, groups, "bce", 0.0) == pytest.approx(float(per_pair.mean()))


def test_the_trained_prm_passes_every_check_its_few_held_out_states_can_judge(trained):
    """6 held-out instances give 4 differently labelled sibling pairs: the checks judged pass, the ranking is not
    judged, and the gate says so rather than passing on no ranking evidence."""
    gate = trained["metrics"]["gate"]
    assert gate["status"] == "not_judged", prm_metrics.gate_lines(gate)
    assert gate["checks"] and all(check["passed"] for check in gate["checks"]), prm_metrics.gate_lines(gate)
    assert all("held-out sibling pairs with different labels" in what for what in gate["not_judged"])


@pytest.fixture(scope="module")
def untrained_prm(tmp_path_factory, test_cache_dir):
    """A PRM whose training cannot move it (learning rate 1e-12): it predicts its random start everywhere. 18 of the
    24 instances held out: at least 6 of them with differently labelled siblings (prm_metrics.MIN_RANKED_PAIRS)."""
    tmp = tmp_path_factory.mktemp("collapsed")
    settings = prm_settings(lr=1e-12, epochs=1, batch_size=8, grad_accum=1, validation_fraction=0.75)
    return tmp, settings, write_labels(tmp / "labels.parquet", synthetic_rows())


def test_a_prm_that_learned_nothing_stops_the_stage_naming_the_metric_and_the_baseline(untrained_prm, test_cache_dir):
    """prm.gate.on_failure: stop (configs/cluster.yaml), or inherit under the run's on_failure: stop. The stage that
    stops is prm_metrics: the adapter is written, the metrics (which every search with the PRM waits for) are not."""
    from clemprm.checks.run_time import StageFailure
    from clemprm.config import merge_config_files

    cluster = Path(__file__).resolve().parent.parent / "configs" / "cluster.yaml"
    assert merge_config_files([str(cluster)])["prm"]["gate"]["on_failure"] == "stop"
    tmp, settings, labels = untrained_prm
    predictions = str(tmp / "stop.predictions.parquet")
    prm.train_prm(settings, labels, str(tmp / "stop-adapter"), predictions, test_cache_dir)
    for action in ("stop", "inherit"):
        gated = {**settings, "prm": {**settings["prm"], "gate": {**settings["prm"]["gate"], "on_failure": action}}}
        with pytest.raises(StageFailure, match=r"prm_adapter: the PRM did not pass its quality gate: spread: .*"
                                               r"pairwise_accuracy: .* not clearly better than \w+"):
            prm_evaluation.measure_prm(gated, labels, predictions, str(tmp / f"{action}.json"), on_failure="stop")
        assert not (tmp / f"{action}.json").exists()
    assert (tmp / "stop-adapter/adapter_model.safetensors").is_file()


def test_by_default_a_failed_gate_reports_and_the_run_goes_on(untrained_prm, test_cache_dir):
    """The default prm.gate.on_failure: continue, even where the run's on_failure is stop: the first run finishes
    and its summary says the PRM failed."""
    from clemprm.checks.run_time import read_failure_marks

    tmp, settings, labels = untrained_prm
    assert settings["prm"]["gate"]["on_failure"] == "continue"
    metrics = train_and_measure(settings, labels, str(tmp / "report-adapter"), str(tmp / "report.json"), test_cache_dir,
                                on_failure="stop")
    assert metrics["gate"]["status"] == "failed" and (tmp / "report-adapter/adapter_model.safetensors").is_file()
    assert [mark["condition"] for mark in read_failure_marks(tmp / "report.json")] == ["prm_not_learned"]


def summary_of_a_search(scripted_policy, folder: Path, prm_metrics_path: Path) -> dict:
    """The eval summary of greedy_sft and best_of_n played by a policy that always answers "GUESS: 5" (best_of_n's
    PRM scripted to a constant), beside the PRM stage's metrics at ``prm_metrics_path``."""
    from clemprm.evaluation import evaluate
    from clemprm.play.contract import Generation
    from tests.test_evaluation import SETTINGS, ScriptedPRM

    class Policy(scripted_policy):
        def generate(self, perspectives, seeds=None, **kwargs):
            return [Generation(text="GUESS: 5", raw_text="GUESS: 5", prompt_tokens=1, new_tokens=2)
                    for _ in perspectives]

    paths = [str(folder / f"{mode}.parquet") for mode in ("greedy_sft", "best_of_n")]
    for mode, path in zip(("greedy_sft", "best_of_n"), paths):
        evaluate.evaluate_mode(mode, SETTINGS, path, policy=Policy(None, name=mode),
                               prm=ScriptedPRM(lambda messages, candidate: 0.5))
    return evaluate.summarize_eval(SETTINGS, paths, str(folder / "prm_eval.json"),
                                   prm_metrics_path=str(prm_metrics_path))


def test_under_continue_a_failed_gate_marks_the_summary_and_every_mode_that_searched_with_the_prm(
        untrained_prm, test_cache_dir, scripted_policy):
    from clemprm.evaluation import evaluate, report

    tmp, settings, labels = untrained_prm
    metrics = train_and_measure(settings, labels, str(tmp / "adapter"), str(tmp / "metrics.json"), test_cache_dir,
                                on_failure="continue")
    assert metrics["gate"]["status"] == "failed" and (tmp / "adapter/adapter_model.safetensors").is_file()
    (mark,) = metrics["failure_marks"]
    assert mark["condition"] == "prm_not_learned" and mark["stage"] == "prm_adapter"

    summary = summary_of_a_search(scripted_policy, tmp, tmp / "metrics.json")
    assert summary["prm"]["gate"]["status"] == "failed"
    assert summary["modes"]["best_of_n"]["prm_gate"] == "failed" and "prm_gate" not in summary["modes"]["greedy_sft"]
    assert [m["condition"] for m in summary["upstream_warnings"]] == ["prm_not_learned"]
    assert "best_of_n ran on a PRM that did not pass its quality gate" in summary["warnings"]
    assert "RAN ON A PRM THAT DID NOT PASS" in evaluate.summary_lines(summary)
    report.write_warnings_page(summary, tmp / "warnings.html")
    page = (tmp / "warnings.html").read_text()
    assert "prm_not_learned" in page and "best_of_n ran on a PRM that did not pass its quality gate" in page


def test_a_gate_not_judged_is_a_warning_in_the_summary_the_table_and_the_report(trained, tmp_path, scripted_policy):
    """The trained PRM's gate is not judged (4 held-out pairs): every mode that searched with it says so in
    prm_eval.json's warnings, the results table and the report's front page; it is no failure mark."""
    from clemprm.evaluation import console, report

    assert trained["metrics"]["gate"]["status"] == "not_judged" and not trained["metrics"].get("failure_marks")

    summary = summary_of_a_search(scripted_policy, tmp_path, trained["dir"] / "metrics.json")
    assert summary["modes"]["best_of_n"]["prm_gate"] == "not_judged" and summary["upstream_warnings"] == []
    (warning,) = summary["warnings"]
    assert warning.startswith("best_of_n ran on a PRM whose quality gate was not judged (no evidence is no pass)")
    assert "held-out sibling pairs with different labels" in warning
    table = console.summary_table(summary)
    assert "best_of_n (PRM gate not judged)" in table and "quality gate: not_judged, WARNING" in table
    report.write_warnings_page(summary, tmp_path / "warnings.html")
    page = (tmp_path / "warnings.html").read_text()
    assert "No stage went on after a failure" in page and "<strong>WARNING:</strong> best_of_n ran on a PRM" in page


def test_matching_a_perfect_baseline_passes_but_matching_an_imperfect_one_does_not():
    held_out = {"mean_label": 0.5, "mean_prediction": 0.5, "std_label": 0.3, "std_prediction": 0.3}
    perfect = prm_metrics.quality_gate(held_out, ranking_of(prm=(1.0, 0.0), policy_logprob=(1.0, 0.0),
                                                            constant_mean=(0.5, 0.2)), gate_settings())
    assert perfect["status"] == "passed"
    tie = prm_metrics.quality_gate(held_out, ranking_of(prm=(0.7, 0.1), policy_logprob=(0.7, 0.1),
                                                        constant_mean=(0.5, 0.2)), gate_settings())
    assert tie["status"] == "failed" and {c["check"] for c in tie["checks"] if not c["passed"]} == {
        "pairwise_accuracy", "top1_regret"}


def test_a_capped_gradient_accumulation_is_a_warning(tmp_path, test_cache_dir, caplog):
    """The cap that keeps an epoch's optimizer step changes the effective batch: a WARNING line (it was INFO)."""
    import logging

    settings = prm_settings(epochs=1, batch_size=8, grad_accum=16, validation_fraction=0.0)
    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows()[:24])
    with caplog.at_level(logging.INFO, logger="clemprm"):
        train_and_measure(settings, labels, str(tmp_path / "adapter"), str(tmp_path / "metrics.json"), test_cache_dir,
                          on_failure="continue")
    capped = [record for record in caplog.records if "gradient accumulation capped" in record.getMessage()]
    assert [record.levelname for record in capped] == ["WARNING"]
    assert capped[0].getMessage().endswith("(of prm.grad_accum 16) so that every epoch makes an optimizer step: the "
                                           "effective batch is 24, not 128")
