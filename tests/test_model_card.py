"""Model cards (``clemprm.model_card``): the README.md of a tiny SFT adapter and a tiny PRM parsed by huggingface_hub's
model-card parser; RL, SCoRe and merged-checkpoint cards rendered from metrics dicts; ``clemprm publish`` failing
offline and without a token, before any network access."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from clemprm import cli, model_card
from clemprm.stages import sft
from tests.conftest import tiny_config
from tests.test_prm import prm_settings, synthetic_rows, train_and_measure, write_labels


def interaction(task_id: int, game: str) -> dict:
    messages = [{"role": "user", "content": f"Round {task_id}. Name a number."},
                {"role": "assistant", "content": f"GUESS: {task_id % 3}"}]
    return {"messages": messages, "meta": {"game": game, "experiment": "e0", "task_id": task_id,
                                           "player_name": "Player 1", "game_role": "Guesser", "model": "test",
                                           "outcome": "success"}}


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, test_cache_dir):
    folder = tmp_path_factory.mktemp("card-sft")
    rows = [interaction(i, game) for game in ("g1", "g2") for i in range(4)]
    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = tiny_config(sft={"lr": 5e-3, "epochs": 2, "batch_size": 4, "grad_accum": 1, "warmup_ratio": 0.0,
                              "max_examples": None, "validation_fraction": 0.25,
                              "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}})
    settings = {name: config[name] for name in ("seed", "model", "sft")}
    metrics = sft.train_sft(settings, str(folder / "data.jsonl"), str(folder / "adapter"),
                            str(folder / "metrics.json"), test_cache_dir)
    return folder / "adapter", metrics


@pytest.fixture(scope="module")
def prm_run(tmp_path_factory, test_cache_dir):
    folder = tmp_path_factory.mktemp("card-prm")
    settings = prm_settings(lr=3e-3, epochs=2, batch_size=8, grad_accum=1, validation_fraction=0.25)
    labels = write_labels(folder / "labels.parquet", synthetic_rows())
    metrics = train_and_measure(settings, labels, str(folder / "adapter"), str(folder / "metrics.json"),
                                test_cache_dir, on_failure="continue")
    return folder / "adapter", metrics


def test_sft_adapter_card_parses_and_holds_the_run(sft_run):
    adapter, metrics = sft_run
    card = ModelCard.load(adapter / "README.md")   # validates the YAML front matter
    data = card.data.to_dict()
    assert data["library_name"] == "peft" and data["pipeline_tag"] == "text-generation"
    assert {"clemprm", "clembench", "lora", "sft"} <= set(data["tags"])
    assert "base_model" not in data and "license" not in data   # tiny:0 is no Hub model
    assert metrics == json.loads((adapter.parent / "metrics.json").read_text())   # the final metrics
    text = card.text
    assert "tiny:0" in text and "lr: 0.005" in text and "validation_fraction: 0.25" in text
    assert f"| steps | {metrics['steps']} |" in text and metrics["steps"] > 0
    assert f"| train_loss | {metrics['train_loss']:.4g} |" in text
    assert f"| eval_loss | {metrics['eval_loss']:.4g} |" in text
    assert "| g1 |" in text and "| g2 |" in text   # train examples by game
    assert f"| transformers | {metrics['versions']['transformers']} |" in text
    assert f"snakemake --cores all {adapter} --configfile CONFIG.yaml" in text
    assert not list(adapter.glob(".README.md.tmp-*"))


def test_prm_adapter_card_parses_and_holds_the_training(prm_run):
    """The card is the adapter's (rule prm_adapter): its training and data; the measured figures and the gate are
    rule prm_metrics's metrics.json, made after the adapter folder (which they must not touch: that would rerun every
    search with it)."""
    adapter, metrics = prm_run
    card = ModelCard.load(adapter / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "peft" and data["pipeline_tag"] == "text-classification"
    assert {"clemprm", "clembench", "lora", "prm"} <= set(data["tags"])
    text = card.text
    assert "lr: 0.003" in text and f"| steps | {metrics['steps']} |" in text
    assert f"| train_loss | {metrics['train_loss']:.4g} |" in text
    assert f"| heldout | {metrics['examples']['heldout']} |" in text


def test_embedded_base_gets_its_hub_original_and_licence():
    assert model_card.base_model_of("embedded:smollm2-135m-instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct",
                                                                       "apache-2.0")
    assert model_card.base_model_of("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert model_card.base_model_of("tiny:3") == (None, None)


def rl_metrics(algorithm: str) -> dict:
    step = {"reward": {"mean": 0.25, "std": 0.4}, "success_rate": 0.25, "percent_played": 100.0, "kl": 0.0,
            "grad_norm": 1.5, "trained_turns": 8}
    return {"status": "trained", "algorithm": algorithm,
            "model": {"spec": "embedded:smollm2-135m-instruct", "sft_adapter": "results/sft/adapter",
                      "fresh_lora": None, "device": "cpu", "quantization": "none", "dtype": "torch.float32"},
            "loss": "grpo", "history": [step, {**step, "reward": {"mean": 0.75, "std": 0.4}, "kl": 0.01}],
            "seconds": 12.5,
            "config": {"seed": 1, "model": {"spec": "embedded:smollm2-135m-instruct"},
                       "games": {"names": ["guessnumber"]}, "rl": {"algorithm": algorithm, "lr": 1e-5}},
            "versions": {"torch": "2.0"}}


@pytest.mark.parametrize("algorithm", ["grpo", "prime"])
def test_rl_adapter_card(tmp_path, algorithm):
    path = model_card.write_adapter_card(algorithm, tmp_path, rl_metrics(algorithm))
    card = ModelCard.load(path)
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and data["license"] == "apache-2.0"
    assert data["library_name"] == "peft" and {"rl", algorithm} <= set(data["tags"])
    assert "| reward (first step -> last step) | 0.25 -> 0.75 |" in card.text and "lr: 1.0e-05" in card.text


def test_score_adapter_card(tmp_path):
    metrics = {**rl_metrics("grpo"), "algorithm": None, "method": "score",
               "stages": {"1": {"reward_t1": 0.2, "reward_t2": 0.3}, "2": {"reward_t1": 0.4, "reward_t2": 0.6}}}
    card = ModelCard.load(model_card.write_adapter_card("score", tmp_path, metrics))
    assert "score" in card.data.tags and "| 2 | 0.4 | 0.6 |" in card.text


def test_merged_checkpoint_card(tmp_path):
    verification = {"name": "prm", "task": "seq-cls", "adapter": "results/prm/adapter",
                    "base": "embedded:smollm2-135m-instruct", "dtype": "bfloat16",
                    "reference": "PEFT(base fp32 + adapter)", "untied": [], "passed": True, "failures": [],
                    "examples": {"n": 4, "source": "soft labels", "tokens": [10, 12], "max_tokens": 64},
                    "thresholds": {"max_abs_logit_diff": 0.01}, "adapter_detectable": True,
                    "merged": {"max_abs_logit_diff": 0.001}, "seconds": {"total": 3.0},
                    "config": {"seed": 1, "merge": {"dtype": "bfloat16"}}, "versions": {"peft": "0.1"}}
    card = ModelCard.load(model_card.write_card(tmp_path, model_card.merged_card(verification, "results/merged/prm")))
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-classification"
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "merged" in data["tags"]
    assert "| passed | True |" in card.text and "snakemake --cores all results/merged/prm --configfile CONFIG.yaml" \
        in card.text


# ------------------------------------------------------------------------------------------- publish


@pytest.fixture
def carded(tmp_path):
    model_card.write_adapter_card("grpo", tmp_path, rl_metrics("grpo"))
    return tmp_path


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("publish reached for the network")
    monkeypatch.setattr(model_card.socket, "create_connection", refuse)
    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", refuse)
    monkeypatch.setattr("huggingface_hub.HfApi.upload_folder", refuse)


def test_publish_fails_at_once_offline(carded, monkeypatch, capsys, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    assert cli.main(["publish", str(carded), "user/repo"]) == 2
    assert "clemprm publish: offline: HF_HUB_OFFLINE is set" in capsys.readouterr().err


def test_publish_fails_at_once_without_a_token(carded, monkeypatch, tmp_path_factory, capsys, no_network):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path_factory.mktemp("hf-home") / "token"))
    assert cli.main(["publish", str(carded), "user/repo", "--private"]) == 2
    assert "clemprm publish: no Hugging Face token: set HF_TOKEN" in capsys.readouterr().err


def test_publish_needs_a_card(tmp_path, capsys, no_network):
    assert cli.main(["publish", str(tmp_path), "user/repo"]) == 2
    assert "has no README.md model card" in capsys.readouterr().err
