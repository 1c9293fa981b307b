"""The merge stage on tiny models (CPU, fp32): a LoRA on a tied lm_head merged as PEFT computes it (and not as
merge_and_unload does), a bf16 merge losing a small update, the PRM's score head kept, the failure path, and the
merged checkpoint playing the episodes of the adapter it came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clemprm.evaluation import evaluate
from clemprm.stages import merge
from clemprm.config import eval_mode_params
from clemprm.models.loader import ModelConfig, load_tokenizer_and_model
from clemprm.models.tiny import build_tiny_model
from tests.conftest import tiny_config
from tests.test_prm import synthetic_rows, write_labels

CAUSAL_TARGETS = ["q_proj", "v_proj", "in_proj_qkv", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory) -> str:
    """The tiny Qwen3.5 with its lm_head tied to the input embedding, as a local model folder."""
    folder = tmp_path_factory.mktemp("tiny-tied")
    build_tiny_model(0, folder, tie_word_embeddings=True)
    return str(folder)


def write_lora(spec: str, cache_dir: str, out, targets, b_scale: float, task: str = "causal-lm") -> str:
    """A LoRA adapter with random A and B (B scaled by ``b_scale``: the size of the update), saved to ``out``. For
    seq-cls the score head (modules_to_save) is changed as training would."""
    from peft import LoraConfig, get_peft_model

    _, model = load_tokenizer_and_model(ModelConfig(spec=spec, threads=1, cache_dir=cache_dir), task=task)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                                  task_type="SEQ_CLS" if task == "seq-cls" else "CAUSAL_LM"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
            elif "modules_to_save" in name:
                param.add_(torch.randn_like(param))
    peft_model.save_pretrained(str(out))
    return str(out)


def write_sft_data(path) -> str:
    """Won dialogues of 10 instances (playpen-data interactions), two answers each; the SFT split holds 2 out."""
    rows = [{"messages": [{"role": "user", "content": f"Guess a number from 1 to 10. Game {i}: the quick brown fox."},
                          {"role": "assistant", "content": f"GUESS: {i % 10 + 1}"},
                          {"role": "user", "content": "Your guess is too low. The number is higher."},
                          {"role": "assistant", "content": f"GUESS: {(i + 3) % 10 + 1}"}],
             "meta": {"game": "guessnumber", "experiment": "e", "task_id": i, "player_name": "Player 1",
                      "game_role": "Guesser", "model": "m", "outcome": "success"}} for i in range(10)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def merge_settings(spec: str, task: str = "causal-lm", **merge_overrides) -> dict:
    return merge.merge_params(tiny_config(model={"spec": spec}, merge=merge_overrides), task)


@pytest.fixture(scope="module")
def tied_merge(tied_base, test_cache_dir, tmp_path_factory):
    """An adapter that moves the logits visibly, with a LoRA on the tied lm_head, merged and verified."""
    tmp = tmp_path_factory.mktemp("tied-merge")
    adapter = write_lora(tied_base, test_cache_dir, tmp / "adapter", CAUSAL_TARGETS, b_scale=0.05)
    settings = merge_settings(tied_base)
    verification = merge.merge_and_verify("sft", "causal-lm", settings, adapter, write_sft_data(tmp / "sft.jsonl"),
                                          str(tmp / "merged"), test_cache_dir)
    return {"verification": verification, "dir": tmp, "adapter": adapter, "settings": settings}


def test_tied_lm_head_merge_matches_peft_and_merge_and_unload_does_not(tied_merge, tied_base, test_cache_dir):
    verification = tied_merge["verification"]
    thresholds = verification["thresholds"]
    merged, naive = verification["merged"], verification["contrasts"]["peft_merge_and_unload"]
    assert verification["passed"] and verification["untied"] == ["lm_head"]
    assert verification["examples"]["source"] == "validation" and verification["examples"]["n"] == 3
    assert merged["max_abs_logit_diff"] < 1e-4 and merged["argmax_agreement"] == 1.0
    assert merged["log_likelihood"] == merged["reference_log_likelihood"]   # to 6 decimals
    # the adapter moves logits far more than the merged model differs, and the naive merge visibly differs
    assert verification["adapter_detectable"]
    assert verification["adapter_effect"]["max_abs_logit_diff"] > 1000 * merged["max_abs_logit_diff"]
    assert merge.threshold_failures(naive, thresholds)
    assert naive["mean_abs_logit_diff"] > 100 * merged["mean_abs_logit_diff"]
    assert "contrast: peft_merge_and_unload" in merge.verification_table(verification)

    # the saved weights: embed_tokens unchanged, lm_head = embedding + B @ A * scale as its own tensor, untied config
    folder = tied_merge["dir"] / "merged"
    assert json.loads((folder / "verification.json").read_text())["passed"]
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["dtype"] == "float32"
    weights = load_file(str(folder / "model.safetensors"))
    base = load_file(str(Path(tied_base) / "model.safetensors"))
    embedding = next(value for key, value in base.items() if key.endswith("embed_tokens.weight"))
    merged_embedding = next(value for key, value in weights.items() if key.endswith("embed_tokens.weight"))
    adapter = load_file(str(tied_merge["dir"] / "adapter" / "adapter_model.safetensors"))
    lora_a, lora_b = (adapter[f"base_model.model.lm_head.lora_{x}.weight"] for x in "AB")
    assert torch.equal(merged_embedding, embedding)
    assert torch.allclose(weights["lm_head.weight"], embedding + lora_b @ lora_a * (8 / 4), atol=1e-6)
    _, reloaded = load_tokenizer_and_model(ModelConfig(spec=str(folder), threads=1, cache_dir=test_cache_dir))
    assert reloaded.lm_head.weight.data_ptr() != reloaded.get_input_embeddings().weight.data_ptr()


def test_tied_embedding_lora_gets_its_own_embedding_and_lm_head_keeps_the_base(tied_base, test_cache_dir, tmp_path):
    # the tied case the SFT stage can train (TRL refuses a LoRA on lm_head, not one on embed_tokens)
    adapter = write_lora(tied_base, test_cache_dir, tmp_path / "adapter", ["embed_tokens", "q_proj"], b_scale=0.05)
    verification = merge.merge_and_verify("sft", "causal-lm", merge_settings(tied_base), adapter,
                                          write_sft_data(tmp_path / "sft.jsonl"), str(tmp_path / "merged"),
                                          test_cache_dir)
    assert verification["passed"] and verification["untied"] == ["model.embed_tokens"]
    assert merge.threshold_failures(verification["contrasts"]["peft_merge_and_unload"], verification["thresholds"])
    weights = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = load_file(str(Path(tied_base) / "model.safetensors"))
    embedding = next(value for key, value in base.items() if key.endswith("embed_tokens.weight"))
    assert torch.equal(weights["lm_head.weight"], embedding)
    assert not torch.equal(next(v for k, v in weights.items() if k.endswith("embed_tokens.weight")), embedding)


def test_bf16_merge_of_a_small_update_loses_it(tied_base, test_cache_dir, tmp_path):
    adapter = write_lora(tied_base, test_cache_dir, tmp_path / "adapter", CAUSAL_TARGETS, b_scale=2.5e-4)
    verification = merge.merge_and_verify("sft", "causal-lm", merge_settings(tied_base), adapter,
                                          write_sft_data(tmp_path / "sft.jsonl"), str(tmp_path / "merged"),
                                          test_cache_dir)
    fp32, bf16 = verification["merged"]["update"], verification["contrasts"]["bfloat16_merge"]["update"]
    assert 2e-4 < fp32["max_relative_update"] < 5e-3   # an update of the card's size (1.4e-3)
    assert fp32["update_lost"] < 1e-3
    assert bf16["update_lost"] > 0.5                     # rounded away in bf16 weights
    assert verification["passed"]
    assert merge.threshold_failures(verification["contrasts"]["bfloat16_merge"], verification["thresholds"])


def test_prm_merge_keeps_its_score_head(test_cache_dir, tmp_path):
    adapter = write_lora("tiny:0", test_cache_dir, tmp_path / "adapter", ["q_proj", "v_proj"], b_scale=0.05,
                         task="seq-cls")
    labels = write_labels(tmp_path / "labels.parquet", synthetic_rows())
    verification = merge.merge_and_verify("prm", "seq-cls", merge_settings("tiny:0", "seq-cls"), adapter, labels,
                                          str(tmp_path / "merged"), test_cache_dir)
    assert verification["passed"] and verification["task"] == "seq-cls"
    assert verification["modules_to_save"] == {"score": True}
    assert verification["examples"] == {"n": 3, "source": "validation", "tokens": verification["examples"]["tokens"],
                                        "max_tokens": 768}
    assert verification["adapter_effect"]["max_abs_logit_diff"] > 1e-3 > verification["merged"]["max_abs_logit_diff"]
    assert "skipped" in verification["contrasts"]["peft_merge_and_unload"]   # tiny:0 ties nothing
    trained = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    head = next(value for key, value in trained.items() if key.endswith("score.weight"))
    _, reloaded = load_tokenizer_and_model(ModelConfig(spec=str(tmp_path / "merged"), threads=1,
                                                       cache_dir=test_cache_dir), task="seq-cls")
    assert torch.equal(reloaded.score.weight, head)


def test_a_merge_that_does_not_match_fails_naming_the_metric(tied_merge, test_cache_dir, tmp_path):
    # a bf16 checkpoint does not meet the default (fp32) thresholds: the job fails and leaves no merged folder
    settings = merge_settings(tied_merge["settings"]["model"]["spec"], dtype="bfloat16", contrasts=False)
    with pytest.raises(merge.VerificationError, match=r"mean_abs_logit_diff \S+ > 0.001"):
        merge.merge_and_verify("sft", "causal-lm", settings, tied_merge["adapter"],
                               str(tied_merge["dir"] / "sft.jsonl"), str(tmp_path / "merged"), test_cache_dir)
    assert not list(tmp_path.glob("*merged*"))   # neither the folder nor its temporary
    assert merge.threshold_failures({"argmax_agreement": 0.99}, {"argmax_agreement": 0.999}) == [
        "argmax_agreement 0.99 < 0.999"]


def test_greedy_merged_plays_the_episodes_of_greedy_sft(test_cache_dir, tmp_path):
    adapter = write_lora("tiny:0", test_cache_dir, tmp_path / "adapter", CAUSAL_TARGETS, b_scale=0.3)
    verification = merge.merge_and_verify("sft", "causal-lm", merge_settings("tiny:0"), adapter,
                                          write_sft_data(tmp_path / "sft.jsonl"), str(tmp_path / "merged"),
                                          test_cache_dir)
    assert verification["passed"] and verification["untied"] == []
    config = tiny_config(eval={"max_new_tokens": 12})
    played = {}
    for mode in ("greedy_base", "greedy_sft", "greedy_merged"):
        rows = evaluate.evaluate_mode(mode, eval_mode_params(config, mode), str(tmp_path / f"{mode}.parquet"),
                                      test_cache_dir, sft_adapter=adapter, merged_model=str(tmp_path / "merged"))
        played[mode] = [(row["episode_id"], [turn["response"] for turn in row["turns"]], row["aborted"],
                         None if row["aborted"] else row["bench_score"]) for row in rows]
    assert played["greedy_merged"] == played["greedy_sft"]
    assert played["greedy_sft"] != played["greedy_base"]   # the adapter changes the play the merge kept
