"""The CPU Gated-DeltaNet kernel against transformers' reference: outputs, final states, gradients, a whole model."""

from __future__ import annotations

import math

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5  # noqa: E402

from clemprm.models import gated_delta  # noqa: E402
from clemprm.models.loader import ModelConfig, load_tokenizer_and_model  # noqa: E402

gated_delta.install()
REFERENCE = qwen3_5.torch_chunk_gated_delta_rule.clemprm_reference
CONV_REFERENCE = qwen3_5.causal_conv1d_fn.clemprm_reference
CONV_STEP_REFERENCE = qwen3_5.causal_conv1d_update.clemprm_reference


def inputs(batch, length, k_heads=2, v_heads=4, dim=16, decay_scale=1.0, seed=0, requires_grad=False):
    """Random layer inputs; ``decay_scale`` sets how fast the state decays (log decay per token down to -scale)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(
        query=torch.randn(batch, length, k_heads, dim, generator=gen),
        key=torch.randn(batch, length, k_heads, dim, generator=gen),
        value=torch.randn(batch, length, v_heads, dim, generator=gen),
        g=-decay_scale * torch.rand(batch, length, v_heads, generator=gen),
        beta=torch.rand(batch, length, v_heads, generator=gen))
    if requires_grad:
        for tensor in tensors.values():
            tensor.requires_grad_(True)
    return tensors


@pytest.mark.parametrize("batch,length,decay_scale,chunk_size", [
    (1, 5, 1.0, None),       # shorter than a chunk
    (2, 70, 1.0, None),      # padded last chunk (8 rows)
    (17, 100, 1.0, None),    # 68 rows: small chunks
    (2, 130, 8.0, None),     # strong decay: exponents far below the clamp
    (3, 64, 0.01, 64),       # almost no decay, transformers' chunk size
])
def test_matches_reference(batch, length, decay_scale, chunk_size):
    x = inputs(batch, length, decay_scale=decay_scale)
    state = torch.randn(batch, 4, 16, 16, generator=torch.Generator().manual_seed(1)) * 0.1
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected_out, expected_state = REFERENCE(**x, **kwargs)
    out, final = gated_delta.chunk_gated_delta_rule(**x, chunk_size=chunk_size, **kwargs)
    assert out.shape == expected_out.shape and out.dtype == expected_out.dtype
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, expected_state, atol=2e-5, rtol=1e-4)


def subnormal_count(tensor: torch.Tensor) -> int:
    return int(((tensor != 0) & (tensor.abs() < torch.finfo(tensor.dtype).tiny)).sum())


def test_strong_decays_never_give_subnormal_floats():
    """Subnormal operands make x86 matmuls about 10x slower: the decays are clamped before they get there."""
    log_decays = torch.linspace(-200.0, 0.0, 4001)
    assert subnormal_count(log_decays.exp()) > 0          # what an unclamped exp gives
    assert subnormal_count(gated_delta.decay(log_decays)) == 0
    x = inputs(4, 96, decay_scale=30.0)
    out, final = gated_delta.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert subnormal_count(out) == 0 and subnormal_count(final) == 0


def test_no_final_state_unless_asked():
    out, final = gated_delta.chunk_gated_delta_rule(**inputs(1, 10))
    assert final is None and out.shape == (1, 10, 4, 16)


def test_gradients_match_reference():
    x_ref, x_new = inputs(2, 40, requires_grad=True), inputs(2, 40, requires_grad=True)
    REFERENCE(**x_ref, use_qk_l2norm_in_kernel=True)[0].square().sum().backward()
    gated_delta.chunk_gated_delta_rule(**x_new, use_qk_l2norm_in_kernel=True)[0].square().sum().backward()
    for name in x_ref:
        torch.testing.assert_close(x_new[name].grad, x_ref[name].grad, atol=1e-4, rtol=1e-3, msg=name)


def test_leading_pads_of_a_continuation_leave_the_state_alone():
    x = inputs(3, 50, decay_scale=2.0)
    x["query"][1, :6], x["key"][2, :37], x["value"][1, :6] = math.nan, math.inf, math.nan  # pads reach nothing
    state = torch.randn(3, 4, 16, 16, generator=torch.Generator().manual_seed(1)) * 0.1
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    with gated_delta.continuing_with_leading_pads(torch.tensor([0, 6, 37]), 50):  # 37: past the first chunk
        out, final = gated_delta._continued_kernel(**x, initial_state=state, **kwargs)
    for row, pads in ((0, 0), (1, 6), (2, 37)):  # each row as its real tokens alone
        alone = {name: value[row:row + 1, pads:] for name, value in x.items()}
        expected_out, expected_state = REFERENCE(**alone, initial_state=state[row:row + 1], **kwargs)
        torch.testing.assert_close(out[row:row + 1, pads:], expected_out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final[row:row + 1], expected_state, atol=2e-5, rtol=1e-4)


def test_a_padded_continuation_convolves_each_rows_cached_inputs_with_its_own_tokens():
    gen = torch.Generator().manual_seed(2)
    cached, new, pads = 4, 9, torch.tensor([0, 3, 6])
    hidden = torch.randn(3, 8, cached + new, generator=gen)  # [batch, channels, cached inputs + new tokens]
    weight, bias = torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen)
    with gated_delta.continuing_with_leading_pads(pads, new):
        out = gated_delta._continued_conv(hidden, weight, bias, activation="silu")
    for row, row_pads in enumerate(pads.tolist()):
        alone = torch.cat([hidden[row:row + 1, :, :cached], hidden[row:row + 1, :, cached + row_pads:]], dim=-1)
        expected = CONV_REFERENCE(alone, weight, bias, activation="silu")[..., cached:]
        torch.testing.assert_close(out[row:row + 1, :, cached + row_pads:], expected, atol=1e-6, rtol=1e-5)


def test_capture_takes_the_state_before_the_last_tokens():
    x = inputs(2, 40)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    with gated_delta.capturing_states_before_last(7) as captured:
        out, final = gated_delta._continued_kernel(**x, **kwargs)
    expected_out, expected_final = REFERENCE(**x, **kwargs)
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, expected_final, atol=2e-5, rtol=1e-4)
    _, expected_head = REFERENCE(**{name: value[:, :33] for name, value in x.items()}, **kwargs)
    torch.testing.assert_close(captured.recurrent[0], expected_head, atol=2e-5, rtol=1e-4)
    conv_input = torch.randn(2, 8, 40)  # the convolution records the 4 inputs before the last 7
    with gated_delta.capturing_states_before_last(7) as captured:
        gated_delta._continued_conv(conv_input, torch.randn(8, 4))
    torch.testing.assert_close(captured.conv[0], conv_input[..., 29:33])


@pytest.mark.parametrize("state_at", [0, 1, 16, 25, 40])
def test_state_at_any_position_in_one_call(state_at):
    """The state after the first ``state_at`` tokens: at a chunk boundary (16 here) or not, at the ends too."""
    x = inputs(2, 40)
    initial = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2)) * 0.1
    kwargs = dict(initial_state=initial, use_qk_l2norm_in_kernel=True)
    out, final, there = gated_delta.chunk_gated_delta_rule_with_state_at(**x, state_at=state_at, chunk_size=16,
                                                                          **kwargs)
    expected_out, expected_final = REFERENCE(**x, output_final_state=True, **kwargs)
    torch.testing.assert_close(out, expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, expected_final, atol=2e-5, rtol=1e-4)
    expected_there = initial if state_at == 0 else REFERENCE(**{name: value[:, :state_at] for name, value in x.items()},
                                                             output_final_state=True, **kwargs)[1]
    torch.testing.assert_close(there, expected_there, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_step_matches_reference(with_bias):
    gen = torch.Generator().manual_seed(3)
    hidden, state, weight = torch.randn(5, 8, 1, generator=gen), torch.randn(5, 8, 4, generator=gen), torch.randn(8, 4)
    bias = torch.randn(8, generator=gen) if with_bias else None
    expected_state = state.clone()
    expected = CONV_STEP_REFERENCE(hidden, expected_state, weight, bias, "silu")
    out = qwen3_5.causal_conv1d_update(hidden, state, weight, bias, "silu")
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, expected_state)  # the window moved on by the new input


@pytest.mark.parametrize("length", [1, 3, 4, 37])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("time_major", [False, True])
def test_causal_conv_matches_reference(length, with_bias, time_major):
    """Shorter and longer than the kernel, with and without bias, on a [batch, channels, time] tensor and on the
    transposed [batch, time, channels] one the layer passes (whose layout the result keeps)."""
    gen = torch.Generator().manual_seed(4)
    hidden = (torch.randn(3, length, 8, generator=gen).transpose(1, 2) if time_major
              else torch.randn(3, 8, length, generator=gen))
    weight = torch.randn(8, 4, generator=gen)
    bias = torch.randn(8, generator=gen) if with_bias else None
    out = qwen3_5.causal_conv1d_fn(hidden, weight, bias, activation="silu")
    torch.testing.assert_close(out, CONV_REFERENCE(hidden, weight, bias, activation="silu"), atol=1e-6, rtol=1e-5)
    assert out.transpose(1, 2).is_contiguous() == time_major or length == 1


def test_causal_conv_gradients_match_reference():
    gen = torch.Generator().manual_seed(5)
    hidden, weight, bias = torch.randn(2, 8, 9, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(8)
    grads = []
    for conv in (qwen3_5.causal_conv1d_fn, CONV_REFERENCE):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        conv(*leaves, activation="silu").square().sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for ours, reference in zip(*grads):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


def test_chunk_size_rule():
    assert gated_delta.chunk_size_for(rows=4, head_dim=16) == gated_delta.CHUNK
    assert gated_delta.chunk_size_for(rows=128, head_dim=16) == gated_delta.SMALL_CHUNK
    assert gated_delta.chunk_size_for(rows=128, head_dim=128) == gated_delta.CHUNK


def test_install_is_idempotent_and_keeps_packed_sequences_on_the_reference():
    gated_delta.install()
    assert qwen3_5.torch_chunk_gated_delta_rule.clemprm_reference is REFERENCE
    with pytest.raises(ValueError, match="packed sequences"):  # the reference's own error, not a silent result
        qwen3_5.torch_chunk_gated_delta_rule(**inputs(1, 8), cu_seqlens=torch.tensor([0, 4, 8]))


def test_the_loader_installs_it_and_tiny_model_logits_match_reference(test_cache_dir, monkeypatch):
    monkeypatch.setattr(qwen3_5, "torch_chunk_gated_delta_rule", REFERENCE)
    _, model = load_tokenizer_and_model(ModelConfig(spec="tiny:0", threads=1, cache_dir=test_cache_dir))
    assert qwen3_5.torch_chunk_gated_delta_rule.clemprm_reference is REFERENCE
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (12, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = model(input_ids=ids).logits
        monkeypatch.setattr(qwen3_5, "torch_chunk_gated_delta_rule", REFERENCE)
        slow = model(input_ids=ids).logits
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
