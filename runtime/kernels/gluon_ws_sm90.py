"""Hopper (sm_90) MoE GEMMs, warp-specialized and persistent: a producer warp fills the ring, a consumer
warpgroup dequantizes and keeps a wgmma in flight.

The same GEMMs, tiles, dequantization and epilogues as runtime/kernels/gluon_sm90.py; what differs is who moves the
bytes and when. ncu on gluon_sm90's kernels at M = 16-64 on the H200 (benchmarks/KERNEL_NOTES.md item 23): 2.3-2.5
TB/s of DRAM, 4 CTAs x 4 warps per SM (registers and shared memory both at their limit), half an instruction
issued per scheduler per cycle with under one warp eligible. Every warp there issues its share of the ring's
copies (address math per 16-byte copy), waits at a CTA barrier each K step, and the ring keeps a margin of two
stages, so STAGES - 2 steps are in flight; a program fills its ring once per tile and the grid ends in a partial
wave. Here:

- the producer (a worker partition: one warp for 16-token tiles, four past them, :func:`producer_warps`) waits
  until a stage is free, loads the step's weight words by TMA (one [64, 16] int32 box per 64 weight rows: w13's
  gate rows and its up rows, w2's 128 rows a consumer warpgroup) and the block's activations by cp.async (the token
  rows are gathered, which Hopper's TMA cannot do), and makes the stage's mbarrier complete when both have landed
  (TMA transaction bytes, and one cp.async arrival per lane);
- the consumer (the default partition: the tile's one or two warpgroups, 16 channels a warp) waits for the stage,
  dequantizes the words into the wgmma's register operand and keeps one wgmma in flight as gluon_sm90 does (ragged
  tiles, gluon_sm90.RAGGED_TILES, as wide as each block's pairs), and frees the stage as soon as the next step's
  first wgmma has retired the last one that read it: STAGES - 1 steps in flight, no CTA-wide barrier;
- the grid is persistent (a few programs per SM): each walks the live tiles pid, pid + P, ..., and the producer
  runs ahead into its next tile while the consumer is in the epilogue, so a short K (w2) pays no ring fill per
  tile and dead tiles (alignment bound past the real block count) cost no program.

- w2, where its sum is added into the target, takes an equal range of the flattened (tile, K step) work per
  program (stream-K, :data:`W2_STREAM_K`; optionally after whole waves, :data:`W2_WHOLE_WAVES`), not whole tiles:
  runtime/kernels/schedule.py deals the work lists both partitions walk.

gluon_sm90's family runs these for a tile with ``per_sm`` set (runtime/kernel_config.py; benchmarks/probe_gluon_ws.py
measures them against gluon_sm90's kernels on the same calls, KERNEL_NOTES items 25-26). Layout of the words: the
``mma128_tiles`` stacks of formats/SPEC.md section 3 (each box one contiguous 4 KB tile, read through the 2-D view
``[tiles * 64, 16]``), or ``mma128`` rows (each box 64 runs of 64 bytes, through ``[experts * rows, K / 8]``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from repack.formats.errors import RepackError
from repack.runtime.kernel_config import GluonTile
from repack.runtime.kernels import gluon_sm90
from repack.runtime.kernels.align import Alignment
from repack.runtime.kernels.common import await_previous_kernel, dependent_launches, tile_ids
from repack.runtime.kernels.schedule import STREAM_K, WAVES_THEN_STREAM_K, WHOLE_TILES, work_item, work_share
from repack.runtime.weights import MoeWeights

if gluon_sm90.available():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from repack.runtime.kernels.gluon_sm90 import (
        X_SMEM_LAYOUT,
        _accumulators,
        _chunks,
        _copy_x,
        _last_wait,
        _ragged_path,
        _step_quant,
        _step_words,
        _w2_store,
        _w13_store,
        _zero_share,
        acc_layout,
        ragged_paths,
        ragged_width,
        word_layout,
        x_layout,
        x_parts,
    )

BOX_ROWS = 64  # weight rows per TMA box: one warpgroup's wgmma M
_BOX_ROWS = gl.constexpr(BOX_ROWS) if gluon_sm90.available() else None
# Words of a K step as TMA writes them: [rows, 16] int32, 64-byte rows under the 64-byte swizzle (the fragment
# reads of word_layout hit distinct banks, as under gluon_sm90's 16-byte XOR swizzle).
W_TMA_LAYOUT = (
    gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2))
    if gluon_sm90.available()
    else None
)
# w2 runs here from this K (the intermediate size) up, else as gluon_sm90's one program per tile: on the H200 the
# persistent w2 lost at Qwen3-30B's K = 768 (6 steps a tile: +13-15%) and won at Mixtral's 14336 (M = 4-16, -8% and
# -15%), about even at Qwen2-57B's 2560 (benchmarks/RESULTS.md 2026-12-05 10:30 UTC, KERNEL_NOTES.md item 25).
# 1024 since w2 runs stream-K: on the H100 K = 1408-1536 gained 2-7 us a call at M = 4-64 (Qwen3-235B, Qwen1.5-MoE,
# DeepSeek-V2-Lite; only DeepSeek-V2-Lite M = 4 lost 1 us), K = 768 still lost at M = 64 (KERNEL_NOTES.md item 28).
W2_PERSISTENT_MIN_K = 1024
# ... and on token tiles up to this many: the 128-token tile's w2 persistent (exposed time, ragged) gained 0-12%
# over one program per tile at M = 1024 and lost 5-19% at M = 4096 on the H100 (benchmarks/RESULTS.md 2026-12-07
# 23:32 UTC, KERNEL_NOTES.md item 45: Qwen3-235B M = 4096 1127 against 999 us, DeepSeek-V3 2809 against 2369).
W2_PERSISTENT_MAX_M = 64
# Registers of the producer warp's warpgroup (setmaxnreg); the consumer takes the rest of maxnreg. 32, not 40: the
# producer needs no more (24 spills it), and what it leaves lets a step-scaled sum (bf16's) run at 4 programs per SM
# (gluon_sm90.persistent_fits): bf16 on the H100, Mixtral M = 16 285 against 316 us at 3 programs, Qwen2-57B M = 4
# 151 against 159; fp16's code and time unchanged (KERNEL_NOTES.md item 27). On tiled words that bf16 consumer spills
# 16 bytes, once per tile and never in its K loop (item 30).
PRODUCER_REGS = 32
ROOMY_PRODUCER_REGS = 40  # where 2 programs share an SM (maxnreg 128): see producer_regs
WIDE_PRODUCER_REGS = 56  # 128-token tiles: see producer_regs
# w2 (where its sum is added into the target, reduce "out"/"atomic") splits the flattened (tile, K step) work into one
# equal range per program (stream-K) instead of dealing whole tiles round-robin: a few live tiles of long K (Mixtral
# at M = 1-4: 128-352 tiles of 112 steps for 528 programs) left most programs idle, a partial last wave cost up to a
# tile's time elsewhere (KERNEL_NOTES.md item 26). A program's range ends mid-tile: its partial sum is added as is.
W2_STREAM_K = True
# ... and with W2_WHOLE_WAVES, every full wave of tiles but the last dealt whole first, round-robin, only the rest cut
# into ranges (kernels/schedule.py WAVES_THEN_STREAM_K; the same as stream-K where there are fewer tiles than two
# waves, as in Mixtral's decode). Why: the 128-token w2 persistent lost 5-19% at M = 4096 (item 45), where
# stream-K holds tiles a whole share apart at once (no L2 reuse of an expert's weights or a block's activations
# between neighbours) and splits tiles it need not. Off until measured (KERNEL_NOTES.md item 46).
W2_WHOLE_WAVES = False
# w2's weight rows per tile: 128, two boxes of words a K step as w13's gate and up boxes, so the consumer's fixed cost
# per step (barrier wait, fence, activations from shared memory) moves twice the bytes. H100, same process as Marlin
# (KERNEL_NOTES.md item 29): w2 at M = 4-64 against 64 rows 3-10% faster (DeepSeek-V3 M = 16 309 -> 281 us,
# Qwen3-235B M = 64 171 -> 154), never slower; a deeper ring of 64-row tiles had not helped (the step, not the bytes
# in flight, was the limit).
W2_ROWS = 128
# K steps of its first tile a dependent w2 program asks L2 for before it waits for w13 (:func:`_prefetch_first_steps`):
# 8 x 8 KB a program, 34 MB for 528 programs at most, under the H100's 50 MB L2.
PREFETCH_STEPS = 8
STREAM_K_MIN_STEPS = 4  # the least K steps a program takes (each range's epilogue adds a [W2_ROWS, block_m] sum)
_STREAM_K_MIN_STEPS = gl.constexpr(STREAM_K_MIN_STEPS) if gluon_sm90.available() else None


if gluon_sm90.available():

    @gluon.jit
    def _live_tiles(num_blocks_ptr, N, BLOCK_N: gl.constexpr):
        """(live tiles: the alignment's real blocks x weight-row tiles, weight-row tiles)."""
        n_tiles = gl.cdiv(N, BLOCK_N)
        return gl.load(num_blocks_ptr) * n_tiles, n_tiles

    @gluon.jit
    def _prefetch_first_steps(qw_ptr, block_experts_ptr, num_blocks_ptr, N, K, BLOCK_N: gl.constexpr,
                              GROUP_M: gl.constexpr, SPLIT: gl.constexpr, STEPS: gl.constexpr):  # fmt: skip
        """Before a dependent w2 waits for w13 (runtime/kernels/backend.py dependent_launch): the words of its first
        tile's first STEPS K steps asked of L2, every 128-byte line (``prefetch.global.L2``), so they stream while
        w13's last programs still run (a thin last round of whole tiles: KERNEL_NOTES.md items 32-33). The block
        count and the experts come from the alignment, two launches back, read past L1. "mma128_tiles" words only
        (``qw_ptr``: the stack's [E, N/64, K/128, 64, 16] int32)."""
        n_tiles = gl.cdiv(N, BLOCK_N)
        num_tiles = gl.load(num_blocks_ptr, cache_modifier=".cg") * n_tiles
        num_steps = K // 128
        pid, programs = gl.program_id(0), gl.num_programs(0)
        item, stop, _, whole, start, end = work_share(pid, programs, num_tiles, num_steps, SPLIT, _STREAM_K_MIN_STEPS)
        if item < stop:
            first, step0, step1 = work_item(item, pid, programs, whole, start, end, num_steps, SPLIT)
            pid_m, pid_n = tile_ids(first, num_tiles // n_tiles, n_tiles, GROUP_M)
            expert = gl.load(block_experts_ptr + pid_m, cache_modifier=".cg").to(gl.int64)
            BOXES: gl.constexpr = BLOCK_N // 64
            LINES: gl.constexpr = STEPS * BOXES * 32  # a box (64 rows of one K step) is 4 KB: 32 lines
            i = gl.arange(0, LINES, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
            step = gl.minimum(step0 + i // (BOXES * 32), step1 - 1)
            band = (expert * N + pid_n * BLOCK_N) // 64 + i // 32 % BOXES
            words = qw_ptr + (band * num_steps + step) * 1024 + i % 32 * 32
            gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [words], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip

    @gluon.jit
    def _producer(w_desc, src_ptr, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, w_smem, x_smem, ready, empty,
                  num_pairs, rows_per_expert, N, half_stride, K, stride_src, ROW_DIV: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, BOXES: gl.constexpr,
                  HALF_BOXES: gl.constexpr, SPLIT: gl.constexpr, TILES: gl.constexpr):  # fmt: skip
        """The worker partition: every K step of every tile of this program into the ring. A stage is ready when
        its TMA bytes (BOXES boxes of words) and each lane's cp.async copies (the activations) have landed.

        ``src_ptr`` rows hold the activations (x, one row per token: ROW_DIV = top-k; or inter, one per pair:
        ROW_DIV = 1). A tile's BOXES boxes of 64 rows come in runs of HALF_BOXES consecutive ones, the runs
        ``half_stride`` rows apart: w13's gate rows and, N rows further, its up rows (two runs of BLOCK_N / 64); w2's
        BLOCK_N consecutive rows (one run). TILES: "mma128_tiles" words, the box of rows r..r+63 and step s at row
        (r / 64 * steps + s) * 64 of the tiles' 2-D view (:func:`words_descriptor`); else "mma128" rows, at
        (r, 16 s)."""
        STAGES: gl.constexpr = w_smem.shape[0]
        X_PARTS: gl.constexpr = x_parts(BLOCK_M, gl.num_warps())
        PART_ROWS: gl.constexpr = 2 * BLOCK_M // X_PARTS
        r = gl.arange(0, PART_ROWS, layout=gl.SliceLayout(1, x_layout(gl.num_warps())))
        num_tiles, n_tiles = _live_tiles(num_blocks_ptr, N, BLOCK_N)
        num_steps = K // 128
        pid, programs = gl.program_id(0), gl.num_programs(0)
        first_item, stop, stride, whole, start, end = work_share(pid, programs, num_tiles, num_steps, SPLIT,
                                                                 _STREAM_K_MIN_STEPS)  # fmt: skip
        it = 0
        for i in range(first_item, stop, stride):
            t, step0, step1 = work_item(i, pid, programs, whole, start, end, num_steps, SPLIT)
            pid_m, pid_n = tile_ids(t, num_tiles // n_tiles, n_tiles, GROUP_M)
            pairs = gl.expand_dims(gl.load(sorted_pairs_ptr + pid_m * BLOCK_M + r % BLOCK_M), 1)
            token_rows = src_ptr + (pairs // ROW_DIV).to(gl.int64) * stride_src
            pair_mask = pairs < num_pairs
            row0 = gl.load(block_experts_ptr + pid_m) * rows_per_expert + pid_n * BLOCK_N
            for step in range(step0, step1):
                stage = it % STAGES
                mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                # The activations first: each lane's arrival raises the pending count now and lowers it when its
                # copies land, so the stage cannot complete on the TMA bytes alone.
                _copy_x(x_smem.index(stage), token_rows, pair_mask, src_ptr, step * 128, BLOCK_M, False)
                async_copy.mbarrier_arrive(ready.index(stage))
                mbarrier.expect(ready.index(stage), BOXES * w_desc.block_type.nbytes)
                w_stage = w_smem.index(stage)
                for box in gl.static_range(BOXES):
                    box_row = row0 + (box // HALF_BOXES) * half_stride + (box % HALF_BOXES) * _BOX_ROWS
                    if TILES:  # row r (a multiple of 64) at r * steps, step s 64 rows further
                        coords = [box_row * num_steps + step * _BOX_ROWS, 0]
                    else:
                        coords = [box_row, step * 16]
                    tma.async_copy_global_to_shared(w_desc, coords, ready.index(stage),
                                                    w_stage.slice(box * _BOX_ROWS, _BOX_ROWS))  # fmt: skip
                it += 1

    @gluon.jit
    def _tile_sum(w_smem, x_smem, ready, empty, it, scales_e, zeros_e, rows, rows_ok, step0, step1, stride_s_g,
                  ROWS: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_LEN: gl.constexpr, HAS_ZEROS: gl.constexpr,
                  SYM_ZERO: gl.constexpr, SCALE_AFTER: gl.constexpr, DTYPE: gl.constexpr,
                  N_A: gl.constexpr, N_B: gl.constexpr):  # fmt: skip
        """(acc [ROWS, N_A], acc_b [ROWS, N_B] or acc again where N_B is 0, ring position after the tile): the sums
        of one tile's K steps [step0, step1) from the ring of BLOCK_M token rows (the consumer's K loop) for its
        first N_A tokens and the N_B after them (:data:`gluon_sm90.RAGGED_TILES`; N_A = BLOCK_M, N_B = 0: the whole
        tile). Each stage is freed once the wgmmas after its last ones have been waited for (one chunk's stay in
        flight)."""
        STAGES: gl.constexpr = w_smem.shape[0]
        IS_FP16: gl.constexpr = gl.float16 == DTYPE
        ACC_LAYOUT: gl.constexpr = acc_layout(N_A, gl.num_warps())
        scale_rows = gl.convert_layout(rows, gl.SliceLayout(1, ACC_LAYOUT))
        scale_ok = gl.convert_layout(rows_ok, gl.SliceLayout(1, ACC_LAYOUT))
        acc, part, acc_b = _accumulators(ROWS, N_A, N_B)
        scale, bias2, odd2 = _step_quant(scales_e, zeros_e, rows, rows_ok, scale_rows, scale_ok,
                                         step0 * 128 // GROUP_LEN, stride_s_g, HAS_ZEROS, SYM_ZERO, IS_FP16,
                                         SCALE_AFTER)  # fmt: skip
        for step in range(step0, step1):
            stage = it % STAGES
            k_next = gl.minimum(step + 1, step1 - 1) * 128
            next_quant = _step_quant(scales_e, zeros_e, rows, rows_ok, scale_rows, scale_ok, k_next // GROUP_LEN,
                                     stride_s_g, HAS_ZEROS, SYM_ZERO, IS_FP16, SCALE_AFTER)  # fmt: skip
            mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
            fence_async_shared()  # the activations came by cp.async (generic proxy); the wgmma reads them (async)
            low, high = _step_words(w_smem.index(stage), ROWS)
            x_stage = x_smem.index(stage)
            acc, part, acc_b = _chunks(low, high, x_stage, acc, part, acc_b, scale, bias2, odd2, 0, 1, IS_FP16, DTYPE,
                                       BLOCK_M, SCALE_AFTER, N_A, N_B)  # fmt: skip
            # The previous step's last wgmma has retired (one stays in flight): its stage may be refilled, after
            # this warpgroup's reads of it are ordered before the TMA's writes.
            fence_async_shared()
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=step > step0)
            acc, part, acc_b = _chunks(low, high, x_stage, acc, part, acc_b, scale, bias2, odd2, 1, 8, IS_FP16, DTYPE,
                                       BLOCK_M, SCALE_AFTER, N_A, N_B)  # fmt: skip
            scale, bias2, odd2 = next_quant
            it += 1
        acc, acc_b = _last_wait(acc, acc_b, N_B, SCALE_AFTER)
        fence_async_shared()
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))  # the tile's last stage
        return acc, acc_b, it

    @gluon.jit
    def _w13_tile(w_smem, x_smem, ready, empty, it, scales_e, zeros_e, rows, channels, inter_ptr, sorted_pairs_ptr,
                  first, pid_n, num_pairs, N, K, stride_s_g, stride_inter, GROUP_LEN: gl.constexpr,
                  SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  SCALE_AFTER: gl.constexpr, N_A: gl.constexpr, N_B: gl.constexpr):  # fmt: skip
        """One w13 tile, its first N_A tokens (and the N_B after them): the sums, then their stores; the ring
        position after it."""
        DTYPE: gl.constexpr = x_smem.dtype
        acc, acc_b, it = _tile_sum(w_smem, x_smem, ready, empty, it, scales_e, zeros_e, rows, channels < N, 0,
                                   K // 128, stride_s_g, 2 * BLOCK_N, BLOCK_M, GROUP_LEN, HAS_ZEROS, SYM_ZERO,
                                   SCALE_AFTER, DTYPE, N_A, N_B)  # fmt: skip
        _w13_store(acc, acc_b, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_inter, BLOCK_N, N_A, N_B,
                   True)  # fmt: skip
        return it

    @gluon.jit
    def _w13_consumer(w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, inter_ptr, sorted_pairs_ptr,
                      block_experts_ptr, num_blocks_ptr, num_pairs, N, K, stride_s_e, stride_s_g, stride_inter,
                      GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, SCALE_AFTER: gl.constexpr,
                      DTYPE: gl.constexpr, RAGGED: gl.constexpr):  # fmt: skip
        """inter[pair, n] = silu(gate_n . x) * (up_n . x) for every tile of this program (gluon_sm90's epilogue);
        RAGGED: each tile's MMAs as wide as its real pairs need (:data:`gluon_sm90.RAGGED_TILES`)."""
        ROWS: gl.constexpr = 2 * BLOCK_N
        WORD_LAYOUT: gl.constexpr = word_layout(ROWS, gl.num_warps())
        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, WORD_LAYOUT))
        num_tiles, n_tiles = _live_tiles(num_blocks_ptr, N, BLOCK_N)
        first_item, stop, stride, _, _, _ = work_share(gl.program_id(0), gl.num_programs(0), num_tiles, K // 128,
                                                       WHOLE_TILES, _STREAM_K_MIN_STEPS)  # fmt: skip
        it = 0
        for t in range(first_item, stop, stride):  # whole tiles: each item is its tile, every K step
            pid_m, pid_n = tile_ids(t, num_tiles // n_tiles, n_tiles, GROUP_M)
            expert = gl.load(block_experts_ptr + pid_m).to(gl.int64)
            channels = pid_n * BLOCK_N + offs_r % BLOCK_N
            rows = channels + (offs_r // BLOCK_N) * N
            first = pid_m * BLOCK_M
            # fmt: off
            args = (w_smem, x_smem, ready, empty, it, scales_ptr + expert * stride_s_e, zeros_ptr + expert * stride_s_e,
                    rows, channels, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, K, stride_s_g,
                    stride_inter)  # the runtime arguments (a tuple's constexprs would turn into tensors)
            path = _ragged_path(sorted_pairs_ptr, first, num_pairs, BLOCK_M, RAGGED)
            for p in gl.static_range(ragged_paths(RAGGED)):  # one K loop per width; a tile runs one
                if path == p:
                    it = _w13_tile(*args, GROUP_LEN, SYM_ZERO, HAS_ZEROS, BLOCK_M, BLOCK_N, SCALE_AFTER,
                                   ragged_width(BLOCK_M, p, 0), ragged_width(BLOCK_M, p, 1))
            # fmt: on

    @gluon.jit
    def _w2_tile(w_smem, x_smem, ready, empty, it, scales_e, zeros_e, rows, step0, step1, topk_weights_ptr, out_ptr,
                 sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_s_g, stride_out, summed, TOP_K: gl.constexpr,
                 GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr, ATOMIC: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SCALE_AFTER: gl.constexpr, N_A: gl.constexpr,
                 N_B: gl.constexpr, SUM_LAST: gl.constexpr):  # fmt: skip
        """One w2 tile's K steps [step0, step1), its first N_A tokens (and the N_B after them): the sums, then their
        weighted stores or adds; the ring position after it."""
        DTYPE: gl.constexpr = x_smem.dtype
        acc, acc_b, it = _tile_sum(w_smem, x_smem, ready, empty, it, scales_e, zeros_e, rows, rows < N, step0, step1,
                                   stride_s_g, BLOCK_N, BLOCK_M, GROUP_LEN, HAS_ZEROS, SYM_ZERO, SCALE_AFTER, DTYPE,
                                   N_A, N_B)  # fmt: skip
        _w2_store(acc, acc_b, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_out,
                  summed, TOP_K, ATOMIC, BLOCK_N, N_A, N_B, SUM_LAST)  # fmt: skip
        return it

    @gluon.jit
    def _w2_consumer(w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr,
                     sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, num_pairs, N, K, stride_s_e, stride_s_g,
                     stride_out, summed, TOP_K: gl.constexpr, GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr,
                     HAS_ZEROS: gl.constexpr, ATOMIC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     GROUP_M: gl.constexpr, SCALE_AFTER: gl.constexpr, DTYPE: gl.constexpr,
                     SPLIT: gl.constexpr, RAGGED: gl.constexpr, SUM_LAST: gl.constexpr):  # fmt: skip
        """out[pair or token, n] (+)= w[pair] * (W2[e] @ inter[pair])[n] for every tile, or piece of a tile, of this
        program's work list (kernels/schedule.py, SPLIT); RAGGED as the w13 consumer."""
        WORD_LAYOUT: gl.constexpr = word_layout(BLOCK_N, gl.num_warps())
        offs_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WORD_LAYOUT))
        num_tiles, n_tiles = _live_tiles(num_blocks_ptr, N, BLOCK_N)
        num_steps = K // 128
        pid, programs = gl.program_id(0), gl.num_programs(0)
        first_item, stop, stride, whole, start, end = work_share(pid, programs, num_tiles, num_steps, SPLIT,
                                                                 _STREAM_K_MIN_STEPS)  # fmt: skip
        it = 0
        for i in range(first_item, stop, stride):
            t, step0, step1 = work_item(i, pid, programs, whole, start, end, num_steps, SPLIT)
            pid_m, pid_n = tile_ids(t, num_tiles // n_tiles, n_tiles, GROUP_M)
            expert = gl.load(block_experts_ptr + pid_m).to(gl.int64)
            first = pid_m * BLOCK_M
            # fmt: off
            args = (w_smem, x_smem, ready, empty, it, scales_ptr + expert * stride_s_e, zeros_ptr + expert * stride_s_e,
                    pid_n * BLOCK_N + offs_r, step0, step1, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n,
                    num_pairs, N, stride_s_g, stride_out, summed)  # the runtime arguments, as in the w13 consumer
            path = _ragged_path(sorted_pairs_ptr, first, num_pairs, BLOCK_M, RAGGED)
            for p in gl.static_range(ragged_paths(RAGGED)):  # as the w13 consumer
                if path == p:
                    it = _w2_tile(*args, TOP_K, GROUP_LEN, SYM_ZERO, HAS_ZEROS, ATOMIC, BLOCK_M, BLOCK_N, SCALE_AFTER,
                                  ragged_width(BLOCK_M, p, 0), ragged_width(BLOCK_M, p, 1), SUM_LAST)
            # fmt: on

    @gluon.jit
    def _ring(DTYPE: gl.constexpr, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The shared ring (words [STAGES, ROWS, 16], activations [STAGES, 2 * BLOCK_M, 64]) and its barriers,
        initialised: ``ready`` completes once per fill (one expected arrival, the TMA bytes, the lanes' cp.async
        arrivals), ``empty`` once per release (the consumer's one arrival)."""
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 16], W_TMA_LAYOUT)
        x_smem = gl.allocate_shared_memory(DTYPE, [STAGES, 2 * BLOCK_M, 64], X_SMEM_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        return w_smem, x_smem, ready, empty

    @gluon.jit
    def _w13_ws_kernel(
        w_desc, x_ptr, scales_ptr, zeros_ptr, inter_ptr, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
        zero_ptr, num_pairs, N, K, zero_numel, stride_x, stride_s_e, stride_s_g, stride_inter,
        TOP_K: gl.constexpr, GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr,
        ZERO_OUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
        STAGES: gl.constexpr, SCALE_AFTER: gl.constexpr, PRODUCER_REGS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
        TILES: gl.constexpr, RAGGED: gl.constexpr = False, DEPENDENT: gl.constexpr = False,
    ):  # fmt: skip
        """inter = silu(x W_gate^T) * (x W_up^T) over the aligned blocks; with ZERO_OUT also ``zero_ptr[:zero_numel]
        = 0`` (the target w2 adds the top-k into)."""
        DTYPE: gl.constexpr = x_ptr.dtype.element_ty
        await_previous_kernel(DEPENDENT)
        if ZERO_OUT:
            _zero_share(zero_ptr, zero_numel)
        w_smem, x_smem, ready, empty = _ring(DTYPE, 2 * BLOCK_N, BLOCK_M, STAGES)
        # fmt: off
        gl.warp_specialize([
            (_w13_consumer, (w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, inter_ptr, sorted_pairs_ptr,
                             block_experts_ptr, num_blocks_ptr, num_pairs, N, K, stride_s_e, stride_s_g, stride_inter,
                             GROUP_LEN, SYM_ZERO, HAS_ZEROS, BLOCK_M, BLOCK_N, GROUP_M, SCALE_AFTER, DTYPE, RAGGED)),
            (_producer, (w_desc, x_ptr, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, w_smem, x_smem, ready,
                         empty, num_pairs, 2 * N, N, N, K, stride_x, TOP_K, BLOCK_M, BLOCK_N, GROUP_M,
                         2 * BLOCK_N // _BOX_ROWS, BLOCK_N // _BOX_ROWS, WHOLE_TILES, TILES)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
        # fmt: on

    @gluon.jit
    def _w2_ws_kernel(
        w_desc, qw_ptr, inter_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr, sorted_pairs_ptr,
        block_experts_ptr, num_blocks_ptr, sum_ptr, counts_ptr, num_pairs, N, K, stride_inter, stride_s_e, stride_s_g,
        stride_out, stride_sum, TOP_K: gl.constexpr, GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr,
        HAS_ZEROS: gl.constexpr, ATOMIC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        GROUP_M: gl.constexpr, STAGES: gl.constexpr, SCALE_AFTER: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, SPLIT: gl.constexpr, TILES: gl.constexpr, RAGGED: gl.constexpr = False,
        DEPENDENT: gl.constexpr = False, PREFETCH: gl.constexpr = 0, SUM_LAST: gl.constexpr = False,
    ):  # fmt: skip
        """out (+)= route weight * inter W2^T over the aligned blocks, each program's work list dealt as SPLIT says
        (kernels/schedule.py; pieces of tiles only where the sum is added, ATOMIC). A dependent launch on tiled words
        first asks L2 for its first PREFETCH steps. SUM_LAST: out holds per-pair rows, each token's summed into
        ``sum_ptr`` where its last one is written (gluon_sm90._sum_last_rows; whole tiles)."""
        DTYPE: gl.constexpr = inter_ptr.dtype.element_ty
        if DEPENDENT and TILES and PREFETCH > 0:
            _prefetch_first_steps(qw_ptr, block_experts_ptr, num_blocks_ptr, N, K, BLOCK_N, GROUP_M, SPLIT,
                                  PREFETCH)  # fmt: skip
        await_previous_kernel(DEPENDENT)
        w_smem, x_smem, ready, empty = _ring(DTYPE, BLOCK_N, BLOCK_M, STAGES)
        # fmt: off
        gl.warp_specialize([
            (_w2_consumer, (w_smem, x_smem, ready, empty, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr,
                            sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, num_pairs, N, K, stride_s_e,
                            stride_s_g, stride_out, (sum_ptr, counts_ptr, stride_sum), TOP_K, GROUP_LEN, SYM_ZERO,
                            HAS_ZEROS, ATOMIC, BLOCK_M, BLOCK_N, GROUP_M, SCALE_AFTER, DTYPE, SPLIT, RAGGED,
                            SUM_LAST)),
            (_producer, (w_desc, inter_ptr, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, w_smem, x_smem,
                         ready, empty, num_pairs, N, N, 0, K, stride_inter, 1, BLOCK_M, BLOCK_N, GROUP_M,
                         BLOCK_N // _BOX_ROWS, BLOCK_N // _BOX_ROWS, SPLIT, TILES)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
        # fmt: on


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------


def words_descriptor(qweight: torch.Tensor, tiled: bool) -> TensorDescriptor:
    """The TMA view of a stack's words in boxes of [BOX_ROWS, 16] (one K step): "mma128_tiles" ``[E, R/64, K/128,
    64, 16]`` as ``[E * R/64 * K/128 * 64, 16]`` (``tiled``: each box one tile), "mma128" ``[E, R, K/8]`` as
    ``[E * R, K/8]``. A view: words that are not one dense run are refused, never copied per call."""
    if not qweight.is_contiguous():
        raise RepackError(
            f"gluon_ws_sm90: words {list(qweight.shape)} with strides {list(qweight.stride())} are not one dense run, "
            "which the TMA reads; pass contiguous qweights (a loaded checkpoint's are)"
        )
    view = qweight.view(-1, 16) if tiled else qweight.view(-1, qweight.shape[-1])
    return TensorDescriptor.from_tensor(view, [BOX_ROWS, 16], W_TMA_LAYOUT.value)


def producer_regs(tile: GluonTile) -> int:
    """The producer warpgroup's registers for ``tile``: :data:`PRODUCER_REGS`, or ROOMY_PRODUCER_REGS where at most
    two programs share an SM (at 32 the w2 producer of tiled words spilled 8 bytes: its stream-K bounds beside the
    tile coordinates), or WIDE_PRODUCER_REGS for 128-token tiles, whose producer keeps 8 token rows a thread (at 40
    it spilled 36-44 bytes). The consumer takes the rest: 216 registers at 2 programs an SM, 224-232 at one
    (tests/runtime/test_gluon_ws_compile_sm90.py compiles each)."""
    if tile.per_sm > 2:
        return PRODUCER_REGS
    return max(PRODUCER_REGS, WIDE_PRODUCER_REGS if tile.block_m >= 128 else ROOMY_PRODUCER_REGS)


def producer_warps(tile: GluonTile) -> int:
    """The producer's warps: one for 16-token tiles (what was measured), a warpgroup's four past them, whose token
    rows one warp could not hold (a 64-token tile's producer warp spilled 592 bytes at 40 registers, two warps 32; four
    none). They cost no registers: the producer's warpgroup is allocated whole either way."""
    return 1 if tile.block_m <= 16 else 4


def w2_rows(tile: GluonTile) -> int:
    """w2's weight rows per tile: :data:`W2_ROWS` per consumer warpgroup."""
    return W2_ROWS * tile.warps // 4


def w2_split(atomic: bool) -> int:
    """How w2's programs deal its work (kernels/schedule.py): in ranges (:data:`W2_STREAM_K`, after whole waves with
    :data:`W2_WHOLE_WAVES`) where its sum is added (``atomic``: a piece of a tile adds its partial sum), else whole
    tiles."""
    if not (atomic and W2_STREAM_K):
        return int(WHOLE_TILES)
    return int(WAVES_THEN_STREAM_K if W2_WHOLE_WAVES else STREAM_K)


def programs(tiles: int, device: torch.device, per_sm: int) -> int:
    """The persistent grid: ``per_sm`` programs on every SM, never more than the tiles the alignment allows."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, sms * per_sm))


def launch(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H; [P, H] with x_per_pair
    weights: MoeWeights,  # an mma128 stack without act-order (gluon_sm90.reads)
    topk_ids: torch.Tensor,  # [M, T]
    topk_weights: torch.Tensor,  # [M, T] fp32
    rows: Alignment,  # pairs sorted by expert into blocks of tile.block_m
    inter: torch.Tensor,  # [P, I] activation dtype
    target: torch.Tensor,  # [P, H] ("pairs", "last") or [M, H] added to ("out", "atomic")
    tile: GluonTile,  # block_m tokens, 16 channels a consumer warp (w13: 32 rows; w2: W2_ROWS a warpgroup), per_sm > 0
    reduce: str,  # "pairs", "out", "atomic" or "last" (runtime/kernel_config.py)
    x_per_pair: bool = False,  # x is [P, H], one row per pair (act-order rows gathered by kernels/act_order.py)
    out: torch.Tensor | None = None,  # [M, H]: where "last" sums each token's rows
) -> None:
    """w13 then w2, warp-specialized and persistent (``tile.per_sm`` programs per SM, their register cap
    ``tile.registers``), on the same inputs as :func:`gluon_sm90.launch`; a w2 of K below
    :data:`W2_PERSISTENT_MIN_K` or of a tile past :data:`W2_PERSISTENT_MAX_M` tokens as gluon_sm90's."""
    if weights.w13_perm is not None or not tile.per_sm or rows.block_m != tile.block_m:
        raise ValueError(f"gluon_ws_sm90.launch: tile {tile} / act-order: a per_sm tile and plain stacks")
    atomic = gluon_sm90.adds_into_target(reduce)
    top_k, h, n_inter, num_pairs = topk_ids.shape[1], weights.hidden_size, weights.intermediate_size, topk_ids.numel()
    w2_persistent = n_inter >= W2_PERSISTENT_MIN_K and tile.block_m <= W2_PERSISTENT_MAX_M
    tile2 = tile if w2_persistent else replace(tile, per_sm=0)  # the one-program w2 where it runs
    rows2 = w2_rows(tile) if w2_persistent else tile2.w2_rows
    cleared, numel, counts = gluon_sm90.cleared_by_w13(reduce, target, topk_ids.shape[0], h, rows2)
    zeros13 = weights.w13_zeros if weights.w13_zeros is not None else weights.w13_scales
    has_zeros = weights.w13_zeros is not None
    s13 = weights.w13_scales
    common = dict(SYM_ZERO=8, HAS_ZEROS=has_zeros, BLOCK_M=tile.block_m, GROUP_M=tile.group_m, STAGES=tile.stages,
                  TILES=weights.tiled,
                  SCALE_AFTER=gluon_sm90.scale_after(tile, x.dtype), PRODUCER_REGS=producer_regs(tile),
                  PRODUCER_WARPS=producer_warps(tile), num_warps=tile.warps, maxnreg=tile.registers,
                  RAGGED=gluon_sm90.ragged(tile, x.dtype), **dependent_launches(x.device))  # fmt: skip
    grid13 = (programs(rows.max_blocks * triton.cdiv(n_inter, tile.block_n), x.device, tile.per_sm),)
    _w13_ws_kernel[grid13](
        words_descriptor(weights.w13_qweight, weights.tiled), x, s13, zeros13, inter, rows.sorted_pairs,
        rows.block_experts,
        rows.num_blocks, cleared, num_pairs, n_inter, h, numel, x.stride(0), s13.stride(0), s13.stride(1),
        inter.stride(0), TOP_K=1 if x_per_pair else top_k, GROUP_LEN=weights.group_len(h), ZERO_OUT=numel > 0,
        BLOCK_N=tile.block_n, **common,
    )  # fmt: skip
    if not w2_persistent:
        gluon_sm90.launch_w2(inter, weights, topk_ids, topk_weights, rows, target, tile2, reduce, out, counts)
        return
    zeros2 = weights.w2_zeros if weights.w2_zeros is not None else weights.w2_scales
    s2 = weights.w2_scales
    sum_ptr, counts_ptr, stride_sum = gluon_sm90.last_sum_args(reduce, target, out, counts)
    work2 = rows.max_blocks * triton.cdiv(h, rows2)  # tiles at most; split: ranges of STREAM_K_MIN_STEPS at most
    if w2_split(atomic) != WHOLE_TILES:
        work2 = triton.cdiv(work2 * (n_inter // 128), STREAM_K_MIN_STEPS)
    grid2 = (programs(work2, x.device, tile.per_sm),)
    _w2_ws_kernel[grid2](
        words_descriptor(weights.w2_qweight, weights.tiled), weights.w2_qweight, inter, s2, zeros2, topk_weights,
        target, rows.sorted_pairs, rows.block_experts, rows.num_blocks, sum_ptr, counts_ptr, num_pairs, h, n_inter,
        inter.stride(0), s2.stride(0), s2.stride(1), target.stride(0), stride_sum, TOP_K=top_k,
        GROUP_LEN=weights.group_len(n_inter), ATOMIC=atomic, BLOCK_N=rows2, SPLIT=w2_split(atomic),
        PREFETCH=PREFETCH_STEPS, SUM_LAST=reduce == "last", **common,
    )  # fmt: skip
