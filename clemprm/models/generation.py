"""The policy as a clemcore model: :class:`PolicyModel`, batched and seeded generation from chat messages.

It renders each message list with the chat template (:func:`clemprm.play.chat.render_prompt`), tokenises it, hands
the token ids to a decoder (:class:`clemprm.models.decoder.Decoder`, or with ``model.backend: vllm`` the server's,
:mod:`clemprm.models.vllm_backend`) and turns the new tokens into a :class:`~clemprm.play.contract.Generation`:
thinking stripped (:func:`strip_thinking`), and an error per item (a template that rejects the messages, a prompt
over ``model.max_context_tokens``) instead of a failed batch. :func:`load_policy` builds it from a config's ``model``
section.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from clemprm.models.decoder import Decoder
from clemprm.models.loader import (AUTO_CONTEXT, ModelConfig, load_tokenizer_and_generation_config,
                                   load_tokenizer_and_model, with_context_length)
from clemprm.models.sampling import SamplingParams, sequence_bias_of, unsupported_generation_settings
from clemprm.models.scoring import Counters
from clemprm.play.chat import end_token_ids, render_prompt
from clemprm.play.clemcore_setup import import_clemcore_backends
from clemprm.play.contract import Generation

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 50          # HF generate's default when the generation config sets none


# ------------------------------------------------------------------------------------------ results


@dataclass
class GenerationStats(Counters):
    """Running counters of a :class:`PolicyModel`."""

    calls: int = 0
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    errors: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_thinking(text: str, *, inside_think: bool = False) -> str:
    """Drop ``<think>...</think>`` blocks and a dangling unclosed ``<think>...``, then ``.strip()``.

    ``inside_think``: the prompt ended inside an open ``<think>`` (Qwen3.5 with thinking on), so the answer
    starts with reasoning: everything up to the first ``</think>`` goes too (all of it if none comes)."""
    if inside_think:
        text = "<think>" + text
    text = _THINK_BLOCK.sub("", text)
    start = text.find("<think>")
    if start >= 0:
        text = text[:start]
    return text.replace("</think>", "").strip()


def prompt_opens_think(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block."""
    return prompt.rfind("<think>") > prompt.rfind("</think>")


# ------------------------------------------------------------------------------------ the clemcore model


import_clemcore_backends()
import clemcore.backends as _backends  # noqa: E402
from clemcore.backends.model_registry import ModelSpec  # noqa: E402
from clemcore.backends.utils import augment_response_object  # noqa: E402


class PolicyModel(_backends.BatchGenerativeModel):
    """The policy LM as a clemcore model: batched, seeded generation with per-item errors.

    ``name`` (clemcore groups batches by it) defaults to the spec's short name plus the adapter folder name,
    e.g. ``smollm2-135m-instruct`` or ``smollm2-135m-instruct+sft``: give two adapters of one base two names.
    ``top_k`` None means what HF generate does: the model's ``generation_config.top_k``, else 50; 0 = off.
    """

    def __init__(self, cfg: ModelConfig, *, name: str | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, top_k: int | None = None, tokenizer=None, model=None):
        super().__init__(ModelSpec(model_name=name or cfg.short_name, model_id=cfg.spec, backend="clemprm",
                                   adapter=cfg.adapter))
        if cfg.backend == "vllm" and tokenizer is None:   # the server holds the weights: the tokenizer alone here
            tokenizer, generation_config = load_tokenizer_and_generation_config(cfg)
        else:
            if model is None or tokenizer is None:
                tokenizer, model = load_tokenizer_and_model(cfg, for_training=False, task="causal-lm")
            generation_config = getattr(model, "generation_config", None)
        self.tokenizer, self.model = tokenizer, model
        self.context_is_auto = cfg.max_context_tokens == AUTO_CONTEXT
        self.cfg = with_context_length(cfg, tokenizer)   # model.max_context_tokens a number
        self.temperature_default = float(temperature)
        self.top_p_default = float(top_p)
        self.max_new_tokens_default = int(max_new_tokens)
        self.top_k_default = int(top_k if top_k is not None else
                                 (getattr(generation_config, "top_k", None) or DEFAULT_TOP_K))
        self.set_gen_args(temperature=self.temperature_default, max_tokens=self.max_new_tokens_default,
                          top_p=self.top_p_default, top_k=self.top_k_default)
        ignored = unsupported_generation_settings(generation_config) if generation_config is not None else {}
        if ignored:
            log.warning("%s: generation config settings not applied by clemprm's decoder: %s", self.name, ignored)
        eos_ids = end_token_ids(tokenizer, generation_config)
        if cfg.backend == "vllm":
            from clemprm.models.vllm_backend import vllm_decoder

            self.decoder = vllm_decoder(self.cfg, eos_ids, sequence_bias=sequence_bias_of(generation_config),
                                        tokenizer=tokenizer)
        else:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
            self.decoder = Decoder(model, eos_token_ids=eos_ids, pad_token_id=pad,
                                   sequence_bias=sequence_bias_of(generation_config),
                                   generation_prompt=self._generation_prompt_ids(),
                                   prefix_store_bytes=cfg.prefix_cache_mb << 20)
        self.stats = GenerationStats()

    # clemcore's Model reads these through gen_args
    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def reset(self):
        pass

    def _generation_prompt_ids(self) -> list[int]:
        """The tokens the chat template appends to open the assistant's turn ([] when the template does not
        simply append them, e.g. it rewrites earlier turns)."""
        probe = [{"role": "user", "content": "Hello."}]
        try:
            opened = self.render(probe)
            conversation = self.tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False,
                                                              **self.cfg.chat_template_kwargs)
        except Exception:  # a template that cannot render the probe: no reuse
            return []
        if not opened.startswith(conversation) or opened == conversation:
            return []
        opened_ids, conversation_ids = self.tokenizer([opened, conversation], add_special_tokens=False)["input_ids"]
        if opened_ids[:len(conversation_ids)] != conversation_ids:
            return []
        return opened_ids[len(conversation_ids):]

    def render(self, messages: list[dict]) -> str:
        """The prompt text (:func:`clemprm.play.chat.render_prompt`)."""
        return render_prompt(self.tokenizer, messages, self.cfg.chat_template_kwargs)

    def generate(self, perspectives: list[list[dict]], *, seeds: list[int] | None = None,
                 temperature: float | None = None, top_p: float | None = None, max_new_tokens: int | None = None,
                 top_k: int | None = None) -> list[Generation]:
        """One :class:`Generation` per message list, in order. ``seeds[i]`` fixes row i's sample (default: i)."""
        return self._generate(perspectives, seeds=seeds, temperature=temperature, top_p=top_p,
                              max_new_tokens=max_new_tokens, top_k=top_k)[0]

    def _generate(self, perspectives, *, seeds=None, temperature=None, top_p=None, max_new_tokens=None,
                  top_k=None) -> tuple[list[Generation], dict[int, str]]:
        start = time.perf_counter()
        n = len(perspectives)
        if seeds is None:
            seeds = list(range(n))
        if len(seeds) != n:
            raise ValueError(f"got {len(seeds)} seeds for {n} prompts")
        params = SamplingParams(
            temperature=float(self.temperature_default if temperature is None else temperature),
            top_p=float(self.top_p_default if top_p is None else top_p),
            top_k=int(self.top_k_default if top_k is None else top_k),
            max_new_tokens=int(self.max_new_tokens_default if max_new_tokens is None else max_new_tokens))
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")

        out: list[Generation | None] = [None] * n
        prompts, texts, todo = {}, {}, []
        encoded = self._encode(perspectives)
        for i, text_ids in enumerate(encoded):
            if isinstance(text_ids, Exception):  # e.g. a template that rejects the messages
                out[i] = Generation("", "", 0, 0, error=f"{type(text_ids).__name__}: {text_ids}", finish_reason="error")
                continue
            text, ids = text_ids
            if len(ids) > self.cfg.max_context_tokens:
                out[i] = Generation("", "", len(ids), 0, finish_reason="error",
                                    error=context_too_long(len(ids), self.cfg.max_context_tokens, self.context_is_auto))
            elif not ids:
                out[i] = Generation("", "", 0, 0, error="empty prompt", finish_reason="error")
            else:
                prompts[i], texts[i] = ids, text
                todo.append(i)

        if todo:
            decoded = self.decoder.generate([prompts[i] for i in todo], params, [seeds[i] for i in todo],
                                            token_budget=self.cfg.token_budget)
            # (new ids, finish reason), and with the vllm backend the sampled tokens' log-probs
            for i, (new_ids, reason, *logprobs) in zip(todo, decoded):
                if new_ids is None:   # a request the vLLM server refused: ``reason`` says why
                    out[i] = Generation("", "", len(prompts[i]), 0, error=reason, finish_reason="error")
                    continue
                raw = self.tokenizer.decode(new_ids, skip_special_tokens=True)
                out[i] = Generation(text=strip_thinking(raw, inside_think=prompt_opens_think(texts[i])),
                                    raw_text=raw, prompt_tokens=len(prompts[i]), new_tokens=len(new_ids),
                                    finish_reason=reason, prompt_ids=prompts[i], token_ids=new_ids,
                                    logprobs=logprobs[0] if logprobs else None)
        self.stats.calls += 1
        self.stats.prompts += n
        self.stats.prompt_tokens += sum(len(p) for p in prompts.values())
        self.stats.new_tokens += sum(g.new_tokens for g in out)
        self.stats.errors += sum(g.error is not None for g in out)
        self.stats.seconds += time.perf_counter() - start
        return out, texts

    def _encode(self, perspectives: list[list[dict]]) -> list:
        """``(prompt text, token ids)`` per message list, or the exception its rendering raised. Identical message
        lists (N candidates of one turn, K forks of one state) are rendered once; all are tokenised in one call."""
        keys = [tuple((m["role"], m["content"]) for m in messages) for messages in perspectives]
        rendered: dict[tuple, object] = {}
        for key, messages in zip(keys, perspectives):
            if key not in rendered:
                try:
                    rendered[key] = self.render(messages)
                except Exception as error:
                    rendered[key] = error
        texts = [(key, text) for key, text in rendered.items() if isinstance(text, str)]
        ids = self._tokenize([text for _, text in texts]) if texts else []
        by_key = {key: (text, row_ids) for (key, text), row_ids in zip(texts, ids)}
        return [by_key.get(key, rendered[key]) for key in keys]

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of ``texts`` (no special tokens added): a fast tokenizer's Rust ``encode_batch_fast`` (ids
        only, no offsets: ~30% faster than the tokenizer's ``__call__``, the same ids), else ``__call__``. The
        backend keeps the padding and truncation of the last ``__call__`` that asked for them (e.g. a user's
        ``tokenizer(texts, padding=True)``); then ``__call__`` is used, which resets them."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if (hasattr(backend, "encode_batch_fast") and getattr(backend, "padding", None) is None
                and getattr(backend, "truncation", None) is None):
            return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    @augment_response_object
    def generate_batch_response(self, batch_messages: list[list[dict]]) -> list[tuple[Any, Any, str]]:
        """clemcore's batch interface: ``(prompt object, response object, text)`` per item; an item error raises."""
        generations, texts = self._generate(batch_messages)
        results = []
        for i, generation in enumerate(generations):
            if generation.error:
                raise RuntimeError(f"{self.name}: {generation.error}")
            prompt = {"inputs": texts[i], "max_new_tokens": self.max_new_tokens_default,
                      "temperature": self.temperature_default, "top_p": self.top_p_default}
            response = {"response": generation.raw_text, "prompt_tokens": generation.prompt_tokens,
                        "new_tokens": generation.new_tokens, "finish_reason": generation.finish_reason}
            results.append((prompt, response, generation.text))
        return results

    def generate_response(self, messages: list[dict]) -> tuple[Any, Any, str]:
        return self.generate_batch_response([messages])[0]


def context_too_long(prompt_tokens: int, limit: int, auto: bool) -> str:
    """The error of a prompt over ``model.max_context_tokens``: the key that set the limit, and what it can be."""
    own = "auto: the model's own context length"
    return (f"context too long: {prompt_tokens} > {limit} tokens (model.max_context_tokens; "
            f"{own if auto else 'raise it, or set it to ' + own})")


def load_policy(model_settings: dict, cache_dir: str | None = None) -> PolicyModel:
    """The policy of a config's ``model`` section as a clemcore model, through the one model loader."""
    return PolicyModel(ModelConfig.from_dict({**model_settings, "cache_dir": cache_dir}))
