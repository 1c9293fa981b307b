"""The SFT stage on the tiny model (CPU): data preparation, the instance split, truncation, training with TRL +
PEFT (plain LoRA and the real NF4 QLoRA path), and the adapter loaded by the model loader playing real games."""

from __future__ import annotations

import json
import re

import pytest

from clemprm import records
from clemprm.stages import rollouts, sft
from clemprm.checks.run_time import StageFailure
from clemprm.models.loader import ModelConfig
from clemprm.models.generation import PolicyModel
from clemprm.play.chat import normalise
from clemprm.training import split_instances
from tests.conftest import binary_search_answer, tiny_config

# A tiny synthetic task: three prompts, each with one fixed answer, over several instances (so validation
# instances ask the same questions as training ones and the eval loss can fall).
SYNTHETIC = [
    ("Let us play a game. Guess a number from 1 to 10.", "GUESS: 7"),
    ("Which word does not belong? red, blue, table", "ANSWER: table"),
    ("Describe the picture: a small house.", "DESCRIPTION: a house with a red roof"),
]
EXTRA_PROMPT, EXTRA_ANSWER = "Which colour is the sky on a sunny day?", "ANSWER: blue"


def interaction(messages, game="synthetic", experiment="e0", task_id=0, outcome="success"):
    return {"messages": messages, "meta": {"game": game, "experiment": experiment, "task_id": task_id,
                                           "player_name": "Player 1", "game_role": "Guesser", "model": "test",
                                           "outcome": outcome}}


def meta_instance_key(row: dict) -> tuple[str, ...]:
    return records.instance_key(row["meta"]["game"], row["meta"]["experiment"], row["meta"]["task_id"])


def synthetic_rows(per_instance: int = 2) -> list[dict]:
    rows = []
    for i, (prompt, answer) in enumerate(SYNTHETIC):
        for task in range(4):          # 4 instances per prompt
            for _ in range(per_instance):
                rows.append(interaction([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                                        task_id=10 * i + task))
    return rows


def sft_settings(**sft_overrides) -> dict:
    model = sft_overrides.pop("model", {})
    sft_overrides.setdefault("grad_accum", 1)   # the tests give batch_size in full
    config = tiny_config(model=model, sft=sft_overrides)
    return {name: config[name] for name in ("seed", "model", "sft")}


def write_extra_jsonl(path) -> str:
    """A small playpen-data interactions export: one successful episode (two turns of another game) and one
    lost episode whose answer must not be learned."""
    won = interaction([{"role": "user", "content": EXTRA_PROMPT}, {"role": "assistant", "content": "green"},
                       {"role": "user", "content": "Wrong. Try again."},
                       {"role": "assistant", "content": EXTRA_ANSWER}],
                      game="extragame", experiment="x", task_id=0, outcome="success")
    lost = interaction([{"role": "user", "content": EXTRA_PROMPT}, {"role": "assistant", "content": "ANSWER: red"}],
                       game="extragame", experiment="x", task_id=1, outcome="lose")
    path.write_text("\n".join(json.dumps(row) for row in [won, lost] * 4) + "\n")
    return str(path)


# ----------------------------------------------------------------------------------- data (no model)


def test_turn_pairs_one_per_assistant_turn_with_roles_merged():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                {"role": "assistant", "content": "1"}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": "2"}]
    pairs = sft.turn_pairs(normalise(messages))
    assert [answer for _, answer in pairs] == ["1", "2"]
    assert pairs[0][0] == [{"role": "user", "content": "a\n\nb"}]
    assert [m["role"] for m in pairs[1][0]] == ["user", "assistant", "user"]


def test_shortening_drops_oldest_exchanges_keeping_head_and_last_prompt():
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "u0"}]
    for i in range(1, 4):
        prompt += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"u{i}"}]
    variants = list(sft.shortened_prompts(prompt))
    assert [dropped for _, dropped in variants] == [0, 1, 2]
    for messages, _ in variants:
        assert [m["content"] for m in messages[:2]] == ["sys", "u0"] and messages[-1]["content"] == "u3"
        roles = [m["role"] for m in messages[1:]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
    assert [m["content"] for m in variants[-1][0]] == ["sys", "u0", "a3", "u3"]


def test_split_is_by_instance_and_keeps_experiments_apart():
    # the same task_id in two experiments is two instances
    keys = [(game, experiment, str(task)) for game in ("g1", "g2") for experiment in ("e1", "e2") for task in range(5)]
    validation = split_instances(keys * 3, 0.2, seed=1)
    assert len(validation) == 4 and {key[0] for key in validation} == {"g1", "g2"}
    assert validation == split_instances(list(reversed(keys)), 0.2, seed=1)  # deterministic, order-free
    assert validation != split_instances(keys, 0.2, seed=2)
    assert split_instances(keys[:1], 0.5, seed=1) == set()                  # one instance: nothing held out
    assert len(split_instances(keys[:2], 0.9, seed=1)) == 1                 # never all of them


def test_read_interactions_parquet_jsonl_and_success_filter(tmp_path):
    extra = write_extra_jsonl(tmp_path / "extra.jsonl")
    rows = records.read_interactions(extra)
    assert len(rows) == 8 and sum(sft.is_success(row) for row in rows) == 4
    records.write_records(tmp_path / "x.parquet", rows, records.INTERACTIONS, {})
    assert records.read_interactions(tmp_path / "x.parquet") == rows
    (tmp_path / "bad.jsonl").write_text('{"text": "no messages"}\n')
    with pytest.raises(ValueError, match="interactions layout"):
        records.read_interactions(tmp_path / "bad.jsonl")


# --------------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def base_policy(test_cache_dir):
    return PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir), max_new_tokens=16)


def test_prompts_are_rendered_as_the_policy_sees_them_and_truncation_keeps_the_answer(base_policy):
    tokenizer = base_policy.tokenizer
    chat = sft.ChatFormat(tokenizer, base_policy.cfg.chat_template_kwargs, [tokenizer.eos_token_id])
    assert chat.end_text == "<|im_end|>"
    long_turns = [{"role": "user", "content": "Let us play a game. " * 4}]
    for i in range(12):
        long_turns += [{"role": "assistant", "content": f"GUESS: {i}"},
                       {"role": "user", "content": f"Your guess {i} is too low. The number is higher. " * 3}]
    assert chat.render_prompt(long_turns) == base_policy.render(long_turns)

    answer = "GUESS: 9"
    full = chat.encode(long_turns, answer, 10_000)
    prompt_ids, completion_ids, dropped = chat.encode(long_turns, answer, 300)
    assert dropped > 0 and len(full[0]) > 300 >= len(prompt_ids) + len(completion_ids)
    assert tokenizer.decode(completion_ids) == answer + "<|im_end|>"
    prompt = tokenizer.decode(prompt_ids)
    assert prompt.startswith("<|im_start|>user\nLet us play a game.")              # first prompt kept
    assert "Your guess 11 is too low" in prompt and "Your guess 0 is too low" not in prompt
    assert prompt == base_policy.render(long_turns[:1] + long_turns[-2 * (12 - dropped):])
    assert chat.encode(long_turns, answer, 40) is None                               # cannot fit: dropped


@pytest.fixture(scope="module")
def trained(tmp_path_factory, test_cache_dir, scripted_policy):
    """One training run: the synthetic task + real guessnumber wins (scripted binary search, through the
    real base_rollouts and win_filter stages) + a playpen-data jsonl (extra_data)."""
    tmp = tmp_path_factory.mktemp("sft")
    config = tiny_config(games={"builtin": ["guessnumber"], "max_instances": {"train": 2, "validation": 2, "test": 1}})
    episodes = tmp / "episodes.parquet"
    rollouts.base_rollouts({k: config[k] for k in ("seed", "model", "games", "base_rollouts")}, str(episodes),
                           policy=scripted_policy(binary_search_answer, name="oracle"))
    wins = rollouts.win_filter({"win_filter": config["win_filter"]}, str(episodes), str(tmp / "wins.parquet"))
    data = tmp / "sft_data.parquet"
    records.write_records(data, wins + synthetic_rows(per_instance=1), records.INTERACTIONS, {})
    settings = sft_settings(lr=5e-3, epochs=8, batch_size=8, warmup_ratio=0.0, max_examples=None,
                            validation_fraction=0.0, extra_data=write_extra_jsonl(tmp / "extra.jsonl"))
    metrics = sft.train_sft(settings, str(data), str(tmp / "adapter"), str(tmp / "metrics.json"), test_cache_dir)
    return {"settings": settings, "metrics": metrics, "adapter": str(tmp / "adapter"), "dir": tmp,
            "n_wins": len(wins), "games": config["games"]}


def test_training_drives_the_loss_down_and_writes_adapter_and_metrics(trained):
    metrics = trained["metrics"]
    assert metrics == json.loads((trained["dir"] / "metrics.json").read_text())
    assert metrics["status"] == "trained" and metrics["steps"] > 0 and metrics["epochs_run"] == 8
    for path in ("adapter_config.json", "adapter_model.safetensors"):
        assert (trained["dir"] / "adapter" / path).is_file()
    adapter_config = json.loads((trained["dir"] / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 16 and adapter_config["lora_alpha"] == 32 and adapter_config["lora_dropout"] == 0.05
    assert adapter_config["base_model_name_or_path"] == "tiny:0"
    history = metrics["history"]
    assert [row["epoch"] for row in history] == list(range(1, 9))
    assert history[-1]["train_loss"] < 0.2 * history[0]["train_loss"]
    assert history[-1]["train_token_accuracy"] > 0.9 > history[0]["train_token_accuracy"]
    assert metrics["eval_loss"] is None and metrics["examples"]["validation"] == 0   # validation_fraction 0
    assert metrics["model"] == {"spec": "tiny:0", "base_adapter": None, "device": "cpu", "quantization": "none",
                                "dtype": "torch.float32"}
    assert metrics["optimizer"] == "adamw_torch" and not metrics["bf16"] and not metrics["gradient_checkpointing"]
    examples = metrics["examples"]
    assert examples["train"] == sum(examples["pairs_by_source"].values()) and examples["shortened"] == 0
    assert metrics["tokens"]["train"] > metrics["tokens"]["train_answer"] > 0
    assert metrics["seconds"] > 0 and metrics["peak_memory_mb"]["rss"] > 0
    assert metrics["config"]["sft"]["lr"] == 5e-3 and "trl" in metrics["versions"] and "peft" in metrics["versions"]


def test_extra_data_is_mixed_in_successful_rows_only(trained):
    examples = trained["metrics"]["examples"]
    assert examples["rows"]["extra_data"] == 4                 # the 4 lost rows are filtered out
    assert examples["pairs_by_source"]["extra_data"] == 8      # two assistant turns per successful row
    assert examples["rows"]["sft_data"] == trained["n_wins"] + len(synthetic_rows(per_instance=1))


def test_trained_answers_become_greedy_answers_of_base_plus_adapter(trained, base_policy, test_cache_dir):
    policy = PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir, adapter=trained["adapter"]),
                         max_new_tokens=32)
    prompts = [[{"role": "user", "content": prompt}] for prompt, _ in SYNTHETIC + [(EXTRA_PROMPT, "")]]
    answers = [answer for _, answer in SYNTHETIC]
    assert [g.text for g in policy.generate(prompts)][:3] == answers
    assert policy.generate(prompts)[3].text == "green"   # extra data: the first turn of its won episode
    assert [g.text for g in base_policy.generate(prompts, max_new_tokens=32)][:3] != answers


def test_adapter_plays_games_through_the_engine_differently_from_the_base(trained, base_policy, test_cache_dir):
    from clemprm.play.catalog import GameCatalog
    from clemprm.play.contract import Sampling
    from clemprm.play.engine import RolloutEngine

    catalog = GameCatalog(trained["games"])
    instances = catalog.all_instances("validation")
    engine = RolloutEngine(catalog, Sampling(temperature=0.0, max_new_tokens=12))
    policy = PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir, adapter=trained["adapter"]),
                         max_new_tokens=12)
    assert policy.name == "tiny-0+adapter"
    runs = {name: engine.play(instances, [model], repeats=1, base_seed=0, stage="sft-test", policy_name=name)
            for name, model in (("base", base_policy), ("sft", policy))}
    answers = {name: [turn["response"] for row in rows for turn in row["turns"]] for name, rows in runs.items()}
    assert all(row["error"] is None for rows in runs.values() for row in rows)
    assert answers["sft"] != answers["base"]
    # trained on binary-search wins: the SFT policy answers in the game's format
    assert all(re.fullmatch(r"GUESS: \d+", answer) for answer in answers["sft"])
    assert not any(re.fullmatch(r"GUESS: \d+", answer) for answer in answers["base"])


def test_qlora_nf4_on_cpu_with_instance_split_and_eval_per_epoch(tmp_path, test_cache_dir):
    data = tmp_path / "data.parquet"
    rows = synthetic_rows()
    records.write_records(data, rows, records.INTERACTIONS, {})
    settings = sft_settings(model={"quantization": "nf4"}, lr=5e-3, epochs=3, batch_size=8, max_examples=None,
                            validation_fraction=0.25, early_stopping_patience=2)
    metrics = sft.train_sft(settings, str(data), str(tmp_path / "adapter"), str(tmp_path / "metrics.json"),
                            test_cache_dir)
    assert metrics["model"]["quantization"] == "nf4" and metrics["status"] == "trained"
    # held out by instance: 3 of the 12 instances, with both rows of each
    keys = [meta_instance_key(row) for row in rows]
    assert metrics["examples"]["validation_instance_keys"] == sorted(
        "/".join(key) for key in split_instances(keys, 0.25, settings["seed"]))
    assert metrics["examples"]["validation"] == 2 * 3 and metrics["examples"]["train"] == 2 * 9
    history = metrics["history"]
    assert [row["epoch"] for row in history] == [0, 1, 2, 3]
    assert all(row["eval_loss"] is not None and row["eval_token_accuracy"] is not None for row in history)
    assert metrics["eval_loss"] < 0.5 * metrics["initial_eval_loss"]
    assert metrics["eval_token_accuracy"] > metrics["initial_eval_token_accuracy"]
    policy = PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir, quantization="nf4",
                                     adapter=str(tmp_path / "adapter")), max_new_tokens=8)
    layer = policy.model.get_base_model().model.layers[0].linear_attn.in_proj_qkv
    assert type(layer.base_layer).__name__ == "Linear4bit" and hasattr(layer, "lora_A")
    assert all(g.error is None for g in policy.generate([[{"role": "user", "content": SYNTHETIC[0][0]}]]))


def test_early_stopping_keeps_the_best_epoch(tmp_path, test_cache_dir):
    """Every instance has its own answer: held-out answers cannot be learned, the eval loss turns up, training
    stops after `patience` worse epochs and the written adapter is the best epoch's (its eval loss, recomputed)."""
    import torch

    rows = [interaction([{"role": "user", "content": f"Say the secret word number {i}."},
                         {"role": "assistant", "content": f"SECRET: {word}"}], task_id=i)
            for i, word in enumerate(["apple", "river", "chair", "table", "seven", "green", "house", "tree"])]
    data = tmp_path / "data.parquet"
    records.write_records(data, rows * 2, records.INTERACTIONS, {})
    settings = sft_settings(lr=2e-2, epochs=10, batch_size=8, warmup_ratio=0.0, max_examples=None,
                            validation_fraction=0.25, early_stopping_patience=1)
    metrics = sft.train_sft(settings, str(data), str(tmp_path / "adapter"), str(tmp_path / "metrics.json"),
                            test_cache_dir)
    assert metrics["stopped_early"] and metrics["epochs_run"] < 10
    evals = [row["eval_loss"] for row in metrics["history"][1:]]
    assert metrics["eval_loss"] == min(evals) and metrics["best_epoch"] == 1 + evals.index(min(evals))
    assert metrics["best_epoch"] < metrics["epochs_run"]

    policy = PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir,
                                     adapter=str(tmp_path / "adapter")))
    chat = sft.ChatFormat(policy.tokenizer, policy.cfg.chat_template_kwargs, [policy.tokenizer.eos_token_id])
    validation = set(metrics["examples"]["validation_instance_keys"])
    examples, _ = sft.build_examples([row for row in rows * 2 if "/".join(meta_instance_key(row)) in validation],
                                     chat, 1024, "sft_data")
    total, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            logits = policy.model(input_ids=torch.tensor([example.input_ids])).logits[0, :-1]
            targets = torch.tensor(example.input_ids[1:])
            start = len(example.prompt_ids) - 1
            total += torch.nn.functional.cross_entropy(logits[start:], targets[start:], reduction="sum").item()
            count += len(example.completion_ids)
    assert total / count == pytest.approx(metrics["eval_loss"], rel=1e-3)


def test_no_training_examples_writes_an_untrained_adapter_equal_to_the_base(tmp_path, base_policy, test_cache_dir):
    data = tmp_path / "data.parquet"
    records.write_records(data, [], records.INTERACTIONS, {})
    write_extra_jsonl(tmp_path / "extra.jsonl")
    lost_only = tmp_path / "lost.jsonl"
    lost_only.write_text("\n".join(line for line in (tmp_path / "extra.jsonl").read_text().splitlines()
                                   if '"lose"' in line) + "\n")
    with pytest.raises(StageFailure, match="sft_adapter: no wins to fine-tune on .0 player perspectives"):
        sft.train_sft(sft_settings(extra_data=str(lost_only)), str(data), str(tmp_path / "adapter"),
                      str(tmp_path / "m.json"), test_cache_dir)
    metrics = sft.train_sft(sft_settings(extra_data=str(lost_only)), str(data), str(tmp_path / "adapter"),
                            str(tmp_path / "m.json"), test_cache_dir, on_failure="continue")
    assert metrics["status"].startswith("untrained") and metrics["examples"]["train"] == 0
    policy = PolicyModel(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir,
                                     adapter=str(tmp_path / "adapter")), max_new_tokens=8)
    prompts = [[{"role": "user", "content": prompt}] for prompt, _ in SYNTHETIC]
    expected = [g.text for g in base_policy.generate(prompts, max_new_tokens=8)]
    assert [g.text for g in policy.generate(prompts)] == expected


def test_a_run_of_one_step_with_a_warmup_trains_at_half_its_learning_rate(tmp_path, test_cache_dir):
    """One optimizer step with a warmup: transformers' schedule would run it at learning rate 0 and leave the adapter
    the base policy; the stages' schedule (clemprm.training.stage_trainer) runs warm-up step i of w at (i + 1) / (w +
    1) of the peak, so the one step trains."""
    data = tmp_path / "data.parquet"
    records.write_records(data, synthetic_rows(per_instance=1), records.INTERACTIONS, {})
    settings = sft_settings(lr=5e-3, epochs=1, batch_size=16, warmup_ratio=0.1, max_examples=None,
                            validation_fraction=0.0, extra_data=None)
    metrics = sft.train_sft(settings, str(data), str(tmp_path / "adapter"), str(tmp_path / "metrics.json"),
                            test_cache_dir)
    assert metrics["steps"] == 1 and metrics["status"] == "trained"
    assert metrics["learning_rates"] == {"min": pytest.approx(2.5e-3), "max": pytest.approx(2.5e-3)}


def test_untrained_reason_names_unchanged_weights():
    from clemprm.training import untrained_reason

    assert untrained_reason(2, [5e-4, 1e-3], changed=4) is None
    assert untrained_reason(2, [1e-3, 1e-3], changed=0) == ("its weights did not change in 2 optimizer step(s) "
                                                            "(learning rates 0.001 to 0.001)")


def test_a_game_that_loses_every_pair_to_max_length_is_a_failure_counted_per_game(tmp_path, test_cache_dir, caplog):
    """A clembench-format game with a long first prompt: every one of its pairs is too long even shortened. The stage
    fails naming the game and sft.max_length (on_failure: stop), or goes on with a mark; the log and the metrics count
    kept, shortened and dropped pairs per game."""
    from clemprm.checks.run_time import read_failure_marks

    long_prompt = "Rules of the game. " + " ".join(f"rule{i} applies" for i in range(300))
    long_rows = [interaction([{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "GUESS: 3"},
                              {"role": "user", "content": "Higher."}, {"role": "assistant", "content": "GUESS: 5"}],
                             game="longgame", task_id=task) for task in range(2)]
    data = tmp_path / "data.parquet"
    records.write_records(data, synthetic_rows(per_instance=1) + long_rows, records.INTERACTIONS, {})
    settings = sft_settings(max_length=64, epochs=1, batch_size=8, max_examples=None, validation_fraction=0.0,
                            extra_data=None)
    paths = [str(tmp_path / "adapter"), str(tmp_path / "metrics.json")]
    with pytest.raises(StageFailure, match=re.escape(
            "sft_adapter: every pair of longgame (4 pairs) is too long for sft.max_length 64 even with the oldest "
            "exchanges dropped: raise sft.max_length")):
        sft.train_sft(settings, str(data), *paths, test_cache_dir)
    caplog.set_level("INFO", logger="clemprm.stages.sft")
    metrics = sft.train_sft(settings, str(data), *paths, test_cache_dir, on_failure="continue")
    assert metrics["examples"]["pairs_by_game"] == {"longgame": {"kept": 0, "shortened": 0, "dropped": 4},
                                                    "synthetic": {"kept": 12, "shortened": 0, "dropped": 0}}
    assert "sft data of game longgame: 0 pairs kept (0 of them shortened), 4 too long even shortened" in caplog.text
    mark, = read_failure_marks(tmp_path / "metrics.json")
    assert (mark["condition"], mark["game"], mark["count"]) == ("game_lost_to_max_length", "longgame", 4)
    assert metrics["status"] == "trained"
