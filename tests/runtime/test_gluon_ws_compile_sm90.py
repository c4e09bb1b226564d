"""The warp-specialized Gluon GEMMs (runtime/kernels/gluon_ws_sm90.py) compile for sm_90 on the CPU as the probe
launches them: no spills at each register cap, the partitions' register split applied, a wgmma in flight in the K
loop, and the stages handed over by mbarriers; w2 with the top-k sum it ships with (fp16: added into the output over
stream-K ranges; bf16: a row per pair, whole tiles). Gluon has no interpreter, so this is what CI can hold them to until
benchmarks/probe_gluon_ws.py has run them on a GPU. Runs in a subprocess: the test session sets TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from repack.runtime.kernel_config import GluonTile
from repack.runtime.kernels import gluon_sm90, schedule
from repack.runtime.kernels.gluon_sm90 import scale_after
from repack.runtime.kernels.gluon_ws_sm90 import PRODUCER_REGS, W2_ROWS, producer_regs, w2_rows
from repack.runtime.tune import GLUON_TILES
from tests.runtime.test_gluon_compile_sm90 import loop_waits
from tests.support.sm90 import (
    SM90_BLOCK_RESERVED,
    SM90_SHARED_PER_SM,
    before_dependency_wait,
    check_last_rows_build,
    compile_child,
    local_memory_in_k_loops,
    local_memory_in_mma_loops,
    ptxas_spills,
)

_CHILD = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from repack.runtime.kernel_config import GluonTile
from repack.runtime.kernels import gluon_sm90, gluon_ws_sm90 as ws

tile, act, asym = GluonTile(*json.loads(sys.argv[1])), sys.argv[2], sys.argv[3] == "1"
producer_regs, step_sum, tiles = int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6] == "1"
w2_rows, ragged = int(sys.argv[7]), sys.argv[8] == "1"
split = int(sys.argv[9]) if len(sys.argv) > 9 and sys.argv[9] != "-" else None  # w2's work list; None: as shipped
sum_last = sys.argv[10:11] == ["1"]  # w2 writes per-pair rows and sums each token's where its last one lands
maxnreg = tile.registers
ptr = "*bf16" if act == "bfloat16" else "*fp16"
desc = mangle_type(ws.words_descriptor(torch.zeros(2, 128, 16, dtype=torch.int32), tiles))
types = dict(w_desc=desc, x_ptr=ptr, inter_ptr=ptr, out_ptr=ptr, sum_ptr=ptr, scales_ptr="*fp16",
             zeros_ptr="*u8" if asym else "*fp16", topk_weights_ptr="*fp32",
             zero_ptr="*i32" if sum_last else ptr)  # w13 clears the tickets of "last", else the output
report = {}
for name, kernel in (("w13", ws._w13_ws_kernel), ("w2", ws._w2_ws_kernel)):
    consts = dict(TOP_K=8, GROUP_LEN=128, SYM_ZERO=8, HAS_ZEROS=asym, BLOCK_M=tile.block_m,
                  BLOCK_N=w2_rows if name == "w2" else tile.block_n, GROUP_M=tile.group_m, STAGES=tile.stages,
                  PRODUCER_REGS=producer_regs, PRODUCER_WARPS=ws.producer_warps(tile),
                  SCALE_AFTER=step_sum, TILES=tiles, RAGGED=ragged,
                  DEPENDENT=True)  # dependent launches, as on sm_90
    # w2 as it ships: fp16 adds into the output in stream-K ranges, bf16 as gluon_sm90.heuristic_reduce says
    atomic = gluon_sm90.heuristic_reduce(getattr(torch, act)) != "pairs" and not sum_last
    consts.update(dict(ZERO_OUT=atomic or sum_last) if name == "w13" else
                  dict(ATOMIC=atomic, SPLIT=ws.w2_split(atomic) if split is None else split,
                       PREFETCH=ws.PREFETCH_STEPS, SUM_LAST=sum_last))  # fmt: skip
    sig = {n: "constexpr" if n in consts else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
           for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")}
    k = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tile.warps, maxnreg=maxnreg))
    report[name] = dict(shared=k.metadata.shared, ptx=k.asm["ptx"])
print(json.dumps(report))
"""


def _cases() -> list[tuple[GluonTile, str, bool, int, bool, bool, int, bool]]:
    """(tile, activations, zero points, producer registers, step-scaled sum, tiled words, w2's rows, ragged): every
    warp-specialized tile `repack tune` may pick (the heuristic's among them) and the probe's other ring depths and
    register caps (benchmarks/probe_gluon_ws.py) in fp16; bf16's step-scaled sum at 64 registers
    (gluon_sm90.persistent_fits admits it beside the 32-register producer), fp16's there too
    (gluon_sm90.SCALE_AFTER_FP16_PERSISTENT); asymmetric zeros at 80, where persistent_fits sends them (at 64, w13
    spills); and the 40-register producer's fp16 path, the one measured before it (KERNEL_NOTES.md item 27); all of
    them on "mma128_tiles" words (what the converter writes), and the "mma128" rows of version-2 checkpoints in fp16
    and bf16; w2's tile of 64 rows (gluon_ws_sm90.W2_ROWS before item 29) in fp16. The 32- to 128-token tiles (one
    or two consumer warpgroups, a producer warpgroup) also in bf16 and with zero points; the 64- and 128-token ones
    with their MMAs as wide as each block's pairs (gluon_sm90.RAGGED_TILES) in fp16 and bf16."""
    shipped = [t for t in GLUON_TILES if t.per_sm]
    # 3 programs of 6 stages (item 25's ws-3-6) need 231 KB of an SM's 228: the SM ran 2 of them; 5 stages fit.
    probed = [GluonTile(16, 64, 1, 5, per_sm=3), GluonTile(16, 64, 1, 8, per_sm=2)]
    ragged = [
        (t, act, False, producer_regs(t), False, True, w2_rows(t), True)
        for t in shipped
        if t.block_m >= 64
        for act in ("float16", "bfloat16")
    ]
    return [(*case, False) for case in _plain_cases(shipped, probed)] + ragged


def _plain_cases(shipped: list[GluonTile], probed: list[GluonTile]) -> list[tuple]:
    """:func:`_cases` but the ragged ones (without the ragged flag)."""
    regs = PRODUCER_REGS
    wide, four = GluonTile(16, 64, 1, 4, per_sm=3), GluonTile(16, 64, 1, 4, per_sm=4)
    wider = [t for t in shipped if t.block_m > 16]  # the 32- to 128-token tiles: bf16 and zero points too
    return [(t, "float16", False, producer_regs(t), False, True, w2_rows(t)) for t in shipped + probed] + [
        *[(t, "bfloat16", False, producer_regs(t), scale_after(t, torch.bfloat16), True, w2_rows(t)) for t in wider],
        *[(t, "float16", True, producer_regs(t), False, True, w2_rows(t)) for t in wider],
        (four, "bfloat16", False, regs, True, True, W2_ROWS),
        (four, "float16", False, regs, True, True, W2_ROWS),
        (wide, "float16", True, regs, False, True, W2_ROWS),
        (wide, "bfloat16", True, regs, True, True, W2_ROWS),
        (four, "float16", False, 40, False, True, W2_ROWS),
        (four, "float16", False, regs, False, False, W2_ROWS),
        (four, "bfloat16", False, regs, True, False, W2_ROWS),
        (four, "float16", False, regs, False, True, 64),
    ]


def _compile(tile: GluonTile, act: str, flags: list[str]) -> dict:
    """{kernel: its shared memory and PTX} of the child's sm_90 builds (a subprocess: never interpreted)."""
    return compile_child(_CHILD, json.dumps(tile.to_list()), act, *flags)


KNOWN_TILE_SPILL_BYTES = 32  # bf16's step-sum consumer at 4 programs per SM on tiled words: 16-24 bytes measured

SASS_LOOPS = """
        /*0100*/                   HGMMA.64x16x16.F32.BF16 R32, R48, gdesc[UR4], RZ, !UPT ;
        /*0110*/                   LDL R14, [R1+0x8] ;
        /*0120*/               @P0 BRA 0x100 ;
        /*0130*/                   STL [R1], R0 ;
        /*0140*/              @!P1 BRA 0x180 ;
        /*0150*/               @P2 BRA 0x0f0 ;
        /*0180*/              @!P0 BRA 0x180 ;
        /*0190*/                   BRA 0x110 ;
"""


def test_k_loop_spill_finder_reads_loops_from_sass():
    """The LDL in the innermost wgmma loop (0x100-0x120) counts; the STL in the loop around it does not, nor does the
    unconditional return (0x190) of a retry block that would reach back over it."""
    assert local_memory_in_k_loops(SASS_LOOPS) == 1
    assert local_memory_in_k_loops(SASS_LOOPS.replace("LDL R14, [R1+0x8]", "IADD3 R14, R1, 0x8, RZ")) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tile", "act", "asym", "producer_regs", "step_sum", "tiles", "w2_rows", "ragged"),
    _cases(),
    ids=lambda v: str(v.to_list()) if isinstance(v, GluonTile) else str(v),
)
def test_warp_specialized_kernels_compile_for_sm90(tile, act, asym, producer_regs, step_sum, tiles, w2_rows, ragged):
    maxnreg = tile.registers
    flags = ["1" if asym else "0", str(producer_regs), "1" if step_sum else "0", "1" if tiles else "0"]
    flags += [str(w2_rows), "1" if ragged else "0"]
    for name, kernel in _compile(tile, act, flags).items():
        where = f"{name} {tile} {act}{' asym' if asym else ''} maxnreg={maxnreg} producer={producer_regs}"
        where += " tiles" if tiles else " rows"
        where += f" w2 rows {w2_rows}" + (" ragged" if ragged else "")
        ptx = kernel["ptx"]
        # per_sm programs share one SM's shared memory, each with the 1 KB the driver reserves per block
        per_sm = tile.per_sm * (kernel["shared"] + SM90_BLOCK_RESERVED)
        assert per_sm <= SM90_SHARED_PER_SM, f"{where}: {per_sm} bytes of shared memory on an SM"
        spills = ptxas_spills(ptx)
        # ptxas spills a few loop-invariant values once per tile, never inside a K loop: bf16's step-sum consumer at
        # its 104 registers when the producer reads tiles (KERNEL_NOTES.md item 30), and the ragged 128-token bf16
        # w13 (four K loops; 8 bytes at a consumer of 224 registers, KERNEL_NOTES.md item 44)
        step_sum_four = (act, step_sum, tiles, tile.per_sm) == ("bfloat16", True, True, 4)
        ragged_wide_bf16 = ragged and act == "bfloat16" and tile.block_m == 128
        if step_sum_four or ragged_wide_bf16:
            assert spills <= KNOWN_TILE_SPILL_BYTES, f"{where}: {spills} bytes of spills"
            assert local_memory_in_mma_loops(ptx) == 0, f"{where}: spills inside the K loop"
        else:
            assert spills == 0, f"{where}: spills to local memory"
        # The partitions' register split (the producer's warpgroup at its registers) is applied.
        split = rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{producer_regs};"
        assert re.search(split, ptx), f"{where}: no producer register split"
        assert "setmaxnreg.dec" in ptx, f"{where}: no warpgroup gives registers back"
        assert "cp.async.bulk.tensor" in ptx, f"{where}: the words do not come by TMA"
        # The kernel before ends first; w2 on tiled words first asks L2 for its first steps' words (prefetches),
        # reading the alignment's block count and experts past L1 (written two launches back).
        before = before_dependency_wait(ptx)
        l2_reads = 2 if name == "w2" and tiles else 0
        expected = {"waits": 1, "loads": l2_reads, "l2_loads": l2_reads, "writes": 0}
        assert before == expected, f"{where}: global memory before the wait: {before}"
        assert ("prefetch.global.L2" in ptx) == (l2_reads > 0), f"{where}: the L2 prefetch"
        assert "cp.async.mbarrier.arrive" in ptx, f"{where}: the activations' copies do not complete the stage"
        assert [n for n in loop_waits(ptx) if n >= 1], f"{where}: no wgmma in flight in the K loop"
        # Ragged: the whole tile's MMA, a half's, a quarter's, and the half-and-quarter path's two kept in flight.
        widths = {int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)}
        expected_widths = {tile.block_m, tile.block_m // 2, tile.block_m // 4} if ragged else {tile.block_m}
        assert widths == expected_widths, f"{where}: wgmma widths {sorted(widths)}"
        assert ("wgmma.wait_group.sync.aligned 2;" in ptx) == ragged, f"{where}: two accumulators in flight"
        atomics = re.findall(r"\batom\.[\w.]+", ptx)
        assert all(".relaxed." in a for a in atomics), f"{where}: ordered atomics ({atomics})"


@pytest.mark.slow
@pytest.mark.parametrize("split", [schedule.WHOLE_TILES, schedule.STREAM_K, schedule.WAVES_THEN_STREAM_K], ids=int)
def test_w2_work_lists_compile_for_sm90(split):
    """The 128-token tile's persistent w2 (gluon_ws_sm90.W2_PERSISTENT_MAX_M = 128, fp16, ragged) under each way of
    dealing its work (kernels/schedule.py; W2_STREAM_K, W2_WHOLE_WAVES): built with no spill, its partial sums added
    with relaxed atomics."""
    tile = next(t for t in GLUON_TILES if t.per_sm and t.block_m == 128)
    flags = ["0", str(producer_regs(tile)), "0", "1", str(w2_rows(tile)), "1", str(int(split))]
    ptx = _compile(tile, "float16", flags)["w2"]["ptx"]
    assert ptxas_spills(ptx) == 0
    atomics = re.findall(r"\batom\.[\w.]+", ptx)
    assert atomics and all(".relaxed." in a for a in atomics), atomics


@pytest.mark.slow
@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_w2_summing_last_rows_compiles_for_sm90(act):
    """reduce "last" (gluon_sm90._sum_last_rows) on every persistent tile `repack tune` may pick up to 64 tokens
    (SUM_LAST_MAX_M: 32 shipped, 64 in the anchor's variant), ragged where shipped, at its register cap: no spills,
    one acq_rel ticket at GPU scope per token of a tile (no other ordered atomic), the rows read back past L1."""
    tiles = [t for t in GLUON_TILES if t.per_sm and t.block_m <= 64]
    assert tiles and gluon_sm90.SUM_LAST_MAX_M <= 64
    for tile in tiles:
        dtype = getattr(torch, act)
        step_sum, ragged = scale_after(tile, dtype), gluon_sm90.ragged(tile, dtype)
        flags = ["0", str(producer_regs(tile)), "1" if step_sum else "0", "1", str(w2_rows(tile))]
        flags += ["1" if ragged else "0", "-", "1"]
        check_last_rows_build(_compile(tile, act, flags), f"{tile} {act} last")
