"""The GPTQ reader against GPTQModel's own dequantized weights, bit for bit, and its conventions."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from repack.formats.gptq import (
    GptqFormatError,
    GptqLinear,
    GptqScheme,
    check_linear,
    check_zero_points,
    dequantize,
    pack_along_rows,
    read_zero_points,
    unpack_along_rows,
    write_zero_points,
)
from tests.support.fixtures import FIXTURES


def _scheme(path) -> GptqScheme:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    return GptqScheme(qc["bits"], qc["group_size"], qc["sym"], qc["checkpoint_format"])


def _linear(handle, module: str) -> GptqLinear:
    return GptqLinear(*(handle.get_tensor(f"{module}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")))


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_dequantize_matches_gptqmodel_bit_for_bit(fixture):
    scheme = _scheme(fixture)
    model = safe_open(fixture / "model.safetensors", "pt")
    reference = safe_open(fixture / "reference.safetensors", "pt")
    checked = 0
    for key in reference.keys():
        if not key.startswith("dequant."):
            continue
        _, precision, rest = key.split(".", 2)
        module = rest.removesuffix(".weight")
        linear = _linear(model, module)
        check_linear(module, linear, scheme)
        check_zero_points(module, linear, scheme)
        dtype = torch.float16 if precision == "fp16" else torch.float32
        ours = dequantize(linear, scheme, dtype)
        theirs = reference.get_tensor(key)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        int_view = torch.int16 if dtype == torch.float16 else torch.int32
        assert torch.equal(ours.view(int_view), theirs.view(int_view)), key
        checked += 1
    assert checked >= 8


def test_actorder_fixture_has_nontrivial_g_idx():
    fixture = next(p for p in FIXTURES if "actorder" in p.name)
    model = safe_open(fixture / "model.safetensors", "pt")
    g_idx = model.get_tensor("model.layers.0.mlp.experts.0.gate_proj.g_idx")
    assert not torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=torch.int32) // 32)
    assert torch.bincount(g_idx).tolist() == [32] * (g_idx.numel() // 32)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_unpack_rows_inverse_and_bit_order(bits):
    pack = 32 // bits
    q = torch.randint(0, 1 << bits, (pack * 6, 10), dtype=torch.uint8)
    words = pack_along_rows(q, bits)
    assert words.shape == (6, 10) and words.dtype == torch.int32
    # Element k = pack*r + s sits in bits bits*s .. of word r.
    r, s, n = 2, pack - 1, 3
    assert ((int(words[r, n]) & 0xFFFFFFFF) >> (bits * s)) & ((1 << bits) - 1) == int(q[pack * r + s, n])
    assert torch.equal(unpack_along_rows(words, bits), q)


def test_v1_zero_points_follow_gptqmodel_word_arithmetic():
    """A true zero of 0 borrows across nibbles when GPTQModel subtracts 0x11111111; reading adds it back."""
    scheme = GptqScheme(bits=4, group_size=128, sym=False, checkpoint_format="gptq")
    zeros = torch.tensor([[0, 5, 0, 15, 1, 0, 7, 8]], dtype=torch.uint8)
    stored = write_zero_points(zeros, scheme)
    true_word = sum(int(z) << (4 * i) for i, z in enumerate(zeros[0]))
    assert int(stored[0, 0]) & 0xFFFFFFFF == (true_word - 0x11111111) & 0xFFFFFFFF
    assert torch.equal(read_zero_points(stored, scheme), zeros)
    # AutoGPTQ's per-nibble +1 would read this word differently: the borrow is visible in the data.
    per_nibble = [((int(stored[0, 0]) & 0xFFFFFFFF) >> (4 * i) & 0xF) + 1 for i in range(8)]
    assert [v & 0xF for v in per_nibble] != zeros[0].tolist()


def test_v2_zero_points_are_stored_as_is():
    scheme = GptqScheme(bits=4, group_size=128, sym=False, checkpoint_format="gptq_v2")
    zeros = torch.randint(0, 16, (3, 16), dtype=torch.uint8)
    stored = write_zero_points(zeros, scheme)
    assert torch.equal(unpack_along_rows(stored.t(), 4).t(), zeros)
    assert torch.equal(read_zero_points(stored, scheme), zeros)


def test_zeros_contradicting_config_are_refused():
    fixture = FIXTURES[0]
    model = safe_open(fixture / "model.safetensors", "pt")
    linear = _linear(model, "model.layers.0.mlp.experts.0.gate_proj")
    v2 = GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq_v2")
    with pytest.raises(GptqFormatError, match=r"qzeros.*gptq_v2.*reads 7"):
        check_zero_points("model.layers.0.mlp.experts.0.gate_proj", linear, v2)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda lin: setattr(lin, "scales", lin.scales[:, :-8]), r"scales: expected float16 \[2, 384\]"),
        (lambda lin: setattr(lin, "qzeros", lin.qzeros.float()), r"qzeros: expected int32"),
        (lambda lin: setattr(lin, "g_idx", lin.g_idx[:-1]), r"g_idx: expected 256 entries"),
        (lambda lin: setattr(lin, "g_idx", lin.g_idx + 5), r"g_idx: group ids must lie in \[0, 2\)"),
        (lambda lin: setattr(lin, "qweight", lin.qweight.to(torch.int64)), r"qweight: expected a 2-D int32"),
    ],
)
def test_misshapen_linears_are_named(mutate, message):
    fixture = FIXTURES[0]
    model = safe_open(fixture / "model.safetensors", "pt")
    linear = _linear(model, "model.layers.0.mlp.experts.0.gate_proj")
    mutate(linear)
    with pytest.raises(GptqFormatError, match=message):
        check_linear("experts.0.gate_proj", linear, _scheme(fixture))
