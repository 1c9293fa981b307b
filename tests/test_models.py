"""The model loader and the batched generator (tiny random Qwen3.5; one slow test with the embedded SmolLM2)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from clemprm.models.decoder import Decoder  # noqa: E402
from clemprm.models.generation import PolicyModel, strip_thinking  # noqa: E402
from clemprm.models.kv_cache import PrefixStore, RowState  # noqa: E402
from clemprm.models.loader import (ModelConfig, cache_root, load_tokenizer_and_model, parse_spec,  # noqa: E402
                                   resolve_model_dir)
from clemprm.models.sampling import SamplingParams, sample_tokens  # noqa: E402
from clemprm.models.tiny import build_tiny_model  # noqa: E402
from clemprm.play.contract import Generation  # noqa: E402

MESSAGES = [
    [{"role": "user", "content": "Let us play a game. I am thinking of a number from 1 to 10. GUESS: ?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Which word does not belong? red, blue, table"}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
     {"role": "user", "content": "Your guess is too low."}, {"role": "user", "content": "Try again."}],
    [{"role": "user", "content": "The quick brown fox " * 8}],
    [{"role": "user", "content": "one two three"}],
    [{"role": "user", "content": "Describe the picture: a small house with a red roof next to a tall tree."}],
]


@pytest.fixture(scope="module")
def tiny_cfg(test_cache_dir):
    return ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir)


@pytest.fixture(scope="module")
def policy(tiny_cfg):
    return PolicyModel(tiny_cfg, max_new_tokens=24)


def hf_greedy(policy, perspectives, max_new_tokens):
    """Plain HF generate, batched with left padding: new token ids up to and including the end token."""
    tok = policy.tokenizer
    texts = [policy.render(m) for m in perspectives]
    side, tok.padding_side = tok.padding_side, "left"
    enc = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
    tok.padding_side = side
    with torch.inference_mode():
        out = policy.model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in policy.decoder.eos), len(row))
        rows.append(row[:cut])
    return rows


def our_ids(policy, perspectives, params, seeds=None, token_budget=16384):
    prompts = [policy.tokenizer(policy.render(m), add_special_tokens=False)["input_ids"] for m in perspectives]
    seeds = seeds if seeds is not None else list(range(len(prompts)))
    return [ids for ids, _ in policy.decoder.generate(prompts, params, seeds, token_budget=token_budget)]


# ------------------------------------------------------------------------------------ config and specs


def test_config_from_dict_defaults_and_roundtrip():
    cfg = ModelConfig.from_dict({"spec": "tiny:3", "threads": 1})
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.quantization == "auto" and cfg.token_budget == 16384 and cfg.max_context_tokens == 2048
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig.from_dict(None).spec == "embedded:smollm2-135m-instruct"


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="unknown model config key.*temprature.*top_q"):
        ModelConfig.from_dict({"spec": "tiny:0", "temprature": 0.5, "top_q": 1})
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int8")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="fp32")
    with pytest.raises(ValueError, match="threads"):
        ModelConfig(threads=-1)


@pytest.mark.parametrize("spec, message", [
    ("tiny:abc", "integer seed"),
    ("tiny", "incomplete"),
    ("embedded:gpt5", "unknown embedded model 'gpt5'.*embedded:smollm2-135m-instruct"),
    ("hf:Qwen/Qwen3.5-9B", "unknown model spec scheme 'hf'"),
    ("", "non-empty"),
])
def test_spec_errors_are_clear(spec, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(spec=spec)


def test_spec_kinds_and_names():
    assert parse_spec("tiny:7") == ("tiny", 7)
    assert parse_spec("embedded:smollm2-135m-instruct") == ("embedded", "smollm2-135m-instruct")
    assert parse_spec("Qwen/Qwen3.5-9B") == ("path", "Qwen/Qwen3.5-9B")
    assert ModelConfig(spec="tiny:0").short_name == "tiny-0"
    assert ModelConfig().short_name == "smollm2-135m-instruct"
    assert ModelConfig(adapter="results/adapters/sft/").short_name == "smollm2-135m-instruct+sft"
    assert ModelConfig(spec="/models/Qwen3.5-9B/").short_name == "Qwen3.5-9B"


def test_cache_never_under_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="results"):
        cache_root(ModelConfig(cache_dir=str(tmp_path / "results" / "cache")))
    monkeypatch.setenv("CLEMPRM_CACHE", str(tmp_path / "elsewhere"))
    assert cache_root(ModelConfig()) == (tmp_path / "elsewhere").resolve()


# ------------------------------------------------------------------------------------------ tiny model


def test_tiny_model_is_deterministic_and_materialised_safely(tmp_path):
    dirs = []

    def resolve():  # two concurrent materialisations of one model: one folder, complete, no leftovers
        dirs.append(resolve_model_dir(ModelConfig(spec="tiny:5", cache_dir=str(tmp_path / "a"))))

    threads = [threading.Thread(target=resolve) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(dirs) == 2 and dirs[0] == dirs[1]
    folder = Path(dirs[0])
    assert json.loads((folder / ".clemprm-complete.json").read_text())["spec"] == "tiny:5"
    assert sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")) == [folder.name]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    # same seed, same weights (and tokenizer); another seed, other weights
    _, again = build_tiny_model(5)
    _, other = build_tiny_model(6)
    from safetensors.torch import load_file
    saved = load_file(str(folder / "model.safetensors"))
    state = again.state_dict()
    assert all(torch.equal(saved[k], state[k]) for k in saved)
    assert not torch.equal(state["lm_head.weight"], other.state_dict()["lm_head.weight"])


def test_tiny_tokenizer_and_real_qwen35_chat_template(policy):
    tok = policy.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    for token in ("<think>", "</think>", "<|im_start|>", "<|im_end|>", "<tool_call>"):
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1
    text = "Hello there, GUESS: 5 and 123 ok's"
    assert tok.decode(tok(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "Hi"}]
    off = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    on = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    default = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert off == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == default == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert policy.render(messages) == off  # the config's default chat_template_kwargs: thinking off


def test_tiny_model_answers_end_reasonably_often(policy):
    perspectives = MESSAGES * 4
    generations = policy.generate(perspectives, temperature=1.0, max_new_tokens=48)
    stopped = [g for g in generations if g.finish_reason == "stop"]
    assert len(stopped) >= 0.7 * len(generations)
    assert sum(g.new_tokens <= 20 for g in generations) >= 0.5 * len(generations)
    assert sum(bool(g.text) for g in generations) >= 0.5 * len(generations)


# ------------------------------------------------------------------------------------------ generation


def test_greedy_equals_hf_generate(policy):
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    expected = hf_greedy(policy, MESSAGES, 20)
    assert our_ids(policy, MESSAGES, params) == expected
    # micro-batches (a tiny token budget) and single rows give the same tokens, in input order
    assert our_ids(policy, MESSAGES, params, token_budget=64) == expected
    assert [our_ids(policy, [m], params)[0] for m in MESSAGES] == expected
    # repeated prompts (decoded once when greedy) get the same answers, as separate lists
    repeated = our_ids(policy, MESSAGES[:2] + MESSAGES + MESSAGES[1:2], params)
    assert repeated == expected[:2] + expected + expected[1:2] and repeated[0] is not repeated[2]
    generations = policy.generate(MESSAGES, temperature=0.0, max_new_tokens=20)
    assert [g.raw_text for g in generations] == [policy.tokenizer.decode(e, skip_special_tokens=True)
                                                 for e in expected]
    assert [g.new_tokens for g in generations] == [len(e) for e in expected]


def test_prompt_tokenization_is_unpadded_after_a_padding_call(policy):
    """The decoder tokenises through the Rust backend, whose padding a user's ``tokenizer(..., padding=True)``
    leaves switched on."""
    texts = ["short", "a much longer text than the first one, with more tokens"]
    expected = policy.tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert policy._tokenize(texts) == expected and len(expected[0]) < len(expected[1])
    policy.tokenizer(texts, add_special_tokens=False, padding=True, truncation=True, max_length=8)
    assert policy._tokenize(texts) == expected


def test_sampling_is_per_row_deterministic(policy):
    seeds = [11, 12, 13, 14, 15, 16]
    kwargs = dict(temperature=1.0, top_p=0.95, max_new_tokens=16)
    batched = [g.raw_text for g in policy.generate(MESSAGES, seeds=seeds, **kwargs)]
    alone = [policy.generate([m], seeds=[s], **kwargs)[0].raw_text for m, s in zip(MESSAGES, seeds)]
    reordered = [g.raw_text for g in policy.generate(MESSAGES[::-1], seeds=seeds[::-1], **kwargs)][::-1]
    mixed = policy.generate([MESSAGES[3], MESSAGES[0], MESSAGES[0]], seeds=[99, seeds[0], 98], **kwargs)
    assert batched == alone == reordered
    assert mixed[1].raw_text == batched[0]
    # identical prompts with different seeds give different samples; the same seed the same one
    same_prompt = policy.generate([MESSAGES[0]] * 8, seeds=list(range(8)) , **kwargs)
    assert len({g.raw_text for g in same_prompt}) >= 4
    repeat = policy.generate([MESSAGES[0]] * 2, seeds=[3, 3], **kwargs)
    assert repeat[0].raw_text == repeat[1].raw_text == same_prompt[3].raw_text


def _hf_probs(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p, scale", [
    (0.7, 50, 0.9, 3.0),     # HF defaults + clemprm's usual settings: the top-k path
    (1.0, 0, 0.8, 3.0),      # top-p alone: the candidate path
    (1.0, 0, 0.999, 0.1),    # a flat distribution: nucleus wider than the candidates, full sort
    (1.3, 0, 1.0, 3.0),      # no filtering at all
    (0.5, 5, 1.0, 3.0),      # top-k alone
])
def test_sampling_distribution_equals_hf_warpers(temperature, top_k, top_p, scale):
    vocab, n = 1000, 4000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * scale
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # a uniform grid: frequencies = probabilities
    for row in range(2):
        tokens = sample_tokens(logits[row].expand(n, vocab).contiguous(), params, uniforms)
        ours = torch.bincount(tokens, minlength=vocab).double() / n
        expected = _hf_probs(logits[row:row + 1], temperature, top_k, top_p)[0].double()
        assert not bool(((ours > 0) & (expected == 0)).any())  # nothing outside HF's kept set
        assert (ours - expected).abs().max() <= 1.5 / n + 1e-6


def test_think_stripping():
    assert strip_thinking("<think>\nplan</think>\n\nGUESS: 3 ") == "GUESS: 3"
    assert strip_thinking("GUESS: 3 <think>still thinking") == "GUESS: 3"
    assert strip_thinking("<think>a</think>x<think>b</think> y") == "x y"
    assert strip_thinking("reasoning...</think>\n\nANSWER: table", inside_think=True) == "ANSWER: table"
    assert strip_thinking("reasoning without end", inside_think=True) == ""
    assert strip_thinking("  plain answer\n") == "plain answer"


def test_thinking_prompt_is_stripped_from_answers(tiny_cfg):
    thinking = PolicyModel(dataclasses.replace(tiny_cfg, chat_template_kwargs={"enable_thinking": True}),
                           max_new_tokens=12)
    assert thinking.render(MESSAGES[0]).endswith("<think>\n")
    for generation in thinking.generate(MESSAGES, temperature=1.0):
        if "</think>" in generation.raw_text:
            assert generation.text == strip_thinking(generation.raw_text.split("</think>", 1)[1])
        else:
            assert generation.text == ""


def test_too_long_item_fails_alone(tiny_cfg):
    short = PolicyModel(dataclasses.replace(tiny_cfg, max_context_tokens=60), max_new_tokens=8)
    long_messages = [{"role": "user", "content": "The quick brown fox jumps. " * 30}]
    generations = short.generate([MESSAGES[4], long_messages, MESSAGES[0]], temperature=0.0)
    assert generations[1].error is not None and generations[1].error.startswith("context too long: ")
    assert generations[1].error.endswith(" > 60 tokens (model.max_context_tokens; raise it, or set it to auto: the "
                                         "model's own context length)") and generations[1].text == ""
    assert generations[0].error is None and generations[2].error is None
    assert generations[0].raw_text == short.generate([MESSAGES[4]], temperature=0.0)[0].raw_text
    with pytest.raises(RuntimeError, match="context too long"):
        short.generate_batch_response([MESSAGES[4], long_messages])
    assert short.stats.errors == 2 and short.stats.calls == 3


def test_max_context_tokens_auto_is_the_models_own_context_length(tiny_cfg, policy):
    from clemprm.models.vllm_backend import server_context_length

    auto = PolicyModel(dataclasses.replace(tiny_cfg, max_context_tokens="auto"), tokenizer=policy.tokenizer,
                       model=policy.model)
    assert auto.cfg.max_context_tokens == 4096   # the tiny model's max_position_embeddings and model_max_length
    long_messages = [{"role": "user", "content": "The quick brown fox jumps. " * 800}]
    error = auto.generate([long_messages])[0].error
    assert error.startswith("context too long: ") and error.endswith(
        " > 4096 tokens (model.max_context_tokens; auto: the model's own context length)")
    # a vLLM server holds a prompt of max_context_tokens and its answer, within the model's own length
    assert server_context_length(policy.cfg, policy.tokenizer) == 2048 + 1024
    assert server_context_length(auto.cfg, policy.tokenizer) == 4096
    with pytest.raises(ValueError, match="max_context_tokens must be an integer >= 1 or auto, got 'all'"):
        ModelConfig(max_context_tokens="all")


def test_clemcore_interface_and_deepcopy(policy):
    assert copy.deepcopy(policy) is policy
    assert copy.deepcopy({"model": policy})["model"] is policy
    assert policy.name == "tiny-0" and policy.model_spec.model_name == "tiny-0"
    assert policy.temperature == 0.0 and policy.max_tokens == 24
    results = policy.generate_batch_response(MESSAGES[:2])
    assert len(results) == 2
    prompt, response, text = results[0]
    assert prompt["inputs"] == policy.render(MESSAGES[0])
    assert response["clem_player"]["response"] == text and response["clem_player"]["model_name"] == "tiny-0"
    assert text == policy.generate(MESSAGES[:1])[0].text
    single = policy.generate_response(MESSAGES[1])
    assert single[2] == results[1][2]
    assert policy.generate([]) == []
    policy.reset()
    assert policy.stats["calls"] >= 3 and policy.stats.new_tokens > 0


def test_adapter_changes_outputs_and_name(tiny_cfg, tmp_path):
    from peft import LoraConfig, get_peft_model

    tokenizer, model = load_tokenizer_and_model(tiny_cfg, for_training=True)
    assert model.training
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "in_proj_qkv"],
                                            init_lora_weights=False))
    adapter_dir = tmp_path / "sft"
    lora.save_pretrained(str(adapter_dir))
    base = PolicyModel(tiny_cfg, max_new_tokens=12)
    tuned = PolicyModel(dataclasses.replace(tiny_cfg, adapter=str(adapter_dir)), max_new_tokens=12)
    assert tuned.name == "tiny-0+sft" and tuned.name != base.name
    assert not tuned.model.training
    prompt = base.tokenizer(base.render(MESSAGES[0]), return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        assert not torch.allclose(base.model(**prompt).logits, tuned.model(**prompt).logits)
    assert [g.raw_text for g in base.generate(MESSAGES)] != [g.raw_text for g in tuned.generate(MESSAGES)]
    with pytest.raises(FileNotFoundError):
        load_tokenizer_and_model(dataclasses.replace(tiny_cfg, adapter=str(tmp_path / "missing")))


def test_nf4_quantization_loads_on_cpu(tiny_cfg):
    pytest.importorskip("bitsandbytes")

    import bitsandbytes as bnb
    quantized = PolicyModel(dataclasses.replace(tiny_cfg, quantization="nf4"), max_new_tokens=6)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in quantized.model.modules())
    generations = quantized.generate(MESSAGES[:2], temperature=0.0)
    assert all(g.error is None and g.new_tokens >= 1 for g in generations)


def test_seq_cls_loader(tiny_cfg):
    tokenizer, model = load_tokenizer_and_model(tiny_cfg, task="seq-cls")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.text_config.pad_token_id == tokenizer.pad_token_id
    texts = [tokenizer.apply_chat_template(m + [{"role": "assistant", "content": "GUESS: 5"}], tokenize=False)
             for m in MESSAGES[:3]]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        logits = model(**batch).logits
    assert logits.shape == (3, 1)
    with torch.inference_mode():  # padding does not change a row's score
        alone = model(**tokenizer(texts[:1], return_tensors="pt", add_special_tokens=False)).logits
    assert torch.allclose(logits[0], alone[0], atol=1e-5)
    with pytest.raises(ValueError, match="task"):
        load_tokenizer_and_model(tiny_cfg, task="reward")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama (plain attention: the prefix-sharing path) as a local model folder."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer, _ = build_tiny_model(0)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               sequence_bias=[[[tokenizer.eos_token_id], 3.0]])
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def test_shared_prefix_prefill_is_exact(tiny_llama_dir, test_cache_dir):
    llama = PolicyModel(ModelConfig(spec=tiny_llama_dir, threads=1, cache_dir=test_cache_dir), max_new_tokens=16)
    assert llama.name == Path(tiny_llama_dir).name
    system = {"role": "system", "content": "You play a guessing game. Answer with GUESS: and a number from 1 to 10."}
    perspectives = [[system] + m for m in MESSAGES if m[0]["role"] != "system"]
    from clemprm.models import decode_attention
    fast_calls = decode_attention.FAST_ATTENTION_CALLS
    shapes = []
    forward = llama.decoder._forward
    llama.decoder._forward = lambda ids, *a, **k: shapes.append(tuple(ids.shape)) or forward(ids, *a, **k)
    try:
        ours = our_ids(llama, perspectives, SamplingParams(0.0, max_new_tokens=16))
    finally:
        llama.decoder._forward = forward
    assert shapes[0][0] == 1 and shapes[0][1] >= 20 and shapes[1][0] == len(perspectives)  # prefix once
    one_token_calls = sum(1 for shape in shapes if shape[1] == 1)  # decode steps (and a 1-token generation prompt)
    assert decode_attention.FAST_ATTENTION_CALLS - fast_calls == 2 * one_token_calls  # every one, both layers
    assert llama.model.config._attn_implementation == "sdpa"  # restored after generating
    assert ours == hf_greedy(llama, perspectives, 16)
    kwargs = dict(temperature=1.0, top_p=0.9, max_new_tokens=12)
    batched = [g.raw_text for g in llama.generate(perspectives, seeds=[5, 6, 7, 8, 9], **kwargs)]
    alone = [llama.generate([m], seeds=[s], **kwargs)[0].raw_text for m, s in zip(perspectives, [5, 6, 7, 8, 9])]
    assert batched == alone


FEEDBACK = ["Too low.", "No, that is not it. Think again about the numbers that are left and try once more.",
            "Try again.", "Wrong: the answer is a word, not a number. Reply with one word from the list above."]


def play_three_turns(policy, conversations, shapes):
    """Greedy answers of three turns, each turn's messages the last ones plus the answer and a feedback of
    another length per conversation; records the shapes of the forward passes."""
    forward = policy.decoder._forward
    policy.decoder._forward = lambda ids, *a, **k: shapes.append(tuple(ids.shape)) or forward(ids, *a, **k)
    answers = []
    try:
        for turn in range(3):
            texts = [g.raw_text for g in policy.generate(conversations, temperature=0.0, max_new_tokens=8)]
            answers.append(texts)
            conversations = [c + [{"role": "assistant", "content": text or "..."},
                                  {"role": "user", "content": FEEDBACK[(i + turn) % len(FEEDBACK)]}]
                             for i, (c, text) in enumerate(zip(conversations, texts))]
    finally:
        policy.decoder._forward = forward
    return answers


@pytest.mark.parametrize("which", ["tiny", "llama"])
def test_prefix_store_continues_conversations_exactly(which, tiny_cfg, tiny_llama_dir, test_cache_dir):
    """Later turns prefill only their new tokens after the stored state of the conversation so far (rows left
    padded in the middle: exact for attention and, via gated_delta, for Qwen3.5's Gated-DeltaNet layers), and
    answer exactly as a full prefill does."""
    cfg = tiny_cfg if which == "tiny" else ModelConfig(spec=tiny_llama_dir, threads=1, cache_dir=test_cache_dir)
    stored = PolicyModel(cfg)
    plain = PolicyModel(dataclasses.replace(cfg, prefix_cache_mb=0), tokenizer=stored.tokenizer, model=stored.model)
    assert stored.decoder.generation_prompt and plain.decoder.prefix_store is None
    conversations = [m for m in MESSAGES if m[-1]["role"] == "user"] + [MESSAGES[0]]  # the last one: a duplicate
    stored_shapes, plain_shapes = [], []
    assert play_three_turns(stored, conversations, stored_shapes) == play_three_turns(plain, conversations,
                                                                                       plain_shapes)
    store = stored.decoder.prefix_store
    assert store.hits >= 2 * (len(conversations) - 1) and store.nbytes > 0
    prefill_widths = lambda shapes: [width for _, width in shapes if width > 1]  # noqa: E731
    assert sum(prefill_widths(stored_shapes)) < sum(prefill_widths(plain_shapes))

    # the logits themselves, for rows continuing with new tokens of different lengths
    def prompts(messages):
        return [tuple(stored.tokenizer(stored.render(m), add_special_tokens=False)["input_ids"]) for m in messages]
    store.clear()
    with torch.inference_mode():
        stored.decoder._prefill(prompts(conversations[:-1]), 0)
        later = [c + [{"role": "assistant", "content": "GUESS: 5"}, {"role": "user", "content": FEEDBACK[i % 4]}]
                 for i, c in enumerate(conversations[:-1])]
        hits = store.hits
        continued = stored.decoder._prefill(prompts(later), 0)[1]
        assert store.hits - hits == len(later)
        torch.testing.assert_close(continued, plain.decoder._prefill(prompts(later), 0)[1], atol=1e-4, rtol=1e-4)
        # one call mixing a continued, a stored and a new conversation: three passes joined into one cache
        mixed = prompts([later[0] + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "Higher."}],
                         conversations[1], [{"role": "user", "content": "Something else entirely."}]])
        joined = stored.decoder._prefill(mixed, 4)
        torch.testing.assert_close(joined[1], plain.decoder._prefill(mixed, 4)[1], atol=1e-4, rtol=1e-4)
    # ... and decoding from a joined cache
    mixed = prompts([later[1] + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "Lower."}],
                     conversations[2], [{"role": "user", "content": "Yet another game."}]])
    params = SamplingParams(0.0, max_new_tokens=6)
    hits = store.hits
    assert stored.decoder.generate(mixed, params, [0, 1, 2]) == plain.decoder.generate(mixed, params, [0, 1, 2])
    assert store.hits - hits == 2


def test_prefix_store_keeps_the_longest_prefix_within_budget():
    state = lambda n: RowState(n, [(torch.zeros(n), torch.zeros(n))])  # noqa: E731  8n bytes
    store = PrefixStore(max_bytes=8 * 25)
    store.put([1, 2, 3], state(3))
    store.put([1, 2, 3, 4, 5], state(5))
    assert store.longest([1, 2, 3, 4, 5, 6], limit=6).length == 5
    assert store.longest([1, 2, 3, 4, 5, 6], limit=4).length == 3
    assert store.longest([9, 2, 3], limit=3) is None and (store.hits, store.misses) == (2, 1)
    store.longest([1, 2, 3], limit=3)                    # [1, 2, 3] is now the most recently used
    store.put([7] * 20, state(20))                       # 28 + 20 > 25: the least recently used goes
    assert store.nbytes == 8 * 23 and store.longest([1, 2, 3, 4, 5], limit=5).length == 3
    store.put([8] * 30, state(30))                       # larger than the whole budget: not kept
    assert store.longest([8] * 30, limit=30) is None
    store.clear()
    assert store.nbytes == 0 and store.longest([1, 2, 3], limit=3) is None


MALLINFO_PROGRAM = """
import ctypes, sys, torch
from clemprm.models.loader import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
tensor = torch.empty(1 << 21)  # 8 MB
print(libc.mallinfo2().hblkhd - before)
"""


def _glibc_has_mallinfo2() -> bool:
    import ctypes
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_keep_freed_memory_serves_large_tensors_from_the_heap():
    """By default glibc maps an 8 MB tensor by itself (and unmaps it when freed, so the next one is faulted in
    page by page); with freed memory kept it comes from the heap, which keeps freed blocks for reuse."""
    import subprocess
    import sys

    def mapped_bytes(mode):
        run = subprocess.run([sys.executable, "-c", MALLINFO_PROGRAM, mode], capture_output=True, text=True,
                             check=True)
        return int(run.stdout.strip())

    assert mapped_bytes("default") >= 8 << 20
    assert mapped_bytes("keep") == 0


def test_decoder_requires_an_end_token(policy):
    with pytest.raises(ValueError, match="end-of-turn"):
        Decoder(policy.model, eos_token_ids=[], pad_token_id=0)


def test_generation_dataclass_defaults():
    generation = Generation(text="a", raw_text="a", prompt_tokens=3, new_tokens=1)
    assert generation.error is None and generation.finish_reason == "stop"


# ------------------------------------------------------------------------------------------ SmolLM2


@pytest.mark.slow
def test_embedded_smollm2_converts_once_and_answers(smollm2, caplog):
    cfg, folder = smollm2   # converted from the wheel's GGUF in this session's fresh cache
    marker = folder / ".clemprm-complete.json"
    assert json.loads(marker.read_text())["source"].endswith(".gguf")
    before = marker.stat()
    with caplog.at_level("INFO", logger="clemprm.models.embedded"):
        assert Path(resolve_model_dir(cfg)) == folder   # a second load reuses the conversion
        policy = PolicyModel(cfg, max_new_tokens=12)
    assert "converting embedded model" not in caplog.text
    assert (marker.stat().st_ino, marker.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.tmp")] == []
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (folder / "model.safetensors").is_file()
    assert policy.name == "smollm2-135m-instruct"
    assert policy.tokenizer.pad_token == "<|endoftext|>" and policy.tokenizer.eos_token == "<|im_end|>"
    perspectives = [[{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                    [{"role": "user", "content": "Say hello."}]]
    generations = policy.generate(perspectives, temperature=0.0)
    assert all(g.error is None and g.text for g in generations)
    assert "paris" in generations[0].text.lower()
    assert our_ids(policy, perspectives, SamplingParams(0.0, max_new_tokens=12)) == hf_greedy(policy, perspectives, 12)


@pytest.mark.parametrize("keep", [0.5, 0.0005], ids=["cut-in-the-data", "cut-in-the-header"])
def test_a_truncated_adapter_file_is_named(tiny_cfg, tmp_path, keep):
    import re

    from peft import LoraConfig, get_peft_model

    from clemprm.models.loader import WeightsFileError

    _, model = load_tokenizer_and_model(tiny_cfg)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "adapter"))
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:max(1, int(len(data) * keep))])
    with pytest.raises(WeightsFileError, match=re.escape(f"adapter {tmp_path / 'adapter'}: cannot read {weights}: ")):
        load_tokenizer_and_model(dataclasses.replace(tiny_cfg, adapter=str(tmp_path / "adapter")))
