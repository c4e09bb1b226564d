"""repack-moe v1 stacks: exact inverse, documented layout, act-order folding, shared-expert chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from repack.formats.gptq import GptqFormatError, GptqLinear, GptqScheme, dequantize
from repack.formats.stacks import StackInfo, dequantize_stack, plan_flags
from repack.synthetic_linear import quantize_linear
from tests.support.fixtures import FIXTURES
from tests.support.stacks import pack_gptq, seeded_stack, unpack_gptq

SCHEMES = [
    GptqScheme(4, 128, True, "gptq"),
    GptqScheme(4, 32, False, "gptq"),
    GptqScheme(4, 64, False, "gptq_v2"),
    GptqScheme(4, -1, True, "gptq_v2"),
    GptqScheme(8, 64, True, "gptq"),
]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_pack_then_unpack_is_bit_exact(scheme, act_order):
    info, names, sources = seeded_stack(scheme, act_order)

    def sorted_by_groups(k: int) -> bool:  # one group over the input makes any order trivial
        return act_order and scheme.group_size != -1 and scheme.group_size < k

    assert info.act_order_w13 == sorted_by_groups(info.hidden_size)
    assert info.act_order_w2 == sorted_by_groups(info.intermediate_size)
    tensors = pack_gptq(info, sources)
    shapes = {name: (list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}
    assert shapes == {name: tuple(spec) for name, spec in info.tensor_shapes().items()}
    back = unpack_gptq(info, tensors)
    for triple, linears in zip(names, sources, strict=True):
        for name, linear in zip(triple, linears, strict=True):
            for field in ("qweight", "qzeros", "scales", "g_idx"):
                assert torch.equal(back[f"{name}.{field}"], getattr(linear, field)), f"{name}.{field}"


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("word_order", ["gptq", "mma128"])
@pytest.mark.parametrize("scheme", [GptqScheme(4, 128, True, "gptq"), GptqScheme(4, 128, False, "gptq_v2")], ids=str)
def test_unpack_writes_each_chunk_into_its_columns(scheme, act_order, word_order, chunks):
    """unpack_stack puts each chunk's gate, up and down words straight into their columns (rows for down) of the
    source expert's GPTQ qweights: every word order, with and without act-order, one chunk or several."""
    info, names, sources = seeded_stack(scheme, act_order, experts=2 * chunks, chunks=chunks, word_order=word_order)
    assert info.word_order == word_order and info.chunks_per_source == chunks
    back = unpack_gptq(info, pack_gptq(info, sources))
    for triple, linears in zip(names, sources, strict=True):
        for name, linear in zip(triple, linears, strict=True):
            for field in ("qweight", "qzeros", "scales", "g_idx"):
                assert torch.equal(back[f"{name}.{field}"], getattr(linear, field)), f"{name}.{field}"
            assert back[f"{name}.qweight"].is_contiguous()


@pytest.mark.parametrize("act_order", [False, True])
def test_stack_computes_the_source_mlp(act_order):
    """x -> SiLU(gate) * up -> down through OUR layout equals the source GPTQ expert (P2 folded into w13)."""
    scheme = GptqScheme(4, 32, False, "gptq")
    info, _, sources = seeded_stack(scheme, act_order, experts=2)
    w13, w2 = dequantize_stack(info, pack_gptq(info, sources))
    x = torch.randn(5, info.hidden_size, dtype=torch.float64)
    for e, (gate, up, down) in enumerate(sources):
        ref_h = F.silu(x @ dequantize(gate, scheme).double().T) * (x @ dequantize(up, scheme).double().T)
        ref = ref_h @ dequantize(down, scheme).double().T
        h13 = x @ w13[e].double().T
        ours = (F.silu(h13[:, : info.intermediate_size]) * h13[:, info.intermediate_size :]) @ w2[e].double().T
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)


def test_layout_is_output_major_with_gate_rows_first():
    scheme = GptqScheme(4, 128, True, "gptq")
    info, _, sources = seeded_stack(scheme, act_order=False, experts=1)
    tensors = pack_gptq(info, sources)
    w13 = tensors["layers.0.mlp.experts.w13_qweight"][0]
    gate, up, _ = sources[0]
    # word [n, r] of w13 == word [r, n] of the GPTQ gate qweight (no act-order: same nibble order).
    assert torch.equal(w13[: info.intermediate_size], gate.qweight.t())
    assert torch.equal(w13[info.intermediate_size :], up.qweight.t())


def test_shared_expert_chunks_are_exact():
    scheme = GptqScheme(4, 64, True, "gptq")
    info, names, sources = seeded_stack(scheme, act_order=True, experts=4, chunks=4, inter=64)
    assert info.chunks_per_source == 4
    tensors = pack_gptq(info, sources)
    back = unpack_gptq(info, tensors)
    for name, linear in zip(names[0], sources[0], strict=True):
        assert torch.equal(back[f"{name}.qweight"], linear.qweight)
        assert torch.equal(back[f"{name}.g_idx"], linear.g_idx)
    # The chunks sum to the whole expert.
    w13, w2 = dequantize_stack(info, tensors)
    gate, up, down = sources[0]
    x = torch.randn(3, info.hidden_size, dtype=torch.float64)
    ref = (F.silu(x @ dequantize(gate, scheme).double().T) * (x @ dequantize(up, scheme).double().T)) @ dequantize(
        down, scheme
    ).double().T
    i = info.intermediate_size
    ours = sum((F.silu(x @ w13[c, :i].double().T) * (x @ w13[c, i:].double().T)) @ w2[c].double().T for c in range(4))
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)


def test_gate_and_up_with_different_orders_are_refused():
    scheme = GptqScheme(4, 32, True, "gptq")
    gen = torch.Generator().manual_seed(3)
    gate = quantize_linear(torch.randn(64, 128, generator=gen), scheme, act_order=True, generator=gen)
    up = quantize_linear(torch.randn(64, 128, generator=gen), scheme, act_order=True, generator=gen)
    down = quantize_linear(torch.randn(128, 64, generator=gen), scheme, generator=gen)
    names = [("g", "u", "d")]
    info = StackInfo("p", "routed", 1, 128, 64, 4, 32, True, "gptq", True, False, True, [list(names[0])])
    with pytest.raises(GptqFormatError, match="different act-order permutations"):
        pack_gptq(info, [(gate, up, down)])


def test_unequal_groups_are_refused():
    scheme = GptqScheme(4, 32, True, "gptq")
    gen = torch.Generator().manual_seed(4)
    linear = quantize_linear(torch.randn(64, 128, generator=gen), scheme, act_order=True, generator=gen)
    linear.g_idx = linear.g_idx.clone()
    linear.g_idx[linear.g_idx == 1] = 0  # group 0 now has 64 rows
    info = StackInfo("p", "routed", 1, 128, 32, 4, 32, True, "gptq", True, False, True, [["a", "b", "c"]])
    with pytest.raises(GptqFormatError, match="not all of size 32"):
        pack_gptq(info, [(linear, linear, linear)])


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_fixture_layers_round_trip(fixture):
    import json

    qc = json.loads((fixture / "config.json").read_text())["quantization_config"]
    scheme = GptqScheme(qc["bits"], qc["group_size"], qc["sym"], qc["checkpoint_format"])
    model = safe_open(fixture / "model.safetensors", "pt")
    names = [tuple(f"model.layers.1.mlp.experts.{j}.{p}_proj" for p in ("gate", "up", "down")) for j in range(8)]
    load = lambda m: GptqLinear(*(model.get_tensor(f"{m}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")))  # noqa: E731
    sources = [tuple(load(n) for n in triple) for triple in names]
    act13, act2, has_g_idx = plan_flags(names, sources, scheme)
    assert act13 == act2 == ("actorder" in fixture.name)
    info = StackInfo(
        "model.layers.1.mlp.experts",
        "routed",
        8,
        256,
        384,
        4,
        qc["group_size"],
        True,
        "gptq",
        act13,
        act2,
        has_g_idx,
        [list(t) for t in names],
    )
    back = unpack_gptq(info, pack_gptq(info, sources))
    for triple in names:
        for name in triple:
            for field in ("qweight", "qzeros", "scales", "g_idx"):
                assert torch.equal(back[f"{name}.{field}"], model.get_tensor(f"{name}.{field}"))


def test_split_by_source_rebuilds_each_expert_alone():
    """What `repack verify` does to hold one expert at a time: slices of the E axis, one source expert each."""
    from repack.formats.stacks import split_by_source

    scheme = GptqScheme(4, 64, False, "gptq")
    info, names, sources = seeded_stack(scheme, act_order=True, experts=3)
    chunked, chunk_names, chunk_sources = seeded_stack(scheme, act_order=True, experts=4, chunks=2, inter=64)
    for stack_info, triples, linears in ((info, names, sources), (chunked, chunk_names, chunk_sources)):
        tensors = pack_gptq(stack_info, linears)
        parts = list(split_by_source(stack_info))
        assert len(parts) == len(triples)
        for (sub, rows), triple, source in zip(parts, triples, linears, strict=True):
            back = unpack_gptq(sub, {name: tensor[rows] for name, tensor in tensors.items()})
            for name, linear in zip(triple, source, strict=True):
                assert torch.equal(back[f"{name}.qweight"], linear.qweight)
                assert torch.equal(back[f"{name}.qzeros"], linear.qzeros)


def test_g_idx_on_some_experts_only_or_not_int32_is_refused():
    """Both would convert and then fail the inverse: refuse them before anything is written."""
    from repack.formats.gptq import check_linear

    scheme = GptqScheme(4, 64, True, "gptq")
    info, names, sources = seeded_stack(scheme, act_order=False, experts=2)
    sources[1][2].g_idx = None
    with pytest.raises(GptqFormatError, match=r"e1.down_proj.g_idx: missing while other experts"):
        plan_flags(names, sources, scheme)
    linear = sources[0][0]
    linear.g_idx = linear.g_idx.long()
    with pytest.raises(GptqFormatError, match="g_idx: expected int32"):
        check_linear("e0.gate_proj", linear, scheme)
