"""A faster CPU prefill kernel for the Gated-DeltaNet layers of Qwen3.5 / Qwen3-Next models.

Without flash-linear-attention (a CUDA library), transformers runs these layers' prefill through its reference
``torch_chunk_gated_delta_rule``. On CPU that reference spends most of its time in one ``exp``: the pairwise
decays ``exp(cum_i - cum_j)`` of each 64-token chunk, with ``-inf`` above the diagonal and, for strongly decaying
heads, arguments far below -87 whose results underflow. Both take the slow path of the vectorised exp
(measured on a 2-core Xeon: 0.8 ms for 2.4M arguments in [-50, 0], 4.4 ms with the ``-inf`` half, 27 ms in
[-200, 0]), and the denormal products that follow slow the multiplications down as well.

:func:`chunk_gated_delta_rule` computes the same function: the exponents of every decay are clamped to [-60, 0]
(:func:`decay`; a decay below e^-60 ~ 1e-26 is zero at fp32 precision next to the within-chunk terms, and clamped
decays never produce the subnormal floats that slowed the state reads down tenfold) and the upper triangle is zeroed
after the exp, each chunk's unit-triangular system is inverted by one triangular solve (the reference inverts it
by a loop) and applied by matmuls, every tensor is laid out chunk-major from the start (the scan reads one
contiguous block per chunk, with fused 3-d matmuls and no concatenated copies), and chunks are shorter (32 tokens, 16
for many rows of small heads), which cuts the elementwise work per token. It matches the reference to ~1e-6
(tests/test_gated_delta.py) and made the tiny test model's batched prefill about 1.6x faster
(clemprm.bench.engine). :func:`install` routes CPU calls of the Qwen modules to it; CUDA calls and packed
sequences keep transformers' path (flash-linear-attention when installed).

:func:`continuing_with_leading_pads` lets one forward pass continue cached rows with new tokens of different
lengths (the decoder's prefix store, :mod:`clemprm.models.decoder`): it makes the padding between a row's cached
state and its new tokens a no-op for the kernel and the causal convolution before it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm  # the reference kernel's (FLA's) normalisation

# transformers modules whose Gated-DeltaNet layers call a module-level torch_chunk_gated_delta_rule
PATCHED_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
                   "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                   "transformers.models.qwen3_next.modeling_qwen3_next")
MIN_LOG_DECAY = -60.0   # exp(-60) ~ 1e-26: below fp32 resolution next to the O(1) within-chunk terms
CHUNK = 32              # transformers uses 64; 32 measured faster here for every shape tried (see chunk_size_for)
SMALL_CHUNK = 16        # for batches of >= SMALL_CHUNK_ROWS rows (batch x value heads) of heads <= 32 wide
SMALL_CHUNK_ROWS = 64


def chunk_size_for(rows: int, head_dim: int) -> int:
    """Chunk length: short chunks cut the per-token elementwise work (it grows with the chunk length) but add
    sequential steps (one per chunk). Measured on 2 cores (ms, chunks 16/32/64, transformers' reference): 4
    heads of 16, batch 1 x 1000 tokens 5.2/3.8/5.8 (ref 10.2), batch 36 x 206 12.6/18.6/41.5 (ref 55.2);
    16 heads of 128, batch 4 x 300 93/89/208 (ref 309)."""
    return SMALL_CHUNK if rows >= SMALL_CHUNK_ROWS and head_dim <= 32 else CHUNK


def decay(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp`` of log decays clamped to [MIN_LOG_DECAY, 0]: never a subnormal float. x86 arithmetic on subnormals
    is an order of magnitude slower; without the clamp, the state reads of strongly decaying heads (decays from the
    chunk start far below e^-87) took 270 us per batched matmul instead of 15 (tiny model, batch 36)."""
    return log_decay.clamp(MIN_LOG_DECAY, 0.0).exp()


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int | None = None, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """Same arguments and results as transformers' ``torch_chunk_gated_delta_rule`` ([batch, seq, heads, dim]
    inputs; returns the output and, if asked, the final recurrent state [batch, v_heads, k_dim, v_dim])."""
    out, final, _ = chunk_gated_delta_rule_with_state_at(query, key, value, g, beta, None, chunk_size=chunk_size,
                                                         initial_state=initial_state,
                                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, (final if output_final_state else None)


def chunk_gated_delta_rule_with_state_at(query, key, value, g, beta, state_at: int | None, chunk_size=None,
                                         initial_state=None, use_qk_l2norm_in_kernel: bool = False):
    """:func:`chunk_gated_delta_rule` that also returns the recurrent state after the first ``state_at`` tokens
    (None: not asked): (output, final state, that state). Within its chunk, that state is the chunk's state update
    restricted to the chunk's first tokens (one more small matmul), so no second call is needed."""
    out_dtype = query.dtype
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    chunk = chunk_size or chunk_size_for(batch * v_heads, max(k_dim, v_dim))
    pad = -length % chunk  # zero padding at the end: beta = 0 and g = 0 leave the state as is
    n_chunks = (length + pad) // chunk
    state_chunk, state_offset = divmod(state_at, chunk) if state_at is not None else (None, 0)

    def chunk_major(x):  # [batch, time, heads(, dim)] -> contiguous fp32 [chunks, batch, heads, chunk(, dim)]
        x = F.pad(x.to(torch.float32), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(batch, n_chunks, chunk, *x.shape[2:]).transpose(0, 1).transpose(2, 3).contiguous()

    # every tensor chunk-major from here on: the scan reads one contiguous block per chunk, with no copies
    query, key, value, beta, g = (chunk_major(x) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query = query * k_dim ** -0.5
    if k_heads != v_heads:  # grouped value heads: each query/key head serves consecutive value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    beta = beta.unsqueeze(-1)
    cum = g.cumsum(-1)   # log decay from the chunk start to position t

    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).triu(1)
    pair_decay = decay(cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, 0.0)
    k_beta = key * beta
    start_decay = decay(cum).unsqueeze(-1)
    ut_system = (k_beta @ key.transpose(-1, -2)) * pair_decay
    intra_attn = (query @ key.transpose(-1, -2)) * pair_decay
    # the system's inverse, then two matmuls: solving for [values | decayed keys] at once needed their
    # concatenation, and reading the state once per chunk that of [key reads; query reads], copies that made the
    # kernel ~15% slower at batch 36 (and no faster at batch 1)
    eye = torch.eye(chunk, dtype=torch.float32, device=query.device)
    inverse = torch.linalg.solve_triangular(ut_system, eye, upper=False, unitriangular=True)

    # the sequential scan over chunks, batch and heads flattened (3-d matmuls)
    rows = batch * v_heads
    new_values = (inverse @ (value * beta)).reshape(n_chunks, rows, chunk, v_dim)
    key_reads = (inverse @ (k_beta * start_decay)).reshape(n_chunks, rows, chunk, k_dim)
    query_reads = (query * start_decay).reshape(n_chunks, rows, chunk, k_dim)
    intra_attn = intra_attn.reshape(n_chunks, rows, chunk, chunk)
    keys_t = (key * decay(cum[..., -1:] - cum).unsqueeze(-1)).transpose(-1, -2).reshape(n_chunks, rows, k_dim, chunk)
    chunk_decay = decay(cum[..., -1]).reshape(n_chunks, rows, 1, 1)
    state = (torch.zeros(rows, k_dim, v_dim, dtype=torch.float32, device=query.device) if initial_state is None
             else initial_state.to(torch.float32).reshape(rows, k_dim, v_dim))
    outputs, state_there = [], None
    for i in range(n_chunks):
        v_new = new_values[i] - torch.bmm(key_reads[i], state)
        if i == state_chunk:
            state_there = state if not state_offset else _state_within(state, key[i], cum[i], v_new, state_offset)
        outputs.append(torch.baddbmm(torch.bmm(query_reads[i], state), intra_attn[i], v_new))
        state = torch.baddbmm(state * chunk_decay[i], keys_t[i], v_new)
    if state_chunk == n_chunks:
        state_there = state
    out = torch.stack(outputs).reshape(n_chunks, batch, v_heads, chunk, v_dim)
    out = out.permute(1, 0, 3, 2, 4).reshape(batch, -1, v_heads, v_dim)[:, :length]
    out = out.to(out_dtype, memory_format=torch.contiguous_format)
    state = state.reshape(batch, v_heads, k_dim, v_dim)
    if state_there is not None:
        state_there = state_there.reshape(batch, v_heads, k_dim, v_dim)
    return out, state, state_there


def _state_within(state, key, cum, v_new, offset: int):
    """The state after the first ``offset`` tokens of a chunk: its state update restricted to them. ``state``
    [rows, k, v] at the chunk start; ``key`` [batch, heads, chunk, k], ``cum`` [batch, heads, chunk] the chunk's
    keys and cumulative log decays; ``v_new`` [rows, chunk, v] its corrected values."""
    rows = state.shape[0]
    last = cum[..., offset - 1:offset]
    keys = (key[..., :offset, :] * decay(last - cum[..., :offset]).unsqueeze(-1)).reshape(rows, offset, -1)
    return torch.baddbmm(state * decay(last).reshape(rows, 1, 1), keys.transpose(-1, -2), v_new[:, :offset])


# ------------------------------------------------------------------ continuing rows that are padded in the middle

# (pads per row, new tokens per row) of the continuation in progress
_LEADING_PADS: contextvars.ContextVar[tuple[torch.Tensor, int] | None] = contextvars.ContextVar("leading_pads",
                                                                                                default=None)


@contextlib.contextmanager
def continuing_with_leading_pads(leading_pads: torch.Tensor, width: int):
    """Within the block, a forward pass that continues cached Gated-DeltaNet states with ``width`` new tokens per
    row, left padded (``leading_pads[b]`` pads, then row b's tokens), computes exactly what each row's tokens alone
    would.

    Padding at the start of a fresh sequence is harmless, but between a cached state and new tokens it is not:
    the pads would decay and write the recurrent state, and the causal convolution of the first real tokens would
    see pads instead of the cached inputs. So, for the block: the pads' decay, write strength, keys and values are
    zeroed in the kernel (the state passes them unchanged), and the convolution sees each row's cached inputs moved to
    just before its first real token. A row with pads must bring at least ``conv kernel - 1`` tokens (else the
    convolution state saved for the next step would hold pads)."""
    token = _LEADING_PADS.set((leading_pads, width))
    try:
        yield
    finally:
        _LEADING_PADS.reset(token)


class CapturedStates:
    """Per Gated-DeltaNet layer, in call order: the conv states ``[batch, channels, kernel]`` and recurrent states
    ``[batch, heads, k_dim, v_dim]`` of a forward pass, taken before its last ``last`` tokens."""

    def __init__(self, last: int):
        self.last = last
        self.conv: list[torch.Tensor] = []
        self.recurrent: list[torch.Tensor] = []


_CAPTURE: contextvars.ContextVar[CapturedStates | None] = contextvars.ContextVar("capture", default=None)


@contextlib.contextmanager
def capturing_states_before_last(last: int):
    """Within the block, CPU Gated-DeltaNet layers also record their states as they were before the last ``last``
    tokens of each row (taken within the same kernel call), so that one forward pass gives both the state
    at the end of a conversation and, after the generation prompt, the state to decode from."""
    captured = CapturedStates(last)
    token = _CAPTURE.set(captured)
    try:
        yield captured
    finally:
        _CAPTURE.reset(token)


def _pad_positions(batch: int, length: int, device) -> torch.Tensor | None:
    """``[batch, length]`` True at the leading pads of the current continuation (None outside one)."""
    context = _LEADING_PADS.get()
    if context is None:
        return None
    pads, width = context
    if pads.shape[0] != batch or width != length:
        raise ValueError(f"a continuation of {pads.shape[0]} rows x {width} tokens, the layer got {batch} x {length}")
    return torch.arange(length, device=device).unsqueeze(0) < pads.to(device).unsqueeze(1)


def _continued_kernel(query, key, value, g, beta, chunk_size=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """:func:`chunk_gated_delta_rule` with the continuation's pads made no-ops: no decay (g = 0), no write
    (beta = 0), and zero keys and values. A token that writes nothing corrects nothing in the tokens after it (its
    rows of the chunk's triangular system are zero); zeroing its key and value too keeps even a non-finite pad
    from reaching them (0 x nan). The pads' queries only shape the pads' own outputs, which are never used."""
    padded = _pad_positions(query.shape[0], query.shape[1], query.device)
    if padded is not None:
        key, value = (torch.where(padded[:, :, None, None], 0.0, x) for x in (key, value))
        g, beta = (torch.where(padded[:, :, None], 0.0, x) for x in (g, beta))
    capture = _CAPTURE.get()
    state_at = query.shape[1] - capture.last if capture is not None and capture.last else None
    out, final, state = chunk_gated_delta_rule_with_state_at(
        query, key, value, g, beta, state_at, chunk_size, initial_state=initial_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if state_at is not None:
        capture.recurrent.append(state)
    return out, (final if output_final_state else None)


def _continued_conv(hidden_states, weight, *args, **kwargs):
    """The causal convolution ([batch, channels, cached inputs + new]) by :func:`_causal_conv`; in a continuation
    each row's cached inputs are first copied to just before its first real token (what is left before them only
    reaches the pads' own outputs)."""
    continuation = _LEADING_PADS.get()
    if continuation is not None:
        pads, new = continuation
        cached = hidden_states.shape[-1] - new                 # the cache keeps the last `kernel` inputs
        before_first = pads.to(hidden_states.device).unsqueeze(1) + torch.arange(cached, device=hidden_states.device)
        hidden_states = hidden_states.clone().scatter_(
            2, before_first.unsqueeze(1).expand(-1, hidden_states.shape[1], -1), hidden_states[..., :cached])
    capture = _CAPTURE.get()
    if capture is not None and capture.last:  # the inputs the cache would keep, before the last tokens
        kernel, end = weight.shape[-1], hidden_states.shape[-1] - capture.last
        kept = hidden_states[..., max(0, end - kernel):end]
        capture.conv.append(F.pad(kept, (kernel - kept.shape[-1], 0)))
    return _causal_conv(hidden_states, weight, *args, **kwargs)


def _causal_conv(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_fn`` (depthwise, left padded by ``kernel - 1``) as shifted multiply-adds:
    ~4x faster than oneDNN's depthwise ``F.conv1d`` on CPU at batch 36 x 116 tokens x 128 channels, and the result
    keeps the input's memory layout (the layer's [batch, time, channels] view stays contiguous after its transpose)."""
    inputs = hidden_states.to(weight.dtype)
    length, kernel = inputs.shape[-1], weight.shape[-1]
    out = inputs * weight[:, kernel - 1:kernel]
    for shift in range(1, min(kernel, length)):
        out[..., shift:].addcmul_(inputs[..., :length - shift], weight[:, kernel - 1 - shift:kernel - shift])
    return _conv_output(out, bias, activation, hidden_states.dtype)


def _conv_output(out, bias, activation, dtype):
    """The convolution's bias and activation on its weighted sums ``out`` [batch, channels, time], in ``dtype``."""
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(dtype)


def _conv_step(reference):
    """transformers' ``causal_conv1d_update`` for one-token decode steps as a multiply and a sum over the kernel
    window: its depthwise ``F.conv1d`` cost ~130 us per call at batch 64 on CPU, mostly oneDNN set-up."""
    def step(hidden_states, conv_state, weight, bias=None, activation=None):
        if hidden_states.shape[-1] != 1 or conv_state.shape[-1] != weight.shape[-1]:
            return reference(hidden_states, conv_state, weight, bias, activation)
        conv_state.copy_(torch.cat([conv_state[..., 1:], hidden_states.to(conv_state.dtype)], dim=-1))
        out = (conv_state.to(weight.dtype) * weight).sum(-1, keepdim=True)
        return _conv_output(out, bias, activation, hidden_states.dtype)
    return step


def _dispatching(reference, cpu_function):
    @functools.wraps(reference)
    def dispatch(*args, **kwargs):
        first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        if first.device.type != "cpu" or kwargs.get("cu_seqlens") is not None:
            return reference(*args, **kwargs)
        return cpu_function(*args, **kwargs)
    dispatch.clemprm_reference = reference
    return dispatch


def install() -> None:
    """Route the CPU calls of the Qwen Gated-DeltaNet modules' prefill kernel to :func:`chunk_gated_delta_rule`,
    their causal convolution through :func:`_continued_conv` and its decode step to :func:`_conv_step`
    (idempotent; modules that are not installed or have no such function are skipped)."""
    for name in PATCHED_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        kernel = getattr(module, "torch_chunk_gated_delta_rule", None)
        if kernel is not None and not hasattr(kernel, "clemprm_reference"):
            module.torch_chunk_gated_delta_rule = _dispatching(kernel, _continued_kernel)
        conv = getattr(module, "causal_conv1d_fn", None)
        if conv is not None and not hasattr(conv, "clemprm_reference"):
            module.causal_conv1d_fn = _dispatching(conv, _continued_conv)
        conv_step = getattr(module, "causal_conv1d_update", None)
        if conv_step is not None and not hasattr(conv_step, "clemprm_reference"):
            module.causal_conv1d_update = _dispatching(conv_step, _conv_step(conv_step))
