"""The Triton GPTQ linear against formats.gptq.dequantize (GPTQModel's reading, checked bit for bit there).

Two kinds of checks: a one-hot input makes the kernel return its dequantized weight exactly (bit-exact
against ``dequantize(..., float16)``), and random inputs are compared with a float32 matmul on the
dequantized weight. Cases cover sym/asym, GPTQ v1/v2 (including the v1 word borrow of a true zero 0),
act-order, group sizes -1/32/128, bias, partial N tiles and more tokens than one M tile.
"""

from __future__ import annotations

import pytest
import torch

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqLinear, GptqScheme, dequantize, read_zero_points, write_zero_points
from repack.runtime.kernels.gptq_linear import GptqW4A16Linear, gptq_linear, is_trivial_g_idx
from repack.synthetic_linear import random_linear

K, N = 256, 96  # N = 96: the second 64-wide N tile is partial


def make_linear(
    scheme: GptqScheme, act_order: bool, bias: bool, seed: int, *, zero_some_zeros: bool = False
) -> GptqLinear:
    """A random GPTQ linear; ``zero_some_zeros`` forces true zero points of 0 (the v1 word-borrow case)."""
    gen = torch.Generator().manual_seed(seed)
    linear = random_linear(K, N, scheme, act_order=act_order, generator=gen)
    if zero_some_zeros:
        zeros = read_zero_points(linear.qzeros, scheme)
        zeros[:, ::3] = 0
        linear.qzeros = write_zero_points(zeros, scheme)
    if bias:
        linear.bias = (torch.randn(N, generator=gen) * 0.05).to(torch.float16)
    return linear


def on(linear: GptqLinear, device: str) -> GptqLinear:
    tensors = (linear.qweight, linear.qzeros, linear.scales, linear.g_idx, linear.bias)
    return GptqLinear(*(None if t is None else t.to(device) for t in tensors))


CASES = [
    # (group, sym, checkpoint_format, act_order, bias)
    (128, True, "gptq", False, False),
    (128, False, "gptq", False, True),
    (32, True, "gptq_v2", False, True),
    (32, False, "gptq_v2", True, False),
    (-1, True, "gptq", False, False),
    (-1, False, "gptq", False, True),
    (128, True, "gptq", True, True),
    (32, False, "gptq", True, False),
    (128, False, "gptq_v2", False, False),
]


@pytest.mark.parametrize(("group", "sym", "fmt", "act_order", "bias"), CASES)
def test_one_hot_input_returns_the_dequantized_weight_bit_exact(group, sym, fmt, act_order, bias, device):
    scheme = GptqScheme(bits=4, group_size=group, sym=sym, checkpoint_format=fmt)
    linear = make_linear(scheme, act_order, bias=False, seed=group + 7 * sym, zero_some_zeros=not sym)
    expected = dequantize(linear, scheme, torch.float16)  # [N, K]
    eye = torch.eye(K, dtype=torch.float16, device=device)
    module = GptqW4A16Linear(on(linear, device), scheme, name="case")
    assert module.act_order == act_order
    got = module(eye).cpu()  # row k = W[:, k]
    assert torch.equal(got, expected.t().contiguous())


@pytest.mark.parametrize(("group", "sym", "fmt", "act_order", "bias"), CASES)
@pytest.mark.parametrize("tokens", [3, 70])
def test_random_inputs_match_a_float32_reference(group, sym, fmt, act_order, bias, tokens, device):
    scheme = GptqScheme(bits=4, group_size=group, sym=sym, checkpoint_format=fmt)
    linear = make_linear(scheme, act_order, bias, seed=100 + tokens + group, zero_some_zeros=not sym)
    x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(tokens)).to(torch.float16)
    reference = x.float() @ dequantize(linear, scheme, torch.float32).t()
    if bias:
        reference += linear.bias.float()
    got = gptq_linear(x.to(device), on(linear, device), scheme, gather_groups=act_order).cpu().float()
    assert got.shape == (tokens, N)
    error = (got - reference).abs().max() / reference.abs().max()
    assert error <= 2e-3, f"relative error {error:.2e}"


def test_gather_path_equals_fast_path_on_trivial_g_idx(device):
    """With a trivial g_idx both paths read the same groups (K tiles differ, so fp32 sums agree to rounding)."""
    scheme = GptqScheme(group_size=32, sym=False)
    linear = on(make_linear(scheme, act_order=False, bias=True, seed=5), device)
    assert is_trivial_g_idx(linear.g_idx, K, scheme)
    x = torch.randn(2, 5, K, generator=torch.Generator().manual_seed(9)).to(torch.float16).to(device)
    fast = gptq_linear(x, linear, scheme, gather_groups=False)
    gathered = gptq_linear(x, linear, scheme, gather_groups=True)
    assert fast.shape == (2, 5, N)
    torch.testing.assert_close(fast, gathered, rtol=0, atol=1e-3)


def test_act_order_is_detected_from_g_idx():
    scheme = GptqScheme(group_size=32)
    assert not is_trivial_g_idx(make_linear(scheme, act_order=True, bias=False, seed=1).g_idx, K, scheme)
    assert is_trivial_g_idx(None, K, scheme)


def test_wrong_input_width_is_one_line_error(device):
    scheme = GptqScheme()
    module = GptqW4A16Linear(on(make_linear(scheme, False, False, seed=2), device), scheme, name="layers.0.q_proj")
    with pytest.raises(RepackError) as error:
        module(torch.zeros(3, K + 8, dtype=torch.float16, device=device))
    assert "layers.0.q_proj" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(RepackError, match="float16"):
        module(torch.zeros(3, K, dtype=torch.float32, device=device))


def test_bad_tensor_shapes_are_refused():
    scheme = GptqScheme()
    linear = make_linear(scheme, False, False, seed=3)
    linear.scales = linear.scales[:1]
    with pytest.raises(ValueError, match="scales"):
        GptqW4A16Linear(linear, scheme, name="bad")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton interpreter cannot run bf16; GPU only")
def test_bf16_matches_reference_on_gpu():
    scheme = GptqScheme(group_size=128, sym=False)
    linear = make_linear(scheme, act_order=True, bias=True, seed=11)
    x = torch.randn(33, K, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    reference = x.float() @ dequantize(linear, scheme, torch.float32).t() + linear.bias.float()
    got = gptq_linear(x.cuda(), on(linear, "cuda"), scheme).cpu().float()
    assert (got - reference).abs().max() / reference.abs().max() <= 1e-2
