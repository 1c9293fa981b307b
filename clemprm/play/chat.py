"""Chat messages as the model sees them: the one prompt renderer, for playing, training and scoring alike.

What a model saw at play time is the player's perspective as a clemcore backend sends it (consecutive same-role
messages joined, an empty leading system message dropped), rendered by the tokenizer's chat template with the
generation prompt. SFT trains on exactly that prompt and the PRM reads it with the answer (and the game's reply to
it) appended, so every stage renders through the functions here. ``template_kwargs`` are the
``model.chat_template_kwargs`` of the config (e.g. ``enable_thinking``).
"""

from __future__ import annotations

from clemprm.play.clemcore_setup import import_clemcore_backends


def merge_roles(messages: list[dict]) -> list[dict]:
    """Messages as a clemcore backend sends them to its model (``ensure_alternating_roles``: consecutive same-role
    messages joined, an empty leading system message dropped), as plain ``{"role", "content"}`` dicts. A list that
    is already in that form (every prompt the engine renders was merged when its turn began) is only copied:
    clemcore's function deep-copies the whole conversation, ~20 us per prompt."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    empty_system_first = bool(plain) and plain[0]["role"] == "system" and not plain[0]["content"]
    if empty_system_first or any(a["role"] == b["role"] for a, b in zip(plain, plain[1:])):
        import_clemcore_backends()
        from clemcore.backends.utils import ensure_alternating_roles

        plain = ensure_alternating_roles(plain)
    return plain


def normalise(messages: list[dict]) -> list[dict]:
    """Messages as a clemcore backend sends them: roles merged, an empty system message dropped, content as text."""
    return merge_roles([{"role": str(m["role"]), "content": str(m["content"] or "")} for m in messages])


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> str:
    """THE prompt text of a turn: the normalised messages, chat template with the generation prompt."""
    return tokenizer.apply_chat_template(normalise(messages), add_generation_prompt=True, tokenize=False,
                                         **(template_kwargs or {}))


def render_answered(tokenizer, messages: list[dict], answer: str, template_kwargs: dict | None = None,
                    reply: str = "") -> str:
    """The conversation with ``answer`` as the assistant's turn and the game's ``reply`` to it (when given) as the
    user's next message, no generation prompt: what the PRM reads."""
    conversation = list(messages) + [{"role": "assistant", "content": answer}]
    conversation = normalise(conversation + ([{"role": "user", "content": reply}] if reply else []))
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=False,
                                         **(template_kwargs or {}))


def end_token_ids(tokenizer, generation_config=None) -> list[int]:
    """The tokens that end an answer: the tokenizer's end token, then the generation config's (deduplicated)."""
    configured = getattr(generation_config, "eos_token_id", None)
    configured = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids = []
    for token in [tokenizer.eos_token_id] + configured:
        if token is not None and int(token) not in ids:
            ids.append(int(token))
    return ids


def end_of_turn_text(tokenizer, template_kwargs: dict | None = None, eos_token_ids=()) -> str:
    """What the template writes after an answer, up to and including the end token (e.g. ``<|im_end|>``): what
    SFT teaches the model to write after its answer."""
    sentinel = "\u2063SENTINEL\u2063"
    eos_texts = [tokenizer.convert_ids_to_tokens(int(i)) for i in eos_token_ids if i is not None]
    eos_texts += [tokenizer.eos_token] if tokenizer.eos_token else []
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}], tokenize=False,
            **(template_kwargs or {}))
        after = text[text.index(sentinel) + len(sentinel):]
    except Exception:  # no template / a template that rejects this: fall back to the eos token
        after = ""
    ends = [(after.find(eos), eos) for eos in eos_texts if eos and eos in after]
    if ends:
        position, eos = min(ends)
        return after[:position + len(eos)]
    if not eos_texts:
        raise ValueError("the tokenizer has no end-of-turn token: cannot teach the model to end its answer")
    return eos_texts[0]
