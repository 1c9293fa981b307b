"""The policy adapter RL trains: the base with the SFT adapter (or a fresh LoRA, ``rl.lora``) as the trainable
policy adapter ``default``, for PRIME also its implicit PRM and the PRM's frozen reference; the adapter's
parameters, their optimizer and learning-rate schedule.

Start: ``rl.lora`` null trains the SFT adapter further; a ``{r, alpha, dropout, target_modules}`` section trains a
fresh LoRA on the base instead (the Hanabi card: rank 32, alpha 32, with ``lm_head`` among the targets, which
TRL's SFTTrainer refuses but this trainer trains; the merge stage then unties lm_head from the embeddings).

Devices: as SFT. CUDA: the base as the loader gives it (``quantization: auto`` = 4-bit NF4, bf16 compute), paged
8-bit AdamW; CPU: fp32, ``torch.optim.AdamW``.
"""

from __future__ import annotations

import torch

from clemprm.rl.prime import PRM_ADAPTER, REFERENCE_ADAPTER
from clemprm.training import OPTIMIZER_AUTO

POLICY_ADAPTER = "default"


def load_training_model(model_settings: dict, sft_adapter: str | None, cache_dir: str | None, *, implicit_prm: bool,
                        lora: dict | None = None):
    """``(model config, tokenizer, PEFT model)``: the base with the SFT adapter as the trainable policy adapter
    (``default``) and, for PRIME, the SFT adapter twice more: the implicit PRM (trainable) and its frozen reference.
    With ``lora`` (``rl.lora``) every one of them is a fresh LoRA of that shape on the base instead (B = 0: each
    starts equal to the base, so the PRM equals its reference)."""
    from clemprm.models.loader import ModelConfig, load_extra_adapter, load_tokenizer_and_model
    from clemprm.training import device_name, keep_4bit_differentiable

    if lora is None and sft_adapter is None:
        raise ValueError("rl: no SFT adapter to start from and no rl.lora for a fresh one")
    adapter = None if lora is not None else str(sft_adapter)
    cfg = ModelConfig.from_dict({**model_settings, "adapter": adapter, "cache_dir": cache_dir})
    tokenizer, model = load_tokenizer_and_model(cfg, for_training=True, task="causal-lm")
    if device_name() == "cpu":
        keep_4bit_differentiable(model)
    if lora is not None:
        model = fresh_lora(model, lora, [PRM_ADAPTER, REFERENCE_ADAPTER] if implicit_prm else [])
    elif implicit_prm:
        load_extra_adapter(model, str(sft_adapter), PRM_ADAPTER, trainable=True)
        load_extra_adapter(model, str(sft_adapter), REFERENCE_ADAPTER, trainable=False)
    if implicit_prm:
        model.set_adapter(POLICY_ADAPTER)
        for name, param in model.named_parameters():  # set_adapter froze all but the active adapter
            if f".{PRM_ADAPTER}." in name:
                param.requires_grad_(True)
        without_lora_dropout(model, PRM_ADAPTER)
    for param in model.parameters():   # LoRA weights train in fp32 (as SFT keeps them on CPU)
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return cfg, tokenizer, model


def fresh_lora(model, lora: dict, extra_adapters: list[str]):
    """A new LoRA (``rl.lora``) on ``model`` as the policy adapter (``default``), plus ``extra_adapters`` of the
    same shape (PRIME: the PRM and its reference)."""
    import warnings

    from peft import get_peft_model

    from clemprm.training import lora_config

    with warnings.catch_warnings():   # PEFT's warning on a LoRA of a tied lm_head: the merge stage unties it
        warnings.filterwarnings("ignore", message=".*tied.*")
        model = get_peft_model(model, lora_config(lora, "CAUSAL_LM"))
        for name in extra_adapters:
            model.add_adapter(name, lora_config(lora, "CAUSAL_LM"))
    model.set_adapter(POLICY_ADAPTER)
    return model


def without_lora_dropout(model, adapter: str) -> None:
    """No LoRA dropout on ``adapter``. For the implicit PRM: its log-ratio to the (dropout-free, frozen) reference
    is a reward, so dropout would make it noise; at step 0, when the PRM still equals its reference, the process
    advantages must be exactly 0."""
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict) and adapter in dropouts:
            dropouts[adapter] = torch.nn.Identity()


def adapter_parameters(model, adapter: str) -> list[torch.nn.Parameter]:
    marker = f".{adapter}."
    return [param for name, param in model.named_parameters() if marker in name and param.requires_grad]


def make_optimizer(params: list, rl: dict, lr: float, device: str):
    """AdamW over ``params``: ``rl.optimizer`` auto = paged 8-bit AdamW on CUDA (bitsandbytes), torch's on CPU;
    betas ``rl.adam_betas``."""
    name = rl["optimizer"] if rl["optimizer"] != "auto" else OPTIMIZER_AUTO[device]
    betas = tuple(rl["adam_betas"])
    if name == "paged_adamw_8bit":
        import bitsandbytes as bnb
        return bnb.optim.PagedAdamW8bit(params, lr=lr, betas=betas, weight_decay=rl["weight_decay"])
    if name == "adamw_torch":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=rl["weight_decay"])
    raise ValueError(f"rl.optimizer: unknown optimizer {name!r} (auto, adamw_torch, paged_adamw_8bit)")


def make_scheduler(optimizer, rl: dict):
    """Linear warmup over ``warmup_ratio`` of the steps, then cosine down to ``min_lr_rate`` x lr (the card's)."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=int(rl["warmup_ratio"] * rl["steps"]), num_training_steps=rl["steps"],
        min_lr_rate=rl["min_lr_rate"])
