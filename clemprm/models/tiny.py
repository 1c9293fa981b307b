"""A tiny random Qwen3.5 checkpoint built in code: the model of the ``tiny:<seed>`` specs (tests, quick start).

The composite ``qwen3_5`` layout of the real checkpoints (3 Gated-DeltaNet layers + 1 full-attention layer, a tiny
vision tower), a byte-level BPE tokenizer trained deterministically on a built-in corpus, the real Qwen3.5 special
tokens and chat template. Same seed, same weights on every machine (:func:`build_tiny_model`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Bump when the way a cached folder is built changes: old folders are then simply not used any more.
TINY_VERSION = 1

# Real Qwen3/Qwen3.5 added tokens: (content, special). <think> & co are added but not special, as in Qwen.
QWEN_ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
TINY_VOCAB_SIZE = 1024          # byte-level BPE: 256 bytes + merges + the added tokens above
TINY_EOS_BIAS = 3.5             # sequence_bias on <|im_end|> so random models end their turns (see build_tiny_model)
TINY_LOGIT_SCALE = 8.0          # lm_head init scale: peaky (LM-like) next-token distributions

_TINY_CORPUS = """\
Let us play a game. I am thinking of a number from 1 to 10. You have four guesses.
After each guess I tell you whether my number is higher or lower than your guess.
Answer with GUESS: followed by a number, for example GUESS: 5. Your guess is too low. The number is higher.
Your guess is too high. The number is lower. Well done, you found the number! You lost, the number was 7.
Which of the following words is described here? Options: apple, river, chair. The word names a fruit.
ANSWER: apple. Which word does not belong with the others? Options: red, blue, green, table. ANSWER: table.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
The sun rises in the east and sets in the west. Water boils at one hundred degrees. Cats like to sleep.
I think the answer is three. Let me think step by step. First, second, third, fourth, fifth, last.
one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 50 100
Yes. No. Maybe. Please. Thank you. Sorry, I do not know. Hello! How are you? I am fine, thanks.
The player wins when the guess is correct. The game ends after the last turn. Try again next time.
You are a helpful assistant. Describe the picture: a small house with a red roof next to a tall tree.
The teacher asked the students to write a short story about their favourite animal and its home.
Morning, afternoon, evening, night. Spring, summer, autumn, winter. North, south, east, west.
"""


def tiny_chat_template() -> str:
    """The real Qwen3.5 chat template, as shipped by the installed trl package."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the tiny model needs the trl package (for the Qwen3.5 chat template)")
    path = Path(list(spec.submodule_search_locations)[0]) / "chat_templates" / "qwen3_5_think.jinja"
    return path.read_text()


def build_tiny_tokenizer():
    """A deterministic byte-level BPE (``tokenizers``) with the Qwen3.5 added tokens and chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    # the same pipeline as transformers' Qwen3_5Tokenizer (which AutoTokenizer uses for a qwen3_5 folder)
    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE - len(QWEN_ADDED_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TINY_CORPUS.splitlines() * 4, trainer=trainer)
    # as in Qwen, the added tokens follow the BPE vocabulary, in this order
    for content, special in QWEN_ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None,
        chat_template=tiny_chat_template(), model_max_length=4096, padding_side="right",
        clean_up_tokenization_spaces=False)


def build_tiny_model(seed: int, out: str | os.PathLike | None = None, *, tie_word_embeddings: bool = False):
    """A tiny random Qwen3.5 (composite ``qwen3_5`` config) and its tokenizer; saved to ``out`` if given.

    Layers: 3 linear-attention (Gated DeltaNet) + 1 full-attention, hidden 64, about 0.3M text parameters.
    Weights come from ``torch.manual_seed(seed)`` on CPU in fp32, so a seed gives the same model everywhere.
    A random model almost never ends its turn, so ``generation_config.sequence_bias`` adds ``TINY_EOS_BIAS``
    to ``<|im_end|>`` (HF ``generate`` and :class:`clemprm.models.generation.PolicyModel` both apply it): most
    sampled answers end within about 20 tokens.
    Returns ``(tokenizer, model)`` (the model is a ``Qwen3_5ForConditionalGeneration``; ``AutoModelForCausalLM``
    loads the text part as ``Qwen3_5ForCausalLM``, as for the real checkpoints).
    ``tie_word_embeddings``: ``lm_head`` shares the input embedding (as SmolLM2's does; tests of tied merges). The
    ``tiny:<seed>`` specs stay untied.
    """
    import torch
    from transformers import GenerationConfig, Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    tokenizer = build_tiny_tokenizer()
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096, tie_word_embeddings=tie_word_embeddings, eos_token_id=eos, pad_token_id=pad,
        bos_token_id=None, rms_norm_eps=1e-6)
    vision_config = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                         patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text_config, vision_config=vision_config,
                           tie_word_embeddings=tie_word_embeddings)
    config.pad_token_id = pad
    config.eos_token_id = eos
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
        with torch.no_grad():  # LM-like (peaky) next-token distributions instead of almost-uniform ones
            model.lm_head.weight.mul_(TINY_LOGIT_SCALE)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
                                               sequence_bias=[[[eos], TINY_EOS_BIAS]])
    model.config.name_or_path = f"tiny:{seed}"
    if out is not None:
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    return tokenizer, model


def build_tiny_folder(seed: int, out: Path) -> dict:
    build_tiny_model(seed, out)
    return {"spec": f"tiny:{seed}", "version": TINY_VERSION}
