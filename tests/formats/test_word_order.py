"""The "mma128" word order (v2) and its tiles (v3): definitions, the exact converters, stacks in them, and v1/v2
compatibility."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from repack.convert import convert
from repack.formats.checkpoint import read_repack_config
from repack.formats.errors import RepackError
from repack.formats.gptq import GptqScheme
from repack.formats.stacks import (
    FORMAT_VERSION,
    MMA128_INDEX,
    SUPPORTED_FORMAT_VERSIONS,
    WORD_ORDERS,
    StackInfo,
    StackInfoError,
    choose_word_order,
    dequantize_stack,
    from_tiles,
    from_word_order,
    to_tiles,
    to_word_order,
    transpose_from_tiles,
    transpose_from_word_order,
    transpose_to_tiles,
    transpose_to_word_order,
)
from repack.synthetic import write_synthetic_checkpoint
from repack.verify import verify
from tests.support.fixtures import FIXTURES_DIR
from tests.support.stacks import pack_gptq, seeded_stack, unpack_gptq

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def test_constants():
    assert FORMAT_VERSION == 3 and SUPPORTED_FORMAT_VERSIONS == (1, 2, 3)
    assert WORD_ORDERS == ("gptq", "mma128", "mma128_tiles")


def test_tiles_hold_the_mma128_rows_tile_by_tile():
    """Tile (band t, step s) of "mma128_tiles" is rows 64t..64t+63, words 16s..16s+15 of the "mma128" rows, one
    contiguous run of 64 x 16 words; the tiles of a band follow each other in K order (SPEC.md section 3)."""
    gen = torch.Generator().manual_seed(3)
    words = torch.randint(INT32_MIN, INT32_MAX + 1, (2, 192, 48), dtype=torch.int32, generator=gen)
    tiles = to_word_order(words, "mma128_tiles")
    rows = to_word_order(words, "mma128")
    assert tiles.shape == (2, 3, 3, 64, 16) and tiles.is_contiguous()
    for e, t, step in [(0, 0, 0), (0, 2, 1), (1, 1, 2)]:
        assert torch.equal(tiles[e, t, step], rows[e, 64 * t : 64 * t + 64, 16 * step : 16 * step + 16])
    flat = tiles.view(-1)  # tile (e, t, s) starts at ((e * 3 + t) * 3 + s) * 1024 words
    assert torch.equal(flat[((1 * 3 + 2) * 3 + 1) * 1024 :][:1024].view(64, 16), rows[1, 128:192, 16:32])
    assert torch.equal(from_tiles(tiles), rows) and torch.equal(to_tiles(rows), tiles)
    assert torch.equal(from_word_order(tiles, "mma128_tiles"), words)


def test_one_pass_tiles_match_rows_cut_into_tiles():
    """The converter's form (transpose_to_tiles): strided GPTQ columns straight into a band range of a stack's tiles,
    the same words as "mma128" rows cut by to_tiles, nothing else written; the verifier's (transpose_from_tiles)
    back out of them."""
    gen = torch.Generator().manual_seed(5)
    qweight = torch.randint(INT32_MIN, INT32_MAX + 1, (48, 200), dtype=torch.int32, generator=gen)
    columns = qweight[:, 3:131]  # [48, 128]: K = 384, two bands of 64 output rows
    stack = torch.zeros((1, 5, 3, 64, 16), dtype=torch.int32)
    transpose_to_tiles(columns, out=stack[0, 2:4])
    assert torch.equal(stack[0, 2:4], to_tiles(transpose_to_word_order(columns, "mma128")))
    assert not stack[0, :2].any() and not stack[0, 4:].any()
    back = torch.zeros_like(qweight)  # and read back out of the tiles into the same columns, nothing else written
    transpose_from_tiles(stack[0, 2:4], out=back[:, 3:131])
    assert torch.equal(back[:, 3:131], columns) and not back[:, :3].any() and not back[:, 131:].any()
    with pytest.raises(ValueError, match="do not cut 96 output rows"):
        transpose_to_tiles(qweight[:, :96])


def test_tiles_refuse_rows_they_do_not_cut():
    with pytest.raises(ValueError, match="do not cut"):
        to_tiles(torch.zeros(2, 96, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="not \\[..., N/64, K/128, 64, 16\\] tiles"):
        from_tiles(torch.zeros(2, 1, 1, 32, 16, dtype=torch.int32))


def test_index_is_a_permutation_of_one_block():
    assert MMA128_INDEX.shape == (128,)
    assert sorted(MMA128_INDEX.tolist()) == list(range(128))


def _gptq_words(values: torch.Tensor) -> torch.Tensor:
    """Nibble values ``[..., K]`` (input k at its sorted position) -> "gptq"-order int32 words ``[..., K/8]``."""
    fields = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    words = (fields << (4 * torch.arange(8))).sum(-1)
    return torch.where(words > INT32_MAX, words - 2**32, words).to(torch.int32)


def _fields(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[..., W]`` -> their nibbles ``[..., W, 8]`` (field s = bits 4s..4s+3)."""
    return (words.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF


def test_formula_on_hand_built_words():
    """Tag every input of two blocks with k % 16, then with (k // 16) % 8 and k // 128; read where each landed."""
    k = torch.arange(256)
    low = _fields(to_word_order(_gptq_words(k % 16), "mma128")).view(2, 16, 8)
    chunk = _fields(to_word_order(_gptq_words((k // 16) % 8), "mma128")).view(2, 16, 8)
    block = _fields(to_word_order(_gptq_words(k // 128), "mma128")).view(2, 16, 8)
    for b in range(2):
        for w in range(16):
            for s in range(8):
                expected = 128 * b + 16 * (4 * (w // 8) + s % 4) + 2 * (w % 8) + s // 4
                assert block[b, w, s] == expected // 128
                assert chunk[b, w, s] == (expected // 16) % 8
                assert low[b, w, s] == expected % 16


def test_one_shift_and_mask_gives_an_adjacent_pair():
    """The reason for the order: ``(word >> 4i) & 0x000F000F`` holds inputs (k, k+1) of chunk 4g + i, k = 16c + 2m."""
    k = torch.arange(128)
    words = to_word_order(_gptq_words(k % 16), "mma128")
    chunks = to_word_order(_gptq_words(k // 16), "mma128")
    for w in range(16):
        g, m = divmod(w, 8)
        for i in range(4):
            pair = (int(words[w]) >> (4 * i)) & 0x000F000F
            assert (pair & 0xF, pair >> 16) == (2 * m, 2 * m + 1)
            chunk_pair = (int(chunks[w]) >> (4 * i)) & 0x000F000F
            assert chunk_pair == (4 * g + i) * 0x00010001


def _reference_to_mma128(words: torch.Tensor) -> torch.Tensor:
    """The definition as a gather: unpack every nibble, take MMA128_INDEX within each block, repack."""
    nibbles = _fields(words).reshape(*words.shape[:-1], -1, 128)
    return _gptq_words(nibbles[..., MMA128_INDEX].reshape(*words.shape[:-1], -1))


@pytest.mark.parametrize("shape", [(16,), (3, 32), (2, 5, 64), (1, 40, 448)])
def test_converters_are_exact_inverses_on_any_bits(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    words = torch.randint(INT32_MIN, INT32_MAX + 1, shape, dtype=torch.int32, generator=gen)
    words.view(-1)[:4] = torch.tensor([INT32_MIN, -1, 0, INT32_MAX], dtype=torch.int32)
    assert (words < 0).any()
    original = words.clone()
    mma = to_word_order(words, "mma128")
    assert mma.dtype == torch.int32 and mma.shape == words.shape
    assert torch.equal(mma, _reference_to_mma128(words))
    assert torch.equal(from_word_order(mma, "mma128"), words)
    assert torch.equal(words, original)  # inputs are never modified
    assert torch.equal(from_word_order(mma.clone(), "mma128"), words)


def test_converters_accept_non_contiguous_words():
    words = torch.randint(INT32_MIN, INT32_MAX + 1, (32, 6), dtype=torch.int32).t()  # [6, 32], strided
    mma = to_word_order(words, "mma128")
    assert torch.equal(mma, _reference_to_mma128(words.contiguous()))
    assert torch.equal(from_word_order(mma.t().contiguous().t(), "mma128"), words)


def test_transposing_converters_accept_outputs_of_any_strides():
    """The compiled loops store pairs of words; an output whose rows are not contiguous still gets every word."""
    gptq = torch.randint(INT32_MIN, INT32_MAX + 1, (32, 6), dtype=torch.int32)  # input-major [R, N]
    expected = transpose_to_word_order(gptq, "mma128")
    out = torch.zeros(32, 6, dtype=torch.int32).t()  # [N, R], rows strided
    assert transpose_to_word_order(gptq, "mma128", out=out) is out and torch.equal(out, expected)
    back = torch.zeros(6, 32, dtype=torch.int32).t()  # [R, N], rows strided
    assert transpose_from_word_order(expected.t().contiguous().t(), "mma128", out=back) is back
    assert torch.equal(back, gptq)


@pytest.mark.parametrize(
    ("rows", "cols"),
    [(16, 1), (16, 31), (16, 32), (64, 1100), (2048, 100), (448, 5120)],
    ids=["one-column", "under-a-tile", "one-tile", "two-panels", "long-rows", "qwen2-57b-w13"],
)
def test_inverse_in_panels_matches_the_strided_loop(rows, cols):
    """verify's inverse (scratch panels of whole tiles, the columns past the last tile one by one, panels narrower
    where rows are long; into rows of any distance) against the loop it replaced, which strided rows still take."""
    from repack.formats import mma128_kernels

    gen = torch.Generator().manual_seed(rows + cols)
    gptq = torch.randint(INT32_MIN, INT32_MAX + 1, (rows, cols), dtype=torch.int32, generator=gen)
    mma = transpose_to_word_order(gptq, "mma128")
    assert torch.equal(transpose_from_word_order(mma, "mma128"), gptq)  # C-contiguous: the panels
    pairs = mma.numpy().view("uint64")
    panels, strided = torch.full_like(gptq, 7), torch.full_like(gptq, 7)
    mma128_kernels.transpose_from_mma128(pairs, panels.numpy().view("uint32"))
    mma128_kernels.transpose_from_mma128_strided(pairs, strided.numpy().view("uint32"))
    assert torch.equal(panels, gptq) and torch.equal(strided, gptq)
    wide = torch.zeros(rows, cols + 3, dtype=torch.int32)  # columns of a wider tensor: panels, rows apart
    assert torch.equal(transpose_from_word_order(mma, "mma128", out=wide[:, 1 : cols + 1]), gptq)
    assert not wide[:, 0].any() and not wide[:, cols + 1 :].any()
    across = torch.zeros(cols, rows, dtype=torch.int32).t()  # rows strided: the strided loop
    assert torch.equal(transpose_from_word_order(mma, "mma128", out=across), gptq)


@pytest.mark.parametrize("order", ["gptq", "mma128"])
def test_transposing_converters_match_the_definition(order):
    """The converter's form: input-major GPTQ words [R, N] (a strided column slice, as for one chunk of a shared
    expert) written output-major into a slice of a larger tensor, and back, without touching the input."""
    gen = torch.Generator().manual_seed(7)
    qweight = torch.randint(INT32_MIN, INT32_MAX + 1, (48, 30), dtype=torch.int32, generator=gen)
    columns = qweight[:, 5:25]  # [48, 20], row stride 30
    original = qweight.clone()
    stack = torch.zeros((3, 20, 48), dtype=torch.int32)
    written = transpose_to_word_order(columns, order, out=stack[1])
    assert written.data_ptr() == stack[1].data_ptr() and torch.equal(qweight, original)
    expected = columns.t().contiguous() if order == "gptq" else _reference_to_mma128(columns.t().contiguous())
    assert torch.equal(stack[1], expected)
    assert not stack[0].any() and not stack[2].any()
    assert torch.equal(transpose_to_word_order(columns, order), expected)
    assert torch.equal(transpose_from_word_order(stack[1], order), columns)
    assert torch.equal(transpose_from_word_order(stack[1].t().contiguous().t(), order), columns)


def test_gptq_order_is_the_identity():
    words = torch.randint(INT32_MIN, INT32_MAX + 1, (4, 24), dtype=torch.int32)
    assert to_word_order(words, "gptq") is words and from_word_order(words, "gptq") is words


def test_converters_refuse_what_they_cannot_permute():
    with pytest.raises(ValueError, match="not a row-major nibble order"):
        to_word_order(torch.zeros(16, dtype=torch.int32), "marlin")
    with pytest.raises(ValueError, match="not a row-major nibble order"):
        transpose_to_word_order(torch.zeros(16, 64, dtype=torch.int32), "mma128_tiles")
    with pytest.raises(ValueError, match=r"\[..., 16 n\]"):
        to_word_order(torch.zeros(2, 24, dtype=torch.int32), "mma128")
    with pytest.raises(ValueError, match="int64"):
        from_word_order(torch.zeros(2, 32, dtype=torch.int64), "mma128")


@pytest.mark.parametrize(
    ("bits", "hidden", "inter", "group", "order"),
    [
        (4, 256, 384, 128, "mma128_tiles"),
        (4, 3584, 2560, 128, "mma128_tiles"),
        (4, 2048, 1408, -1, "mma128_tiles"),
        (4, 256, 384, 32, "gptq"),
        (4, 256, 384, 64, "gptq"),
        (4, 256, 64, 128, "gptq"),
        (4, 192, 384, -1, "gptq"),
        (8, 256, 384, 128, "gptq"),
    ],
)
def test_choose_word_order(bits, hidden, inter, group, order):
    assert choose_word_order(bits, hidden, inter, group) == order


STACKS = {
    "sym-g128": (GptqScheme(4, 128, True, "gptq"), False),
    "asym-per-channel": (GptqScheme(4, -1, False, "gptq"), False),
    "asym-v2-g128-act-order": (GptqScheme(4, 128, False, "gptq_v2"), True),
    "sym-g128-act-order": (GptqScheme(4, 128, True, "gptq"), True),
}


def _chosen(info: StackInfo) -> StackInfo:
    order = choose_word_order(info.bits, info.hidden_size, info.intermediate_size, info.group_size)
    return replace(info, word_order=order)


@pytest.mark.parametrize("order", ["mma128", "mma128_tiles"])
@pytest.mark.parametrize("name", STACKS)
def test_mma128_stack_round_trips_bit_exactly(name, order):
    scheme, act_order = STACKS[name]
    gptq_info, names, sources = seeded_stack(scheme, act_order, hidden=256, inter=256)
    assert _chosen(gptq_info).word_order == "mma128_tiles"
    info = replace(gptq_info, word_order=order)
    assert info.act_order_w13 == info.act_order_w2 == act_order
    tensors = pack_gptq(info, sources)
    back = unpack_gptq(info, tensors)
    for triple, linears in zip(names, sources, strict=True):
        for module, linear in zip(triple, linears, strict=True):
            for field in ("qweight", "qzeros", "scales", "g_idx"):
                assert torch.equal(back[f"{module}.{field}"], getattr(linear, field)), f"{module}.{field}"
    # Only the qweights differ from the "gptq" order, by exactly the word permutation.
    plain = pack_gptq(gptq_info, sources)
    assert tensors.keys() == plain.keys()
    for tensor_name, tensor in tensors.items():
        if tensor_name.endswith("qweight"):
            assert list(tensor.shape) == info.tensor_shapes()[tensor_name][0]
            assert torch.equal(tensor, to_word_order(plain[tensor_name], order))
            assert not torch.equal(tensor, plain[tensor_name])
        else:
            assert torch.equal(tensor, plain[tensor_name])
    for ours, theirs in zip(dequantize_stack(info, tensors), dequantize_stack(gptq_info, plain), strict=True):
        assert torch.equal(ours, theirs)


def test_mma128_shared_expert_chunks_round_trip():
    scheme = GptqScheme(4, 128, True, "gptq")
    gptq_info, names, sources = seeded_stack(scheme, act_order=True, experts=2, chunks=2, hidden=256, inter=128)
    info = _chosen(gptq_info)
    assert info.word_order == "mma128_tiles" and info.chunks_per_source == 2
    back = unpack_gptq(info, pack_gptq(info, sources))
    for module, linear in zip(names[0], sources[0], strict=True):
        assert torch.equal(back[f"{module}.qweight"], linear.qweight)
        assert torch.equal(back[f"{module}.g_idx"], linear.g_idx)


def test_gptq_stack_still_round_trips_at_g32():
    scheme = GptqScheme(4, 32, False, "gptq")
    info, names, sources = seeded_stack(scheme, act_order=True, hidden=256, inter=128)
    assert _chosen(info).word_order == "gptq"
    back = unpack_gptq(info, pack_gptq(info, sources))
    for triple, linears in zip(names, sources, strict=True):
        for module, linear in zip(triple, linears, strict=True):
            assert torch.equal(back[f"{module}.qweight"], linear.qweight)
            assert torch.equal(back[f"{module}.qzeros"], linear.qzeros)


def _stack_json(**changes) -> dict:
    info = StackInfo("p", "routed", 1, 256, 128, 4, 128, True, "gptq", False, False, True, [["g", "u", "d"]])
    return dict(info.to_json(), **changes)


def test_stack_json_carries_word_order_and_v1_entries_read_as_gptq():
    data = _stack_json(word_order="mma128")
    assert StackInfo.from_json(data).word_order == "mma128"
    assert StackInfo.from_json(json.loads(json.dumps(data))).to_json() == data
    v1 = _stack_json()
    del v1["word_order"]
    assert StackInfo.from_json(v1).word_order == "gptq"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"word_order": "marlin"}, "word_order 'marlin' is not one of"),
        ({"word_order": "mma128", "bits": 8}, "needs 4 bits"),
        ({"word_order": "mma128", "intermediate_size": 64}, "H, I multiples of 128"),
        ({"word_order": "mma128_tiles", "hidden_size": 192}, "H, I multiples of 128"),
    ],
)
def test_impossible_word_orders_are_refused(changes, message):
    with pytest.raises(StackInfoError, match=message):
        StackInfo.from_json(_stack_json(**changes))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("word_order")
    names = ("qwen2moe-g128-sym", "qwen2moe-g32-actorder")
    return {name: convert(str(FIXTURES_DIR / name), root / name, quiet=True) and root / name for name in names}


@pytest.mark.parametrize(
    ("fixture", "order"), [("qwen2moe-g128-sym", "mma128_tiles"), ("qwen2moe-g32-actorder", "gptq")]
)
def test_converted_fixtures_record_their_word_order(converted, fixture, order):
    config = json.loads((converted[fixture] / "config.json").read_text())["quantization_config"]
    assert config["format_version"] == 3
    assert {stack["kind"] for stack in config["stacks"]} == {"routed", "shared"}
    assert all(stack["word_order"] == order for stack in config["stacks"])
    _, stacks = read_repack_config(converted[fixture])
    assert all(info.word_order == order for info in stacks)


def test_mma128_fixture_verifies_bit_exactly(converted):
    report = verify(converted["qwen2moe-g128-sym"], str(FIXTURES_DIR / "qwen2moe-g128-sym"))
    assert report.stacks_checked == 4 and report.tensors_compared > 0


def _edit_quant(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def test_a_v1_config_still_reads(converted, tmp_path):
    """A v1 checkpoint: format_version 1 and no word_order in its stacks, its words in the "gptq" order."""
    folder = shutil.copytree(converted["qwen2moe-g32-actorder"], tmp_path / "v1")

    def as_v1(quant: dict) -> None:
        quant["format_version"] = 1
        for stack in quant["stacks"]:
            del stack["word_order"]

    _edit_quant(folder, as_v1)
    config, stacks = read_repack_config(folder)
    assert config["quantization_config"]["format_version"] == 1
    assert stacks and all(info.word_order == "gptq" for info in stacks)


def test_a_bad_word_order_in_config_is_a_one_line_error(converted, tmp_path):
    folder = shutil.copytree(converted["qwen2moe-g128-sym"], tmp_path / "bad")
    _edit_quant(folder, lambda quant: quant["stacks"][0].update(word_order="nibble-soup"))
    with pytest.raises(RepackError) as error:
        read_repack_config(folder)
    message = str(error.value)
    assert "\n" not in message and "config.json" in message and "word_order 'nibble-soup'" in message


def test_synthetic_chunked_shared_experts_convert_to_mma128_tiles(tmp_path):
    """DeepSeek with I_s = 2 I at g128: routed and the two shared chunks (I = 128 each) take "mma128_tiles"."""
    scheme = GptqScheme(4, 128, True, "gptq")
    src = write_synthetic_checkpoint(
        tmp_path / "src", family="deepseek_v2", scheme=scheme, act_order=True, hidden_size=256, intermediate_size=128
    )
    out = tmp_path / "out"
    convert(str(src), out, quiet=True)
    verify(out, str(src))
    _, stacks = read_repack_config(out)
    shared = [s for s in stacks if s.kind == "shared"]
    assert shared and all(s.num_experts == 2 and s.intermediate_size == 128 for s in shared)
    assert all(s.word_order == "mma128_tiles" for s in stacks)
