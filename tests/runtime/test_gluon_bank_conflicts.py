"""Shared-memory bank conflicts of the Gluon kernels' own reads and writes, as Triton counts them
(``gl.bank_conflicts``'s model: the excess wavefronts of each ld/st.shared a register layout makes on a shared
layout), for every tile `repack tune` may write (tune.GLUON_TILES, the heuristic's among them).

What the kernels move through shared memory in layouts of their own (runtime/kernels/gluon_sm90.py): the words of a K
step, read into each thread's share of the wgmma A fragment (``word_layout``, from the cp.async ring's
``W_SMEM_LAYOUT`` and from the TMA ring's ``W_TMA_LAYOUT`` of gluon_ws_sm90), the cp.async copy of those words
(``w_copy_layout``), and the activations' copy into the 128-byte-swizzled ring (``x_layout``). The half step the kernels
read (``[rows, 8]``, a slice the counter does not take) is counted as the whole step read with one more register
bit for its second half: the same instructions. Bank conflicts were once what held these kernels back
(benchmarks/KERNEL_NOTES.md item 16). The wgmma's own shared operands are read by the tensor cores, not by these
instructions, and the compiler picks the epilogue's layout changes itself."""

from __future__ import annotations

import pytest

from repack.runtime.kernels import gluon_sm90

pytestmark = pytest.mark.skipif(not gluon_sm90.available(), reason="this Triton has no Gluon Hopper API")


def _conflicts(register_layout, shared_layout, shape: list[int], bits: int) -> int:
    from triton._C.libtriton import gluon_ir, ir

    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    return builder.get_shared_bank_conflicts(
        register_layout._to_ir(builder), shared_layout._to_ir(builder), list(shape), bits
    )


def _step_words_layout(rows: int, warps: int):
    """word_layout's [rows, 8] half step with the second half as one more register bit: [rows, 16]."""
    from triton.experimental.gluon import language as gl

    half = gluon_sm90.word_layout(rows, warps)
    return gl.DistributedLinearLayout(list(half.reg_bases) + [[0, 8]], half.lane_bases, half.warp_bases, [], [rows, 16])


def _word_reads() -> list[tuple[str, int, int]]:
    """(ring, weight rows a K step, warps) of every tile's w13 and w2."""
    from repack.runtime.kernels import gluon_ws_sm90
    from repack.runtime.tune import GLUON_TILES

    reads = set()
    for tile in GLUON_TILES:
        if tile.per_sm:  # the warp-specialized kernels: words by TMA, w2's rows W2_ROWS a consumer warpgroup
            reads |= {("tma", 2 * tile.block_n, tile.warps), ("tma", gluon_ws_sm90.w2_rows(tile), tile.warps)}
        reads |= {("cp.async", 2 * tile.block_n, tile.warps), ("cp.async", tile.w2_rows, tile.warps)}
    return sorted(reads)


@pytest.mark.parametrize(("ring", "rows", "warps"), _word_reads())
def test_word_fragment_reads_are_conflict_free(ring: str, rows: int, warps: int) -> None:
    from repack.runtime.kernels import gluon_ws_sm90

    shared = gluon_ws_sm90.W_TMA_LAYOUT.value if ring == "tma" else gluon_sm90.W_SMEM_LAYOUT.value
    assert _conflicts(_step_words_layout(rows, warps), shared, [rows, 16], 32) == 0


@pytest.mark.parametrize("warps", [4, 8])
def test_ring_copies_are_conflict_free(warps: int) -> None:
    rows = 16 * warps  # one repetition of each copy layout; more rows repeat it
    assert _conflicts(gluon_sm90.w_copy_layout(warps), gluon_sm90.W_SMEM_LAYOUT.value, [rows, 16], 32) == 0
    assert _conflicts(gluon_sm90.x_layout(warps), gluon_sm90.X_SMEM_LAYOUT.value, [rows, 64], 16) == 0


def test_the_count_sees_an_unswizzled_ring() -> None:
    """The same fragment reads on words laid row after row with no swizzle: eight rows of a warp's read share their
    banks (the layout before KERNEL_NOTES.md item 16), so the count is not zero for everything."""
    from triton.experimental.gluon import language as gl

    plain = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    assert _conflicts(_step_words_layout(128, 4), plain, [128, 16], 32) > 0
