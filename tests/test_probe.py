"""The probe PRM (``prm.kind: probe``) on the tiny model (CPU): it fits a separable signal on held-out instances,
its scores do not depend on the batch, the prm_adapter stage's function trains it and ``load_prm`` gives the scorer
the eval uses, the choices are made by cross-validation over train instances, the validity head reads the answers
records, and a blind best_of_n with it plays the chosen answer."""

from __future__ import annotations

import json

import pytest

from clemprm import records, stats
from clemprm.models import prm as prm_model
from clemprm.models.scoring import shared_prefix_groups
from clemprm.models.probe import CONFIG_NAME, WEIGHTS_NAME
from clemprm.play.engine import RolloutEngine
from clemprm.search.best_of_n import best_of_n
from clemprm.play.contract import Pair, Scorer
from clemprm.stages import prm, probe
from tests.test_search import JUNK, SAMPLING, catalog, seeded_policy, start  # noqa: F401 (fixtures)
from tests.test_prm import (MARKER, NEGATIVE, POSITIVE, WORDS, prm_settings, soft_label_row, synthetic_rows,
                            train_and_measure, write_labels)

PROBE = {"layers": [-1, -2], "window": 8, "l2": [0.01, 1.0], "combination": ["value", "product"], "folds": 3}


def probe_settings(**prm_overrides) -> dict:
    """:func:`tests.test_prm.prm_settings` of a probe (a probe is nothing to merge: no prm in merge.adapters)."""
    return prm_settings(**{"kind": "probe", "probe": PROBE, "validation_fraction": 0.25, **prm_overrides},
                        merge={"adapters": ["sft"]})


def pairs_of(rows) -> list[Pair]:
    return [Pair(row["prefix"], row["candidate"]) for row in rows]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, test_cache_dir):
    tmp = tmp_path_factory.mktemp("probe")
    rows = synthetic_rows()
    settings = probe_settings()
    metrics = train_and_measure(settings, write_labels(tmp / "labels.parquet", rows), str(tmp / "adapter"),
                                str(tmp / "metrics.json"), test_cache_dir)
    scorer = prm_model.load_prm(settings["model"], settings["prm"], str(tmp / "adapter"), test_cache_dir)
    return {"settings": settings, "metrics": metrics, "dir": tmp, "rows": rows, "scorer": scorer}


def test_a_probe_fits_a_separable_signal_on_held_out_instances(fitted):
    metrics, rows, scorer = fitted["metrics"], fitted["rows"], fitted["scorer"]
    assert isinstance(scorer, prm_model.ProbeScorer)
    held_out = set(metrics["examples"]["validation_instance_keys"])
    assert held_out and metrics["evaluation"]["validation"]["auroc"] > 0.95
    # the reloaded folder scores the held-out instances' pairs as well (the eval reads it through load_prm)
    unseen = [row for row in rows if "/".join(map(str, (row["game"], row["experiment"], row["game_id"]))) in held_out]
    scores = scorer.score(pairs_of(unseen))
    assert stats.auroc(scores, [row["label"] for row in unseen]) > 0.95
    assert metrics["status"] == "trained" and metrics["probe"]["features"] == 2 * 2 * 64


def test_the_eval_loads_a_probe_for_best_of_n(fitted, test_cache_dir):
    from clemprm.evaluation.scorers import load_scorer
    from clemprm.modes import MODES

    adapter = str(fitted["dir"] / "adapter")
    scorer, used = load_scorer(MODES["best_of_n"], fitted["settings"], {"prm_adapter": adapter}, None,
                               test_cache_dir)
    pairs = pairs_of(fitted["rows"][:4])
    assert isinstance(scorer, prm_model.ProbeScorer) and used == adapter
    assert scorer.score(pairs) == pytest.approx(fitted["scorer"].score(pairs), abs=1e-6)


def test_a_probe_folder_names_its_policy_and_its_choices(fitted):
    folder = fitted["dir"] / "adapter"
    assert {path.name for path in folder.iterdir()} >= {CONFIG_NAME, WEIGHTS_NAME, "README.md"}
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert config["kind"] == "probe" and config["layers"] == [-1, -2] and config["window"] == 8
    assert config["policy"] == {"spec": "tiny:0", "sft_adapter": None, "sft_adapter_sha256": None}
    # no answers records: product is no candidate; each l2 cross-validated over train instances, chosen on ranking
    assert [row["l2"] for row in config["cv"]] == [0.01, 1.0] and config["combination"] == "value"
    assert config["criterion"] == "pairwise_accuracy" and all(row["cv_pairs"] > 0 for row in config["cv"])
    best = max(row["cv_pairwise_accuracy"] for row in config["cv"])
    assert config["l2"] in [row["l2"] for row in config["cv"] if row["cv_pairwise_accuracy"] == best]
    assert all(row["cv_top1_regret"] is not None and row["cv_loss"] > 0 for row in config["cv"])
    metrics = json.loads((fitted["dir"] / "metrics.json").read_text())
    assert metrics["probe"]["cv"] == config["cv"]
    assert not [mark for mark in metrics["failure_marks"] if mark["condition"] == probe.EDGE_CONDITION]  # 2 values
    card = (folder / "README.md").read_text()
    assert "probe" in card and "PeftModel" not in card


def test_probe_scores_do_not_depend_on_the_batch(fitted):
    scorer, rows = fitted["scorer"], fitted["rows"]
    pairs = pairs_of(rows[:10]) + [Pair(rows[0]["prefix"], "a much longer candidate " * 6)]
    together = scorer.score(pairs)
    alone = [scorer.score([pair])[0] for pair in pairs]
    one_per_batch = prm_model.ProbeScorer(probe.ProbeFeatures(scorer.cfg, scorer.tokenizer, scorer.model, [-1, -2],
                                                              8, token_budget=1), scorer.head)
    assert together == pytest.approx(alone, abs=1e-5)
    assert one_per_batch.score(list(reversed(pairs))) == pytest.approx(list(reversed(together)), abs=1e-5)
    assert scorer.stats.shared_tokens == 0 and len(set(together)) > 2


@pytest.mark.parametrize("window", [1, 8, 200])
def test_probe_features_on_shared_prefixes_equal_the_full_pass(fitted, window):
    """Two prompts of different lengths (left padding), their candidates sharing each prompt's prefix: a window
    inside the answer, one reaching back into the prompt, one longer than a whole short sequence."""
    import torch

    scorer, rows = fitted["scorer"], fitted["rows"]
    prompts = [rows[0]["prefix"], [{"role": "user", "content": "A prompt of another length, " * 12}]]
    candidates = ["yes", "no it is not", "a much longer candidate " * 6, "no it is not"]
    ids, keys = [], []
    for k, prompt in enumerate(prompts):
        for candidate in candidates:
            ids.append(prm_model.encode_pair(scorer.tokenizer, prompt, candidate, "", scorer.cfg.chat_template_kwargs,
                                             1024)[0])
            keys.append(k)
    features = probe.ProbeFeatures(scorer.cfg, scorer.tokenizer, scorer.model, [-1, -2], window, token_budget=8192)
    groups, alone = shared_prefix_groups(ids, keys)
    assert features.share_prefixes and len(groups) == 2 and not alone
    assert len({group.shared for group in groups}) == 2
    full, shared = features.of(ids), features.of(ids, keys)
    assert torch.allclose(shared, full, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(full[0], full[1], atol=1e-3)


def test_empty_labels_write_an_untrained_probe_that_scores(tmp_path, test_cache_dir):
    settings = probe_settings()
    metrics = train_and_measure(settings, write_labels(tmp_path / "labels.parquet", []), str(tmp_path / "adapter"),
                                str(tmp_path / "m.json"), test_cache_dir)
    assert metrics["status"].startswith("untrained") and metrics["examples"]["train"] == 0
    scorer = prm_model.load_prm(settings["model"], settings["prm"], str(tmp_path / "adapter"), test_cache_dir)
    assert scorer.score(pairs_of(synthetic_rows()[:3])) == [0.5] * 3


def test_instance_folds_keep_an_instance_in_one_fold():
    keys = [("g", "e", i % 5) for i in range(20)]
    folds = probe.instance_folds(keys, 3, seed=1)
    assert set(folds) == {0, 1, 2}
    assert all(len({f for f, key in zip(folds, keys) if key == k}) == 1 for k in set(keys))
    assert probe.instance_folds(keys, 3, seed=1) == folds
    assert set(probe.instance_folds(keys[:1], 3, seed=1)) == {0}


class TableFeatures:
    """A stand-in for the policy's features (:class:`probe.ProbeFeatures`): example ``i``'s input ids are ``[i]``
    and its features row ``i`` of a table, so that a test sets what the probe reads."""

    layers, window, cfg, tokenizer, model, token_budget = [-1], 1, None, object(), object(), 1

    def __init__(self, table):
        self.table = table

    def of(self, sequences, keys=None):
        return self.table[[ids[0] for ids in sequences]]


def ranked_examples(siblings: int = 3, states: int = 32, noise: int = 40, seed: int = 0):
    """Examples that the held-fold loss and the held-fold ranking judge apart, and their features. A state's label
    is a random base of its own plus 0.05 u: the ``noise`` features, constant within a state, can only memorise the
    bases (a weak ridge does, and the held-fold loss punishes that), and u shows only as the difference of two
    features x1 = s + 0.3 u and x2 = s, with s a sibling's nuisance: a strong ridge weighs features by their
    correlation with the label, x1 alone, and so orders siblings by s."""
    import torch

    from clemprm.stages.prm_data import Example

    generator = torch.Generator().manual_seed(seed)
    state = torch.arange(states).repeat_interleave(siblings)
    s, u = torch.randn(len(state), generator=generator), torch.randn(len(state), generator=generator)
    bases = torch.rand(states, generator=generator) * 0.6 + 0.2
    table = torch.cat([(s + 0.3 * u)[:, None], s[:, None], torch.randn(states, noise, generator=generator)[state]], 1)
    labels = (bases[state] + 0.05 * u).clamp(0, 1).tolist()
    examples = [Example([i], False, labels[i], ("g", "e", int(k)), f"state/{int(k)}", row=i)
                for i, k in enumerate(state)]
    return examples, TableFeatures(table)


def fit_ranked(l2s: list[float], siblings: int = 3) -> dict:
    """:func:`probe.fit_probe` on :func:`ranked_examples` (BCE, value head only, 3 folds): its training record."""
    examples, features = ranked_examples(siblings)
    settings = {"probe": {"l2": l2s, "combination": ["value"], "folds": 3}, "loss": "bce", "pairwise_weight": 0.0,
                "input": "candidate", "max_length": 64}
    _, training = probe.fit_probe(features, settings, 0, examples, [], {e.row: 1.0 for e in examples}, prm.prm_loss)
    return training


def test_the_probe_chooses_on_ranking_where_the_loss_disagrees():
    training = fit_ranked([0.01, 100.0])
    report, rows = training["probe"], {row["l2"]: row for row in training["probe"]["cv"]}
    # the old rule (lowest held-fold loss) takes the strong ridge, which ranks siblings near chance
    assert min(rows.values(), key=lambda row: row["cv_loss"])["l2"] == 100.0
    assert rows[0.01]["cv_pairwise_accuracy"] > rows[100.0]["cv_pairwise_accuracy"] + 0.2
    assert rows[0.01]["cv_top1_regret"] < rows[100.0]["cv_top1_regret"]
    assert report["criterion"] == "pairwise_accuracy" and report["l2"] == 0.01
    assert all(row["cv_pairs"] == 96 and row["cv_states"] == 32 for row in rows.values())
    assert training["failure_marks"] == []   # two values: no edge to warn of


def test_choose_l2_chooses_on_ranking_too():
    """:func:`probe.choose_l2`, the LoRA PRM's ``head_init: probe`` choice, takes the ranking's l2 as the probe does."""
    examples, features = ranked_examples()
    data = probe.FitData.of(examples, features.table, {e.row: 1.0 for e in examples})
    l2, table = probe.choose_l2(data, [0.01, 100.0], lambda *args: prm.prm_loss(*args[:3], "bce", 0.0, args[3]), 3, 0)
    assert l2 == 0.01 and probe.ranking_criterion(table) == "pairwise_accuracy"
    assert min(table, key=lambda row: row["cv_loss"])["l2"] == 100.0


def test_choose_l2_fits_its_folds_as_the_final_head_is_fitted():
    """Without an intercept (the LoRA PRM's score head has no bias) the folds' heads must have none either: the
    labels' level (0.2-0.8) is then the weights' to carry, and the held folds' loss shows it."""
    examples, features = ranked_examples()
    data = probe.FitData.of(examples, features.table, {e.row: 1.0 for e in examples})

    def objective(*args):
        return prm.prm_loss(*args[:3], "bce", 0.0, args[3])

    _, with_bias = probe.choose_l2(data, [0.01, 100.0], objective, 3, 0)
    _, without = probe.choose_l2(data, [0.01, 100.0], objective, 3, 0, intercept=False)
    assert [row["l2"] for row in without] == [0.01, 100.0]
    assert [row["cv_loss"] for row in without] != [row["cv_loss"] for row in with_bias]


def test_ranking_ties_are_broken_by_regret_then_loss():
    def row(l2, accuracy, regret, loss):
        return {"l2": l2, "cv_pairwise_accuracy": accuracy, "cv_top1_regret": regret, "cv_loss": loss, "cv_pairs": 4}

    assert probe.choose_value([row(1, 0.5, 0.1, 0.1), row(2, 0.75, 0.2, 0.9), row(3, 0.75, 0.1, 0.9)])["l2"] == 3
    assert probe.choose_value([row(1, 0.75, 0.1, 0.9), row(2, 0.75, 0.1, 0.5)])["l2"] == 2


def test_a_choice_at_the_grid_edge_is_a_warning(caplog):
    with caplog.at_level("WARNING"):
        training = fit_ranked([0.01, 1.0, 100.0])
    assert training["probe"]["l2"] == 0.01
    [mark] = training["failure_marks"]
    assert mark["condition"] == "probe_choice_at_grid_edge" and mark["stage"] == "prm_adapter"
    assert "value head chose l2 0.01" in mark["message"] and "smallest" in mark["message"]
    assert mark["message"] in caplog.text
    assert probe.grid_edge_marks("value", 1.0, [0.01, 1.0, 100.0], "pairwise_accuracy") == []
    assert probe.grid_edge_marks("value", 100.0, [0.01, 100.0], "pairwise_accuracy") == []
    assert "largest" in probe.grid_edge_marks("validity", 100.0, [100.0, 0.01, 1.0], "auroc")[0]["message"]


def test_without_held_fold_pairs_the_probe_chooses_on_loss(caplog):
    with caplog.at_level("WARNING"):
        training = fit_ranked([0.01, 100.0], siblings=1)
    report = training["probe"]
    assert report["criterion"] == "loss" and all(row["cv_pairs"] == 0 for row in report["cv"])
    assert all(row["cv_pairwise_accuracy"] is None for row in report["cv"])
    assert report["l2"] == min(report["cv"], key=lambda row: row["cv_loss"])["l2"]
    assert "chosen by held-fold loss, not by ranking" in caplog.text


def answer_rows(n: int) -> list[dict]:
    """Answers records (:data:`records.ANSWERS`) on the train split: an answer naming the marker is accepted."""
    rows = []
    for i in range(n):
        accepted = i % 2 == 0
        prefix = [{"role": "user", "content": f"Round {i % 6}. Name a word."}]
        rows.append({"source": "base_rollouts", "episode_id": f"g1/e0/{i % 6}/{i}", "game": "g1", "experiment": "e0",
                     "game_id": i % 6, "split": "train", "turn_idx": 0, "player": "Player 1", "game_role": "Guesser",
                     "messages": prefix, "response": f"I say {MARKER}" if accepted else f"I say {WORDS[i % 8]} now",
                     "parse_ok": accepted, "count": 1, "n_success": 0, "n_lost": 1, "n_aborted": 0,
                     "bench_score": 0.0})
    return rows


def test_the_validity_head_reads_the_answers_records(tmp_path, test_cache_dir):
    answers = tmp_path / "answers.parquet"
    records.write_records(answers, answer_rows(24), records.ANSWERS, {})
    settings = probe_settings(acceptance_examples=16, probe={**PROBE, "combination": ["product"]})
    metrics = train_and_measure(settings, write_labels(tmp_path / "labels.parquet", synthetic_rows()),
                                str(tmp_path / "adapter"), str(tmp_path / "metrics.json"), test_cache_dir,
                                answers_path=str(answers))
    validity = metrics["probe"]["validity"]
    # the answers of some instances are kept out, to measure the validity head on alone
    held = metrics["acceptance"]["heldout"]
    assert validity["examples"] == metrics["acceptance"]["examples"] == 16 - held["n"] and held["n"] > 0
    assert held["auroc"] is not None and len(validity["cv"]) == 2
    # the validity head (no siblings) is chosen by its held-fold AUROC of the verdicts
    assert validity["criterion"] == "auroc" and all(row["cv_auroc"] is not None for row in validity["cv"])
    assert validity["l2"] == max(validity["cv"], key=lambda row: (row["cv_auroc"], -row["cv_loss"]))["l2"]
    assert metrics["probe"]["combination"] == "product"
    scorer = prm_model.load_prm(settings["model"], settings["prm"], str(tmp_path / "adapter"), test_cache_dir)
    assert scorer.head.validity is not None
    value_only = prm_model.ProbeScorer(scorer.features, probe.ProbeHead(scorer.head.value))
    pairs = pairs_of(synthetic_rows()[:6])
    # the product is never above the value head's probability alone
    assert all(p <= v + 1e-6 for p, v in zip(scorer.score(pairs), value_only.score(pairs)))
    with pytest.raises(ValueError, match="answers input"):
        prm.train_prm(settings, str(tmp_path / "labels.parquet"), str(tmp_path / "again"),
                      str(tmp_path / "again.parquet"), test_cache_dir)


def test_probe_errors_name_the_key_and_what_to_do(fitted, tmp_path, test_cache_dir):
    settings = fitted["settings"]
    with pytest.raises(ValueError, match="prm.base_model"):
        probe.policy_features(settings["model"], {**settings["prm"], "base_model": "tiny:1"}, None, test_cache_dir)
    with pytest.raises(ValueError, match="prm.probe.layers"):
        features = probe.policy_features(settings["model"], {**settings["prm"], "probe": {**PROBE, "layers": [-9]}},
                                         None, test_cache_dir)
        features.of([[1, 2, 3]])
    (tmp_path / "lora").mkdir()
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        prm_model.load_prm(settings["model"], settings["prm"], str(tmp_path / "lora"), test_cache_dir)
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "adapter_model.safetensors").write_bytes(b"one")
    probe.write_probe(fitted["scorer"], tmp_path / "tied", None, str(sft))
    (sft / "adapter_model.safetensors").write_bytes(b"two")
    with pytest.raises(ValueError, match="changed since"):
        prm_model.load_prm(settings["model"], settings["prm"], str(tmp_path / "tied"), test_cache_dir)


def test_best_of_n_with_a_probe_plays_the_chosen_answer(catalog, seeded_policy, tmp_path, test_cache_dir):
    """The probe in the blind loop: fitted on oddoneout train prompts where answers naming the marker word are
    labelled high, it picks the marker answer among sampled ones on unseen validation prompts; no game saw a
    candidate before it was chosen."""
    engine = RolloutEngine(catalog, SAMPLING)
    rows = []
    for episode in start(engine, catalog.instances("oddoneout", "train"), seeded_policy(lambda m, seed: JUNK)):
        prefix = engine.waiting(episode)[1]
        game, experiment, game_id = episode.instance.key
        for turn, word in enumerate(WORDS[:4]):
            marked = turn % 2 == 0
            rows.append(soft_label_row(game, experiment, game_id, turn, prefix,
                                       f"ANSWER: {MARKER if marked else word}", POSITIVE if marked else NEGATIVE))
    settings = probe_settings(validation_fraction=0.0)
    prm.train_prm(settings, write_labels(tmp_path / "labels.parquet", rows), str(tmp_path / "adapter"),
                  str(tmp_path / "predictions.parquet"), test_cache_dir)
    scorer = prm_model.load_prm(settings["model"], settings["prm"], str(tmp_path / "adapter"), test_cache_dir)
    proposed = {}

    class RecordingPRM(Scorer):
        def score(self, pairs):
            for pair in pairs:
                assert pair.reply is None and pair.accepted is None   # blind: no game saw the candidate
                proposed.setdefault(str(pair.perspective), set()).add(pair.candidate)
            return scorer.score(pairs)

    def answer(messages, seed):  # one sample in three names the marker
        return f"ANSWER: {MARKER}" if seed % 3 == 0 else f"ANSWER: {WORDS[seed % 7]}"

    episodes = start(engine, catalog.instances("oddoneout", "validation"), seeded_policy(answer))
    best_of_n(engine, episodes, RecordingPRM(), 12, SAMPLING)
    first_turns = [episode.turns[0] for episode in episodes]
    assert first_turns and all(len(proposed[str(turn["messages"])]) > 1 for turn in first_turns)
    with_marker = [turn for turn in first_turns if f"ANSWER: {MARKER}" in proposed[str(turn["messages"])]]
    assert with_marker and all(turn["response"] == f"ANSWER: {MARKER}" for turn in with_marker)
