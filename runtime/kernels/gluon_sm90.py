"""Hopper (sm_90) weight-major MoE kernels in Gluon: dequantization overlaps an asynchronous wgmma.

The same GEMMs as runtime/kernels/weight_major.py (``out^T = W @ x^T``: the dequantized int4 weights are the
register A operand of the tensor core, the tokens its N side), written in Gluon, Triton's layout-explicit
dialect, because Triton 3.6 waits for every register-operand ``tl.dot`` to finish before the next instruction
(``wgmma.wait_group 0``, benchmarks/KERNEL_NOTES.md item 14): a warpgroup never dequantized while its MMA ran.
Here each K step of 128 issues eight 16-deep wgmmas asynchronously and waits with one left in flight, so chunk
``c + 1`` is dequantized while the MMA of chunk ``c`` runs.

Data flow of one program (one expert's token block x one tile of weight rows; one warpgroup of 64 rows per
instruction, or two sharing the block's activations over 256 rows for large batches):

- A shared-memory ring of K steps, filled by cp.async STAGES - 2 steps ahead with one barrier per step: each
  weight row's 16 int32 words (16-byte copies, swizzled in 16-byte units), and the block's activations as
  [tokens, 64] half steps under the 128-byte swizzle (eight threads move a token's 128 contiguous bytes: one
  conflict-free wavefront; act-order gathers its permuted columns through registers). A 16-column slice of a
  half step is a chunk's wgmma B operand. Why this layout: benchmarks/KERNEL_NOTES.md item 16.
- The words are read from the ring in the layout a thread needs for its share of the wgmma A fragment: rows
  ``r`` and ``r + 8`` of its warp's 16, words ``t`` and ``t + 4`` of each half step (``t`` = lane % 4). In the
  ``mma128`` word order (formats/SPEC.md section 3) fields ``i`` and ``4 + i`` of word ``8g + m`` are inputs
  ``2m, 2m + 1`` of chunk ``4g + i``, so one LOP3 ``(w >> 4i) & 0x000F000F | 0x64006400`` is the fp16x2
  register that thread holds, and the conversion to the A operand layout moves nothing
  (``convert_layout(..., assert_trivial=True)``).
- One inline-PTX sequence per word and chunk dequantizes two weights: LOP3, a packed add of ``-(bias + zero)``
  (exact), a packed multiply by the scale (one rounding, as GPTQModel's ``fp16(scale * (q - zero))``). fp16
  odd chunks keep their nibble four bits up and fold the shift into an FMA by 1/16 (exact), as the tl kernels do.
  bf16 multiplies by the fp16 scale split into two bf16 parts (one more instruction per two weights), except
  in token tiles of up to 32 (:func:`scale_after`): there the MMA sums exact ``q - zero`` times x over each K
  step and the step's fp32 sum is multiplied by the group's scale.
- w13: gate rows ``n`` and up rows ``I + n`` of the same channels form one A tile of ``2 * BLOCK_N`` rows, so
  the epilogue splits one accumulator into ``silu(gate) * up``. w2: routing weight in fp32, then fp32 atomics
  into [M, H] (the top-k sum) or one row per pair.

The kernels build their layouts themselves, from their tile constexprs and warp count (``gluon.constexpr_function``
helpers below): a launch passes the tile, nothing about how threads hold it.

Needs an ``mma128`` stack (4-bit, K % 128 == 0, groups a multiple of 128 or -1) and a GPU of compute
capability 9.0; :func:`available` says whether this Triton has the Gluon Hopper API at all. The ``gluon_sm90``
family (:data:`FAMILY`): aligned row blocks of its tile's ``block_m``, w13 clearing the [M, H] target w2 adds the
top-k into; where it does not run, a ``gluon_sm90`` config's tl tile runs on the weight-major kernels.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import torch
import triton

from repack.runtime.kernel_config import Family, GluonTile, KernelConfig
from repack.runtime.kernels import weight_major
from repack.runtime.kernels.act_order import gather_act_order
from repack.runtime.kernels.align import Alignment
from repack.runtime.kernels.backend import interpreter_active
from repack.runtime.kernels.common import await_previous_kernel, dependent_launches, tile_ids, word_rows, word_strides
from repack.runtime.kernels.family import Call, KernelFamily, TopkSum, Work
from repack.runtime.weights import MoeWeights

try:  # Gluon's Hopper API (Triton >= 3.5); the portable tl kernels serve where it is missing.
    from triton.experimental import gluon
    from triton.experimental.gluon import constexpr_function
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _IMPORT_ERROR: Exception | None = None
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    _IMPORT_ERROR = exc

STEP_K = 128  # K values per step: 16 int32 words per row, eight 16-deep wgmmas
PORTABLE_ENV = "REPACK_PORTABLE_KERNELS"  # "1": never these kernels (the tl kernels everywhere)
WS_ENV = "REPACK_GLUON_WS"  # "0": one program per tile, never the warp-specialized kernels (a tile's per_sm ignored)
GLUON_ENV = "REPACK_GLUON_KERNELS"  # "1": these kernels for every aligned tensor-core call they can run, their tile
# Act-order stacks: each pair's row gathered once (kernels/act_order.py), then the plain kernels; False keeps the
# in-loop column gather (the comparison benchmarks/probe_glue.py measures).
ACT_ORDER_GATHER = True
SCALE_AFTER_MAX_BLOCK_M = 32  # bf16 token tiles up to this scale each K step's sum (scale_after); 0: never
# fp16's persistent tiles scale each K step's sum too: 308 instead of 360 instructions per K step in the
# warp-specialized consumer. Measured no faster (H100: Mixtral M = 16 299.7 against 288.1 us, Qwen3-235B 318.4
# against 316.5; the consumer waits on latency, not issue: KERNEL_NOTES.md items 23, 27), so off; probe_gluon_ws's
# "-sa" variants switch it on.
SCALE_AFTER_FP16_PERSISTENT = False
# A tile of 64 or 128 tokens whose block holds few real pairs (an expert's last block: the alignment pads each
# expert's rows to whole blocks, KERNEL_NOTES.md item 42) runs MMAs only as wide as they need: its first quarter,
# half, half and a quarter (two accumulators), or all of it, chosen per tile from the sorted pairs (the sentinel
# fills a block from its last real pair on). The weights are dequantized once either way; the tensor cores, the
# limit from 64 tokens up, skip what would only be padding. Four K loops compiled per kernel. Measured on the
# H100 (benchmarks/RESULTS.md 2026-12-07 23:32 UTC, KERNEL_NOTES.md item 45): the 128-token tile one program per
# tile, ragged, made calls 4-13% faster at M = 1024 and 4096 on six of seven shapes (DeepSeek-V2-Lite M = 1024 +2%,
# bf16 within 1%); the 64-token tile one program per tile 4-18% slower (its w13: DeepSeek-V3 M = 1024 1853 -> 2245
# us), so that one stays whole (RAGGED_ONE_PROGRAM_MIN_M); the persistent 64-token tile on 8 warps ran ragged in the
# mid variant that won (MID_PER_SM).
RAGGED_TILES = True
RAGGED_ONE_PROGRAM_MIN_M = 128
# reduce "last" (w2 sums each token's rows where the last one lands: _sum_last_rows) on token tiles up to this many;
# wider ones write "pairs" rows for kernels/topk_sum.py. Each summing tile waits one L2 round trip for its tickets
# and one per piece of columns for the rows; a 16-token tile sums its few tokens in one piece, a 128-token one in 8.
SUM_LAST_MAX_M = 32


def available() -> bool:
    """Whether the installed Triton ships the Gluon Hopper API these kernels are written in."""
    return _IMPORT_ERROR is None


def runs_on(device: torch.device) -> bool:
    """Whether these kernels can run on ``device``: a CUDA (not ROCm) GPU of compute capability 9.0, kernels
    compiled rather than interpreted (Gluon has no interpreter), and a Triton that ships Gluon's Hopper API."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return available() and not interpreter_active() and torch.cuda.get_device_capability(device) == (9, 0)


def reads(weights: MoeWeights) -> bool:
    """Whether these kernels read this stack: mma128 words (4-bit, K % 128 == 0, groups a multiple of 128)."""
    return weights.mma_order and weights.bits == 4


# The 16-token tile, warp-specialized and persistent: 4 programs on every SM (probe_gluon_ws on the H200, fp16,
# M = 4-64: Qwen2-57B 17-20% and Mixtral 9-28% faster than one program per tile, KERNEL_NOTES.md item 25).
PERSISTENT_16 = GluonTile(16, 64, 1, 4, per_sm=4)
WIDE_TILE = GluonTile(128, 128, 8, 4, 8)  # past WIDE_FROM_ROWS rows per expert


def persistent_fits(tile: GluonTile, weights: MoeWeights, dtype: torch.dtype) -> bool:
    """Whether the warp-specialized kernels run ``tile`` without spilling in their K loops: at 4 programs per SM (64
    registers a thread) symmetric stacks do, in fp16 and in bf16; a step-scaled sum (:func:`scale_after`: bf16's, or
    fp16's on request) fits there only beside a producer of 32 registers (gluon_ws_sm90.PRODUCER_REGS, 36 spilled
    loads and stores beside 40; on tiled words 16 bytes once per tile, KERNEL_NOTES.md item 30), asymmetric zeros not
    at all (tests/runtime/test_gluon_ws_compile_sm90.py compiles each case
    this admits). Act-order stacks only with their rows gathered first (:data:`ACT_ORDER_GATHER`): these kernels
    have no column gather."""
    from repack.runtime.kernels import gluon_ws_sm90  # it imports this module

    gathered = weights.w13_perm is None or ACT_ORDER_GATHER
    if tile.per_sm != 4:
        return gathered
    step_sum = scale_after(tile, dtype)
    fits = gluon_ws_sm90.PRODUCER_REGS <= 32 if step_sum else dtype == torch.float16
    return gathered and weights.w13_zeros is None and fits


def fitted_tile(tile: GluonTile, weights: MoeWeights, dtype: torch.dtype) -> GluonTile:
    """``tile`` as it runs: at 4 programs per SM where that fits, else at 3 (asymmetric zeros: 80 registers; 3
    programs with zeros on the H200, Qwen2-57B M = 4: 156 against 164 us for one program per tile, KERNEL_NOTES.md
    item 26), else one program per tile (this module's kernels), which $WS_ENV = "0" forces."""
    if not tile.per_sm:
        return tile
    if os.environ.get(WS_ENV, "") == "0":
        return replace(tile, per_sm=0)
    for per_sm in (tile.per_sm, 3) if tile.per_sm > 3 else (tile.per_sm,):
        if persistent_fits(replace(tile, per_sm=per_sm), weights, dtype):
            return replace(tile, per_sm=per_sm)
    return replace(tile, per_sm=0)


# The heuristic past the 32-token tile: the 64-token tile on MID_WARPS warps (4: one warpgroup, 64 channels; 8: two
# sharing the activations over 128) and MID_STAGES ring stages up to WIDE_FROM_ROWS rows per expert, the 128-token
# tile on two warpgroups past them. Plain numbers, so the anchor's variants can patch them
# (``project:gluon_sm90.WIDE_FROM_ROWS=512``). A wider token tile pads each expert's rows further: at 64 rows per
# expert under uniform routing the 128-token tile computes twice the rows it keeps, the 64-token one 1.5 times
# (KERNEL_NOTES.md item 42).
MID_STAGES = 4
WIDE_FROM_ROWS = 48
# Persistent programs an SM for the 64-token (MID_PER_SM: 2 on 4 warps, 1 on 8) and 128-token (WIDE_PER_SM: 1) tiles:
# the warp-specialized kernels (kernels/gluon_ws_sm90.py), whose producer fills the next tile's stages while the
# consumers finish this one, where one program per tile pays its ring's fill and its epilogue with the tensor cores
# idle (a third of a six-step w2 tile's instructions, KERNEL_NOTES.md item 42). 0: one program per tile. Measured
# on the H100 (benchmarks/RESULTS.md 2026-12-07 23:32 UTC, KERNEL_NOTES.md item 45): the 64-token tile on 8 warps,
# persistent and ragged, took Qwen2-57B M = 256 and DeepSeek-V3 M = 1024 (32 rows an expert) 15% and 10% below the
# 4-warp tile one program per tile (whole calls); the 128-token tile's w13 persistent and ragged ran 1-15% faster per
# launch than one program per tile, ragged, at M = 1024-4096 on all but Mixtral M = 1024 (+4%); its w2 lost at
# M = 4096 (gluon_ws_sm90.W2_PERSISTENT_MAX_M). That pair as shipped (persistent w13, one-program w2) is composed
# from those launches: the next run times it whole (KERNEL_NOTES.md, "Next GPU session").
MID_WARPS = 8
MID_PER_SM = 1
WIDE_PER_SM = 1
# The 32-token tile up to SMALL_TO_ROWS rows per expert in fp16 (bf16: 48, see heuristic_tile), at SMALL_PER_SM
# persistent programs an SM (0 or 2). DeepSeek-V3 at M = 1024 has 32 rows an expert: the 64-token tile there computes
# twice the rows it keeps (KERNEL_NOTES.md item 42).
SMALL_TO_ROWS = 24
SMALL_PER_SM = 0
# Registers a thread (maxnreg) for 8-warp tiles whose ring fits an SM's shared memory twice, so that two programs
# share each SM and one's first loads and epilogue run under the other's MMAs (0: as many as ptxas takes, 151-154
# for the 64-token tile on 8 warps: one program an SM). At 128 the 64-token tile of 3 stages spills 88-120 bytes, 7-12
# local accesses in each K loop (sm_90 build, KERNEL_NOTES.md item 42): to be measured before anything ships it.
TWO_PROGRAMS_MAXNREG = 0


def heuristic_tile(num_pairs: int, num_experts: int, dtype: torch.dtype = torch.float16) -> GluonTile:
    """A tile for a shape nobody tuned: the token tile follows the rows each expert gets (up to 8, the persistent
    warp-specialized kernels where they fit: :data:`PERSISTENT_16`, :func:`fitted_tile`); past :data:`WIDE_FROM_ROWS`
    two warpgroups share 128-token activation tiles over 256 weight rows (benchmarks/KERNEL_NOTES.md item 16). bf16
    keeps the 32-token tile up to 48 rows per expert: it scales each K step's sum (:func:`scale_after`), the
    64-token tile each weight (Qwen2-57B M=256 on the H200: 533 against the tl kernels' 648 us, KERNEL_NOTES.md
    item 20)."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 8:
        return PERSISTENT_16
    if per_expert <= (max(48, SMALL_TO_ROWS) if dtype == torch.bfloat16 else SMALL_TO_ROWS):
        return GluonTile(32, 64, 4, per_sm=SMALL_PER_SM)
    if per_expert <= WIDE_FROM_ROWS:
        return mid_tile()
    return replace(WIDE_TILE, per_sm=WIDE_PER_SM)


def mid_tile() -> GluonTile:
    """The 64-token tile on :data:`MID_WARPS` warps: 16 channels a warp (gate and up: 32 weight rows), at
    :data:`MID_PER_SM` persistent programs an SM."""
    return GluonTile(64, 16 * MID_WARPS, 8, MID_STAGES, MID_WARPS, per_sm=MID_PER_SM)


# bf16's top-k sum on the Gluon path: "pairs" (one bf16 row per pair, then kernels/topk_sum.py), "atomic" (fp32
# atomics into the [M, H] buffer w13 clears, then a cast) or "last" (per-pair rows, each token's summed by the w2
# program that writes its last one: :func:`_sum_last_rows`, the same bits as "pairs"). The sum launch is 2-3% of
# the call at M = 1024-4096 and 2.3-2.8 us exposed at M = 4-16 (half the glue there, issue 17's 5 us), yet
# "atomic" measured 5-6% slower at every M = 16-4096 (benchmarks/RESULTS.md 2026-12-07 07:30 UTC; the anchor's
# variant ``project:gluon_sm90.BF16_REDUCE='atomic'``); "last" is built, not yet measured (KERNEL_NOTES.md item 46).
BF16_REDUCE = "pairs"


def heuristic_reduce(dtype: torch.dtype) -> str:
    """The top-k sum beside the heuristic's tile (runtime/kernel_config.py ``reduce``): in fp16, w2's rows added
    straight into the output that w13 cleared, faster than per-pair rows and their sum on every shape and M
    measured but Mixtral and Qwen2-57B at M = 1024 (+1-2%), and 0.4-6.5% of the call faster elsewhere
    (benchmarks/KERNEL_NOTES.md item 18); fp32 atomics lost past M = 256 (twice the bytes of every add). bf16:
    per-pair rows (eight bf16 roundings per element would cost more than the 5e-3 the bf16 path is held to)."""
    return "out" if dtype == torch.float16 else BF16_REDUCE


def preferred(weights: MoeWeights, dtype: torch.dtype) -> bool:
    """Whether these kernels beat the tl weight-major ones on an aligned call, as measured on the H200: fp16 always
    (benchmarks/KERNEL_NOTES.md item 16); bf16 too since its small token tiles scale each K step's sum instead of
    each weight (item 20: Qwen2-57B M = 8..256 11-18% faster than the tl kernels; from 48 rows per expert it was
    ahead before). Act-order stacks run here as plain ones once their rows are gathered (kernels/act_order.py,
    KERNEL_NOTES item 18); with the gather off, never (their column gather goes through registers here)."""
    return weights.w13_perm is None or ACT_ORDER_GATHER


# Every tile heuristic_tile picks: the CPU compile test builds each for sm_90.
SHIPPED_TILES = (
    PERSISTENT_16,
    GluonTile(16, 64, 1),  # PERSISTENT_16 where it does not fit
    GluonTile(32, 64, 4),
    GluonTile(64, 64, 8),  # mid_tile() on 4 warps (MID_WARPS, MID_PER_SM = 0)
    GluonTile(64, 128, 8, 4, 8),  # on 8, one program per tile: the act-order stacks without their rows gathered
    GluonTile(64, 128, 8, 4, 8, per_sm=1),  # on 8, persistent: mid_tile()
    WIDE_TILE,  # one program per tile: fitted_tile's fallback, and the w2 of the persistent one
    replace(WIDE_TILE, per_sm=1),
)


# ---------------------------------------------------------------------------------------------------------------
# Layouts: built inside the kernels from their tile constexprs and warp count
# ---------------------------------------------------------------------------------------------------------------

if available():

    @constexpr_function
    def word_layout(rows, warps):
        """[rows, 8] int32 words of half a K step: thread (warp w, lane l) holds rows ``16w + l // 4 (+ 8)`` (and
        every ``16 * warps`` rows on), words ``l % 4`` and ``l % 4 + 4``: exactly the words its wgmma A fragment
        needs (warps 0-3 are the first warpgroup's 64 rows, 4-7 the second's)."""
        cta_rows = 16 * warps
        reg = [[8, 0], [0, 4]] + [[cta_rows << j, 0] for j in range(int(math.log2(rows // cta_rows)))]
        lane = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
        warp = [[16 << j, 0] for j in range(int(math.log2(warps)))]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, 8])

    @constexpr_function
    def acc_layout(block_m, warps):
        """The wgmma accumulator [rows, block_m]: every warp 16 rows of each 16 * warps, tokens as N."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])

    @constexpr_function
    def a_layout(block_m, warps):
        """The wgmma A operand from registers, [rows, 16] per chunk (what a word's fp16x2 pairs already are)."""
        return gl.DotOperandLayout(operand_index=0, parent=acc_layout(block_m, warps), k_width=2)

    @constexpr_function
    def x_parts(block_m, warps):
        """Parts of a K step's activation copy (see ``_copy_x``): its two halves apart (fewer address and, for
        act-order, gathered-value registers at once), or both at once where a half has fewer rows than the copy
        layout (whose repeated rows would copy twice)."""
        return 2 if block_m >= 4 * warps else 1

    @constexpr_function
    def x_layout(warps):
        """[rows, 64] activations (one half K step of a token per row): eight threads move a row's 128 bytes, 16
        each, which under the 128-byte swizzle of the shared ring is one conflict-free wavefront."""
        return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])

    @constexpr_function
    def out_layout(block_n, block_m, warps):
        """[channels, tokens] epilogue tiles, up to 8 channels per thread (stores along a row 16 bytes wide), no
        element held by two threads (the w2 epilogue adds atomically)."""
        per_thread = min(8, max(1, block_n * block_m // (32 * warps)))
        lanes_n = min(32, block_n // per_thread)
        lanes_m = 32 // lanes_n
        warps_m = min(warps, max(1, block_m // lanes_m))
        return gl.BlockedLayout([per_thread, 1], [lanes_n, lanes_m], [warps // warps_m, warps_m], [0, 1])

    @constexpr_function
    def w_copy_layout(warps):
        """[rows, 16] words of a K step as cp.async copies them: four words (16 bytes) a thread."""
        return gl.BlockedLayout([1, 4], [8, 4], [warps, 1], [1, 0])

    @constexpr_function
    def ragged_paths(ragged):
        """How many widths a tile's K loop is compiled for: four ragged (:data:`RAGGED_TILES`), else the whole."""
        return 4 if ragged else 1

    @constexpr_function
    def ragged_width(block_m, path, part):
        """Tokens of accumulator ``part`` (0: the first, 1: the one after it, 0 tokens where there is none) on ragged
        path ``path`` of a ``block_m``-token tile: 0 the whole block, 1 a half and a quarter, 2 a half, 3 a
        quarter (:func:`_ragged_path`)."""
        quarter = block_m // 4
        return [(block_m, 0), (2 * quarter, quarter), (2 * quarter, 0), (quarter, 0)][path][part]

    @constexpr_function
    def ticket_layout(tokens, warps):
        """[tokens, :func:`ticket_columns`] over a program's threads, one element each and none held twice: the
        tickets of a tile's tokens (column 0) are taken by one thread each and read back where they were taken."""
        lanes = min(32, tokens)
        token_warps = min(warps, max(1, tokens // lanes))
        return gl.BlockedLayout([1, 1], [lanes, 32 // lanes], [token_warps, warps // token_warps], [1, 0])

    @constexpr_function
    def ticket_columns(tokens, warps):
        """Columns of :func:`ticket_layout`: the threads a token row of it spans."""
        layout = ticket_layout(tokens, warps)
        return layout.threads_per_warp[1] * layout.warps_per_cta[1]

    @constexpr_function
    def sum_rows(block_n, tokens, warps):
        """Output columns :func:`_sum_last_rows` sums at a time: 16 of a thread's values (and TOP_K loads of each in
        flight): the whole [block_n, tokens] tile at once spilled 1.3-1.8 KB on the 128-token tile."""
        return max(1, min(block_n, 16 * 32 * warps // tokens))

    @constexpr_function
    def zero_layout(warps):
        """The [8 * 32 * warps] fp16 run one clearing step stores: 16 bytes a thread."""
        return gl.BlockedLayout([8], [32], [warps], [0])

    # The shared ring: activations under the 128-byte swizzle (see x_layout); words in 16-byte units (what one
    # thread copies: whole 32-byte sectors per row from global memory) XOR-swizzled by row // 2 (mod 4), so the
    # eight rows whose word t a warp reads at once fall in distinct banks.
    X_SMEM_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    W_SMEM_LAYOUT = gl.constexpr(gl.SwizzledSharedLayout(vec=4, per_phase=2, max_phase=4, order=[1, 0]))


# ---------------------------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------------------------

if available():

    @gluon.jit
    def _pack2(v16):
        """A 16-bit value (as int16 bits) in both halves of an int32: the fp16x2 / bf16x2 operand of PTX."""
        low = v16.to(gl.int32) & 0xFFFF
        return low | (low << 16)

    @gluon.jit
    def _step_quant(scales_ptr, zeros_ptr, rows, row_mask, scale_rows, scale_mask, group, stride_s_g,
                    HAS_ZEROS: gl.constexpr, SYM_ZERO: gl.constexpr, IS_FP16: gl.constexpr,
                    SCALE_AFTER: gl.constexpr):  # fmt: skip
        """Per row for one group: (scale, -(bias + zero), -(64 + zero)) packed as fp16x2 in the words' layout (fp16;
        bias 1024), or (the scale's high bf16 part, -(128 + zero), its low part) as bf16x2 (bf16). With SCALE_AFTER
        the scale is fp32 in the accumulator's layout (``scale_rows``, ``scale_mask``): the step's sum is scaled, not
        each weight."""
        if SCALE_AFTER:
            scale = gl.load(scales_ptr + group * stride_s_g + scale_rows, mask=scale_mask, other=0.0)
            scale_op = gl.expand_dims(scale.to(gl.float32), 1)
        else:
            scale = gl.load(scales_ptr + group * stride_s_g + rows, mask=row_mask, other=0.0)
            if IS_FP16:
                scale_op = gl.expand_dims(_pack2(scale.to(gl.int16, bitcast=True)), 1)
            else:  # the fp16 scale as the sum of two bf16 (8 + 3 significant bits: exact)
                high = scale.to(gl.float32).to(gl.bfloat16)
                low = (scale.to(gl.float32) - high.to(gl.float32)).to(gl.bfloat16)
                scale_op = gl.expand_dims(_pack2(high.to(gl.int16, bitcast=True)), 1)
                low_op = gl.expand_dims(_pack2(low.to(gl.int16, bitcast=True)), 1)
        if HAS_ZEROS:
            zero = gl.load(zeros_ptr + group * stride_s_g + rows, mask=row_mask, other=0).to(gl.int32)
        else:
            zero = gl.full(rows.shape, SYM_ZERO, gl.int32, layout=rows.type.layout)
        if IS_FP16:
            bias2 = _pack2((-(zero + 1024)).to(gl.float16).to(gl.int16, bitcast=True))
            odd2 = gl.expand_dims(_pack2((-(zero + 64)).to(gl.float16).to(gl.int16, bitcast=True)), 1)
        else:
            bias2 = _pack2((-(zero + 128)).to(gl.bfloat16).to(gl.int16, bitcast=True))
            odd2 = gl.expand_dims(bias2, 1) if SCALE_AFTER else low_op
        return scale_op, gl.expand_dims(bias2, 1), odd2

    @gluon.jit
    def _dequant_chunk(words, i: gl.constexpr, scale2, bias2, odd2, IS_FP16: gl.constexpr, DTYPE: gl.constexpr,
                       BLOCK_M: gl.constexpr, SCALE_AFTER: gl.constexpr):  # fmt: skip
        """Chunk ``4g + i`` of half-step words [rows, 8] as the [rows, 16] wgmma A operand (see module doc): exact
        ``q - zero`` with SCALE_AFTER (|q - zero| <= 15, exact in fp16 and bf16), else times the scale."""
        weights = _dequant_pairs(words, i, scale2, bias2, odd2, IS_FP16, DTYPE, SCALE_AFTER)
        return gl.convert_layout(weights, a_layout(BLOCK_M, gl.num_warps()), assert_trivial=True)

    @gluon.jit
    def _dequant_pairs(words, i: gl.constexpr, scale2, bias2, odd2, IS_FP16: gl.constexpr, DTYPE: gl.constexpr,
                       SCALE_AFTER: gl.constexpr):  # fmt: skip
        """:func:`_dequant_chunk` before its move to an MMA's operand layout: [rows, 16] in the words' layout, each
        word's fp16x2 (bf16x2) as the two adjacent inputs it holds. Any MMA whose A fragment a thread's words already
        are (wgmma's here, mma.sync m16n8k16's in kernels/decode_mma.py) takes it with a trivial conversion."""
        if IS_FP16:
            src = words if i < 2 else words >> 8
            if i % 2 == 0:
                FIELDS: gl.constexpr = "lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; add.f16x2 t, t, $4; "
            else:  # fields four bits up: 1024 + 16q, times 1/16 is 64 + q (exact)
                FIELDS: gl.constexpr = (
                    "mov.b32 s, 0x2C002C00; lop3.b32 t, $2, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, s, $5; "
                )
            SCALE: gl.constexpr = "" if SCALE_AFTER else "mul.f16x2 t, t, $3; "
        else:
            src = words >> (4 * i) if i > 0 else words
            FIELDS: gl.constexpr = "lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; add.rn.bf16x2 t, t, $4; "
            # Times the fp16 scale as high + low bf16 parts ($3, $5): the low product (<= 9 significant bits, rounded
            # to 8) added into the fused high one, rounded once. A bf16-rounded scale alone would be one systematic
            # error per row and group (5e-3 relative); widening to fp32 cost four more instructions per two weights.
            SCALE: gl.constexpr = "" if SCALE_AFTER else "mul.rn.bf16x2 l, t, $5; fma.rn.bf16x2 t, t, $3, l; "
        asm: gl.constexpr = "{ .reg .b32 t, s, l, h; " + FIELDS + SCALE + "mov.b32 {$0, $1}, t; }"
        if SCALE_AFTER:  # the scale is not an operand (and lives in the accumulator's layout)
            scale2 = bias2
        lo, hi = gl.inline_asm_elementwise(
            asm, "=h,=h,r,r,r,r", [src, scale2, bias2, odd2], dtype=(DTYPE.value, DTYPE.value), is_pure=True, pack=1
        )
        return gl.reshape(gl.join(lo, hi), [words.shape[0], 16])

    @gluon.jit
    def _step_words(w_stage, ROWS: gl.constexpr):
        """A K step's [ROWS, 16] words from the ring as two half steps [ROWS, 8] in the wgmma A fragment's layout."""
        WORD_LAYOUT: gl.constexpr = word_layout(ROWS, gl.num_warps())
        return w_stage.slice(0, 8, dim=1).load(WORD_LAYOUT), w_stage.slice(8, 8, dim=1).load(WORD_LAYOUT)

    @gluon.jit
    def _step_chunks(low, high, x_stage, acc, part, scale2, bias2, odd2, FIRST: gl.constexpr, LAST: gl.constexpr,
                     IS_FP16: gl.constexpr, DTYPE: gl.constexpr, BLOCK_M: gl.constexpr,
                     SCALE_AFTER: gl.constexpr):  # fmt: skip
        """Chunks FIRST .. LAST - 1 of a K step: each dequantized while the wgmma before it runs (one in flight),
        into ``acc``, or with SCALE_AFTER into the step's own sum ``part`` (started by chunk 0, scaled into ``acc``
        after chunk 7)."""
        for c in gl.static_range(FIRST, LAST):
            words = low if c < 4 else high
            a = _dequant_chunk(words, c % 4, scale2, bias2, odd2, IS_FP16, DTYPE, BLOCK_M, SCALE_AFTER)
            b = _x_chunk(x_stage, c, BLOCK_M)
            if not SCALE_AFTER:
                acc = warpgroup_mma(a, b, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            elif c > 0:
                part = warpgroup_mma(a, b, part, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=1, deps=[part])
            else:  # the step's sum starts from this chunk
                part = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(num_outstanding=1, deps=[part])
        if SCALE_AFTER and LAST == 8:  # the step's last MMA waited for, its sum added scaled once per element
            part = warpgroup_mma_wait(num_outstanding=0, deps=[part])
            acc = acc + part * scale2
        return acc, part

    @gluon.jit
    def _copy_x(x_stage, token_rows, pair_mask, perm_row_ptr, k0, BLOCK_M: gl.constexpr, HAS_PERM: gl.constexpr):
        """cp.async the [2 * BLOCK_M, 64] activations of the K step at ``k0`` into ``x_stage``: row
        ``h * BLOCK_M + j`` holds inputs ``k0 + 64h .. k0 + 64h + 63`` of the block's token j (act-order: the columns
        the permutation names). In ``X_PARTS`` parts of whole halves (:func:`x_parts`; ``token_rows``,
        ``pair_mask``: one part's rows)."""
        X_PARTS: gl.constexpr = x_parts(BLOCK_M, gl.num_warps())
        X_LAYOUT: gl.constexpr = x_layout(gl.num_warps())
        PART_ROWS: gl.constexpr = 2 * BLOCK_M // X_PARTS
        r = gl.arange(0, PART_ROWS, layout=gl.SliceLayout(1, X_LAYOUT))
        within = gl.arange(0, 64, layout=gl.SliceLayout(0, X_LAYOUT))
        for part in gl.static_range(X_PARTS):
            half = gl.expand_dims((part * PART_ROWS + r) // BLOCK_M, 1)
            dst = x_stage.slice(part * PART_ROWS, PART_ROWS)
            if HAS_PERM:  # a gather of single columns: cp.async moves 4 bytes at least, so through registers
                # The permuted columns of both halves, once per thread column, broadcast over the rows.
                first = gl.expand_dims(gl.load(perm_row_ptr + k0 + within), 0)
                second = gl.expand_dims(gl.load(perm_row_ptr + k0 + 64 + within), 0)
                inputs = gl.where(half == 0, first, second)
                dst.store(gl.load(token_rows + inputs, mask=pair_mask, other=0.0))
            else:
                inputs = k0 + half * 64 + gl.expand_dims(within, 0)
                async_copy.async_copy_global_to_shared(dst, token_rows + inputs, mask=pair_mask)

    @gluon.jit
    def _x_chunk(x_stage, c: gl.constexpr, BLOCK_M: gl.constexpr):
        """Chunk c (inputs 16c .. 16c + 15 of the K step) of every token: the [16, BLOCK_M] wgmma B operand."""
        return x_stage.slice(c // 4 * BLOCK_M, BLOCK_M).slice(c % 4 * 16, 16, dim=1).permute((1, 0))

    @gluon.jit
    def _split_chunks(low, high, x_stage, acc, acc_b, scale2, bias2, odd2, FIRST: gl.constexpr, LAST: gl.constexpr,
                      IS_FP16: gl.constexpr, DTYPE: gl.constexpr, X_ROWS: gl.constexpr, N_A: gl.constexpr,
                      N_B: gl.constexpr):  # fmt: skip
        """Chunks FIRST .. LAST - 1 of a K step for the first N_A tokens of a ring of X_ROWS (``acc``) and, N_B > 0,
        the N_B after them (``acc_b``): each chunk dequantized once, one wgmma per accumulator, this chunk's kept in
        flight while the next is dequantized (:func:`_step_chunks`, whose scale-after sums this does not take)."""
        for c in gl.static_range(FIRST, LAST):
            words = low if c < 4 else high
            a = _dequant_chunk(words, c % 4, scale2, bias2, odd2, IS_FP16, DTYPE, N_A, False)
            x_half = x_stage.slice(c // 4 * X_ROWS, X_ROWS).slice(c % 4 * 16, 16, dim=1)
            acc = warpgroup_mma(a, x_half.slice(0, N_A).permute((1, 0)), acc, is_async=True)
            if N_B > 0:
                a_b = gl.convert_layout(a, a_layout(N_B, gl.num_warps()))
                acc_b = warpgroup_mma(a_b, x_half.slice(N_A, N_B).permute((1, 0)), acc_b, is_async=True)
                acc, acc_b = warpgroup_mma_wait(num_outstanding=2, deps=[acc, acc_b])
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        return acc, acc_b

    @gluon.jit
    def _chunks(low, high, x_stage, acc, part, acc_b, scale2, bias2, odd2, FIRST: gl.constexpr, LAST: gl.constexpr,
                IS_FP16: gl.constexpr, DTYPE: gl.constexpr, BLOCK_M: gl.constexpr, SCALE_AFTER: gl.constexpr,
                N_A: gl.constexpr, N_B: gl.constexpr):  # fmt: skip
        """(acc, part, acc_b) after chunks FIRST .. LAST - 1 of a K step at the tile's widths: the whole block's
        (:func:`_step_chunks`, with its scale-after sums) or a ragged one's (:func:`_split_chunks`)."""
        if N_A == BLOCK_M:
            acc, part = _step_chunks(low, high, x_stage, acc, part, scale2, bias2, odd2, FIRST, LAST, IS_FP16, DTYPE,
                                     BLOCK_M, SCALE_AFTER)  # fmt: skip
        else:
            acc, acc_b = _split_chunks(low, high, x_stage, acc, acc_b, scale2, bias2, odd2, FIRST, LAST, IS_FP16,
                                       DTYPE, BLOCK_M, N_A, N_B)  # fmt: skip
        return acc, part, acc_b

    @gluon.jit
    def _accumulators(ROWS: gl.constexpr, N_A: gl.constexpr, N_B: gl.constexpr):
        """(acc [ROWS, N_A], part: one step's sum of the same shape (SCALE_AFTER), acc_b [ROWS, N_B] or acc again
        where N_B is 0), zeroed: what a K loop of :func:`_chunks` starts from."""
        acc = gl.zeros([ROWS, N_A], gl.float32, layout=acc_layout(N_A, gl.num_warps()))
        part = gl.zeros([ROWS, N_A], gl.float32, layout=acc_layout(N_A, gl.num_warps()))
        acc_b = acc
        if N_B > 0:
            acc_b = gl.zeros([ROWS, N_B], gl.float32, layout=acc_layout(N_B, gl.num_warps()))
        return acc, part, acc_b

    @gluon.jit
    def _last_wait(acc, acc_b, N_B: gl.constexpr, SCALE_AFTER: gl.constexpr):
        """(acc, acc_b, or acc again where N_B is 0) once a K loop's last wgmmas are done (a scale-after sum waited
        for its own in the loop)."""
        if N_B > 0:
            acc, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc, acc_b])
        else:
            if not SCALE_AFTER:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            acc_b = acc
        return acc, acc_b

    @gluon.jit
    def _copy_step(w_stage, x_stage, w_rows, w_ok, stride_step, token_rows, pair_mask, perm_row_ptr, k0,
                   BLOCK_M: gl.constexpr, HAS_PERM: gl.constexpr):  # fmt: skip
        """cp.async one K step into a ring stage, as one commit group: the [rows, 16] words (16 bytes a thread) and
        the [2 * BLOCK_M, 64] activations (see :func:`_copy_x`)."""
        offs_w = gl.arange(0, 16, layout=gl.SliceLayout(0, w_copy_layout(gl.num_warps())))
        words = w_rows + k0 // 128 * stride_step + gl.expand_dims(offs_w, 0)
        async_copy.async_copy_global_to_shared(w_stage, words, mask=w_ok)
        _copy_x(x_stage, token_rows, pair_mask, perm_row_ptr, k0, BLOCK_M, HAS_PERM)

    @gluon.jit
    def _k_loop(w_rows, w_ok, stride_step, rows_ok, scales_e, zeros_e, rows, x_ptr, token_rows, pair_mask, perm_row_ptr,
                K, stride_s_g, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_LEN: gl.constexpr,
                HAS_ZEROS: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_PERM: gl.constexpr,
                STAGES: gl.constexpr, SCALE_AFTER: gl.constexpr, N_A: gl.constexpr,
                N_B: gl.constexpr):  # fmt: skip
        """(acc [ROWS, N_A], acc_b [ROWS, N_B] or acc again where N_B is 0) = W[rows, :] @ X[:, pairs] for one
        program's first N_A pairs and the N_B after them (N_A = BLOCK_M: the whole block; :data:`RAGGED_TILES`): the
        loop both GEMMs share.

        A ring of STAGES K steps (words and activations, cp.async) runs STAGES - 2 steps ahead of the MMAs: the
        bytes in flight, not the MMA, set the speed of a memory-bound GEMM. ``w_rows`` [ROWS, 1] points at each
        weight row's first word (copy layout), ``w_ok`` its mask, ``stride_step`` the words from one K step to the
        next (kernels.common.word_strides)."""
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        IS_FP16: gl.constexpr = dtype == gl.float16
        x_smem = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_M, 64], X_SMEM_LAYOUT)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 16], W_SMEM_LAYOUT)
        ACC_LAYOUT: gl.constexpr = acc_layout(N_A, gl.num_warps())
        scale_rows = gl.convert_layout(rows, gl.SliceLayout(1, ACC_LAYOUT))
        scale_ok = gl.convert_layout(rows_ok, gl.SliceLayout(1, ACC_LAYOUT))
        acc, part, acc_b = _accumulators(ROWS, N_A, N_B)
        scale, bias2, odd2 = _step_quant(scales_e, zeros_e, rows, rows_ok, scale_rows, scale_ok, 0, stride_s_g,
                                         HAS_ZEROS, SYM_ZERO, IS_FP16, SCALE_AFTER)  # fmt: skip
        num_steps = K // 128  # steps clamp in step units: their word offsets stay 64-byte aligned (16-byte copies)
        AHEAD: gl.constexpr = STAGES - 2  # steps in flight; one more stage is still read by the last wgmma
        for s in gl.static_range(AHEAD):
            _copy_step(w_smem.index(s), x_smem.index(s), w_rows, w_ok, stride_step, token_rows, pair_mask, perm_row_ptr,
                       gl.minimum(s, num_steps - 1) * 128, BLOCK_M, HAS_PERM)  # fmt: skip
            async_copy.commit_group()
        for step in range(num_steps):
            k_next = gl.minimum(step + 1, num_steps - 1) * 128
            next_quant = _step_quant(scales_e, zeros_e, rows, rows_ok, scale_rows, scale_ok, k_next // GROUP_LEN,
                                     stride_s_g, HAS_ZEROS, SYM_ZERO, IS_FP16, SCALE_AFTER)  # fmt: skip
            async_copy.wait_group(AHEAD - 1)  # this step's stage has landed (this thread's copies)
            fence_async_shared()
            # One barrier per step: every thread's copies of this step have landed, and every thread is done
            # with step - 2's stage (its words loaded, its wgmmas waited for in step - 1), which the copy of step
            # + AHEAD overwrites right away, before this step reads anything (so no other barrier is needed).
            gl.thread_barrier()
            ahead = (step + AHEAD) % STAGES
            _copy_step(w_smem.index(ahead), x_smem.index(ahead), w_rows, w_ok, stride_step, token_rows, pair_mask,
                       perm_row_ptr, gl.minimum(step + AHEAD, num_steps - 1) * 128, BLOCK_M, HAS_PERM)  # fmt: skip
            async_copy.commit_group()
            here = step % STAGES
            low, high = _step_words(w_smem.index(here), ROWS)
            acc, step_part, acc_b = _chunks(low, high, x_smem.index(here), acc, part, acc_b, scale, bias2, odd2, 0, 8,
                                            IS_FP16, dtype, BLOCK_M, SCALE_AFTER, N_A, N_B)  # fmt: skip
            if SCALE_AFTER:  # otherwise ``part`` stays out of the loop's carried values
                part = step_part
            scale, bias2, odd2 = next_quant
        acc, acc_b = _last_wait(acc, acc_b, N_B, SCALE_AFTER)
        async_copy.wait_group(0)
        return acc, acc_b

    @gluon.jit
    def _block(pid, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, num_pid_m, N, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
        """(pid_m, pid_n, pairs [rows, 1] as one part of the activation rows repeats them, expert, whether the block
        exists)."""
        # common.tile_ids is a triton.jit function: Gluon compiles a jit callee with its own (Gluon) semantics, and
        # scalar arithmetic needs no layout, so the grouped order is the tl kernels' own.
        pid_m, pid_n = tile_ids(pid, num_pid_m, gl.cdiv(N, BLOCK_N), GROUP_M)
        live = pid_m < gl.load(num_blocks_ptr)
        ROWS: gl.constexpr = 2 * BLOCK_M // x_parts(BLOCK_M, gl.num_warps())  # one part of _copy_x
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, x_layout(gl.num_warps())))
        pairs = gl.expand_dims(gl.load(sorted_pairs_ptr + pid_m * BLOCK_M + r % BLOCK_M), 1)
        expert = gl.load(block_experts_ptr + pid_m).to(gl.int64)
        return pid_m, pid_n, pairs, expert, live

    @gluon.jit
    def _tile_pairs(sorted_pairs_ptr, first, TOKENS: gl.constexpr, LAYOUT: gl.constexpr):
        """Pairs ``first .. first + TOKENS - 1`` of the sorted order [1, TOKENS] in ``LAYOUT`` (tokens as columns)."""
        j = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, LAYOUT))
        return gl.expand_dims(gl.load(sorted_pairs_ptr + first + j), 0)

    @gluon.jit
    def _ragged_path(sorted_pairs_ptr, first, num_pairs, BLOCK_M: gl.constexpr, RAGGED: gl.constexpr):
        """Which of :func:`ragged_width`'s paths the block from sorted slot ``first`` takes: 0 (the whole block) past
        three quarters of real pairs, 1 past a half, 2 past a quarter, else 3; always 0 unless RAGGED. An expert's
        pairs fill its block from the first row, the sentinel (``num_pairs``) the rest (kernels/align.py), so three
        slots tell."""
        if RAGGED:
            quarter: gl.constexpr = BLOCK_M // 4
            real = (gl.load(sorted_pairs_ptr + first + quarter) < num_pairs).to(gl.int32)
            real += (gl.load(sorted_pairs_ptr + first + 2 * quarter) < num_pairs).to(gl.int32)
            real += (gl.load(sorted_pairs_ptr + first + 3 * quarter) < num_pairs).to(gl.int32)
            return 3 - real
        else:
            return 0

    @gluon.jit
    def _w13_rows(acc, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_inter,
                   BLOCK_N: gl.constexpr, TOKENS: gl.constexpr, CAST_FIRST: gl.constexpr):  # fmt: skip
        """inter[pair, n] = silu(gate) * up for the TOKENS pairs from sorted slot ``first``: acc [2 * BLOCK_N,
        TOKENS] holds the gate rows, then the up rows (:func:`_w13_store`'s one accumulator). CAST_FIRST: cast
        before the move to the store layout, whose shared memory is then half of fp32's: the persistent kernels'
        ring does not lend it its own (what lets a 128-token tile keep four stages); one program a tile reuses its
        ring, and there the cast after the move spills no register (8 bytes spilled the other way: bf16, zero
        points, the 128-token tile)."""
        OUT_LAYOUT: gl.constexpr = out_layout(BLOCK_N, TOKENS, gl.num_warps())
        gate, up = gl.split(gl.permute(gl.reshape(acc, [2, BLOCK_N, TOKENS]), [1, 2, 0]))
        act = gate / (1.0 + gl.exp(-gate)) * up
        if CAST_FIRST:
            act = gl.convert_layout(act.to(inter_ptr.dtype.element_ty), OUT_LAYOUT)
        else:
            act = gl.convert_layout(act, OUT_LAYOUT).to(inter_ptr.dtype.element_ty)
        offs_p = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OUT_LAYOUT))
        out_pairs = _tile_pairs(sorted_pairs_ptr, first, TOKENS, OUT_LAYOUT)
        ptrs = inter_ptr + out_pairs.to(gl.int64) * stride_inter + gl.expand_dims(offs_p, 1)
        mask = gl.expand_dims(offs_p < N, 1) & (out_pairs < num_pairs)
        gl.store(ptrs, act, mask=mask)

    @gluon.jit
    def _w13_store(acc, acc_b, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_inter,
                   BLOCK_N: gl.constexpr, N_A: gl.constexpr, N_B: gl.constexpr, CAST_FIRST: gl.constexpr):  # fmt: skip
        """w13's epilogue for a block's first N_A pairs from sorted slot ``first`` (``acc``) and the N_B after them
        (``acc_b``, where N_B > 0): :func:`_w13_rows` of each."""
        _w13_rows(acc, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_inter, BLOCK_N, N_A, CAST_FIRST)
        if N_B > 0:
            _w13_rows(acc_b, inter_ptr, sorted_pairs_ptr, first + N_A, pid_n, num_pairs, N, stride_inter, BLOCK_N, N_B,
                      CAST_FIRST)  # fmt: skip

    @gluon.jit
    def _w2_rows(acc, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_out, summed,
                  TOP_K: gl.constexpr, ATOMIC: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr,
                  SUM_LAST: gl.constexpr):  # fmt: skip
        """out[pair or token, n] (+)= w[pair] * acc for the TOKENS pairs from sorted slot ``first`` (:func:`_w2_store`'s
        one accumulator); SUM_LAST: then each token whose last row this was summed (:func:`_sum_last_rows`)."""
        ACC_LAYOUT: gl.constexpr = acc_layout(TOKENS, gl.num_warps())
        OUT_LAYOUT: gl.constexpr = out_layout(BLOCK_N, TOKENS, gl.num_warps())
        # Weighted in the accumulator's layout and converted in the output dtype: the layout change then takes
        # half the shared memory (a 128-row tile's fp32 [128, 16] would not leave 4 programs room on an SM).
        acc_pairs = _tile_pairs(sorted_pairs_ptr, first, TOKENS, ACC_LAYOUT)
        acc = acc * gl.load(topk_weights_ptr + acc_pairs, mask=acc_pairs < num_pairs, other=0.0)
        acc = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), OUT_LAYOUT)
        out_pairs = _tile_pairs(sorted_pairs_ptr, first, TOKENS, OUT_LAYOUT)
        live_pairs = out_pairs < num_pairs
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OUT_LAYOUT))
        mask = gl.expand_dims(offs_n < N, 1) & live_pairs
        if ATOMIC:
            tokens = (out_pairs // TOP_K).to(gl.int64)
            ptrs = out_ptr + tokens * stride_out + gl.expand_dims(offs_n, 1)
            # relaxed: the default acq_rel put a MEMBAR.GPU before every vector add (KERNEL_NOTES item 18)
            gl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")
        else:
            ptrs = out_ptr + out_pairs.to(gl.int64) * stride_out + gl.expand_dims(offs_n, 1)
            gl.store(ptrs, acc, mask=mask)
            if SUM_LAST:
                _sum_last_rows(out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_out, summed, TOP_K,
                               BLOCK_N, TOKENS)  # fmt: skip

    @gluon.jit
    def _sum_last_rows(rows_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_rows, summed,
                       TOP_K: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS: gl.constexpr):  # fmt: skip
        """The top-k sum where the last row arrives (reduce "last", :data:`BF16_REDUCE`): with this tile's rows of its
        TOKENS pairs stored, each pair's token takes a ticket of ``counts[token, pid_n]`` (``summed``: the [M, H]
        output, the counts w13 cleared, the output's row stride); a token whose ticket is its TOP_K-th has every row
        of these BLOCK_N columns written, and this program sums them in fp32, in order, as kernels/topk_sum.py does
        (the same bits), into the output. A token's pairs are in different experts' blocks, so once in a tile.

        The barrier orders every thread's stores before the acq_rel tickets (kernels/split_k.py add_and_arrive);
        the rows come back past L1 (``.cg``), written by other SMs."""
        sum_ptr, counts_ptr, stride_sum = summed
        gl.thread_barrier()
        TICKETS: gl.constexpr = ticket_layout(TOKENS, gl.num_warps())
        j = gl.arange(0, TOKENS, layout=gl.SliceLayout(1, TICKETS))
        c = gl.arange(0, ticket_columns(TOKENS, gl.num_warps()), layout=gl.SliceLayout(0, TICKETS))
        pairs = gl.expand_dims(gl.load(sorted_pairs_ptr + first + j), 1)
        take = (pairs < num_pairs) & gl.expand_dims(c == 0, 0)  # one ticket a live pair
        counters = counts_ptr + (pairs // TOP_K) * gl.cdiv(N, BLOCK_N) + pid_n + gl.expand_dims(c * 0, 0)
        ones = gl.full(counters.shape, 1, gl.int32, TICKETS)
        tickets = gl.atomic_add(counters, ones, mask=take, sem="acq_rel", scope="gpu")
        last = gl.max(gl.where(take & (tickets == TOP_K - 1), 1, 0), axis=1)
        SUM_N: gl.constexpr = sum_rows(BLOCK_N, TOKENS, gl.num_warps())
        SUM_LAYOUT: gl.constexpr = out_layout(SUM_N, TOKENS, gl.num_warps())
        last = gl.expand_dims(gl.convert_layout(last, gl.SliceLayout(0, SUM_LAYOUT)), 0) != 0
        tokens = (_tile_pairs(sorted_pairs_ptr, first, TOKENS, SUM_LAYOUT) // TOP_K).to(gl.int64)
        for n0 in range(0, BLOCK_N, SUM_N):  # a loop, not unrolled: each piece's TOP_K loads in flight at once
            offs_n = gl.arange(0, SUM_N, layout=gl.SliceLayout(1, SUM_LAYOUT))
            offs_n = gl.expand_dims(pid_n * BLOCK_N + n0 + offs_n, 1)
            mask = (offs_n < N) & last
            total = gl.zeros([SUM_N, TOKENS], gl.float32, SUM_LAYOUT)
            for k in gl.static_range(TOP_K):
                row = rows_ptr + (tokens * TOP_K + k) * stride_rows + offs_n
                total += gl.load(row, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
            gl.store(sum_ptr + tokens * stride_sum + offs_n, total.to(sum_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _w2_store(acc, acc_b, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_out,
                  summed, TOP_K: gl.constexpr, ATOMIC: gl.constexpr, BLOCK_N: gl.constexpr, N_A: gl.constexpr,
                  N_B: gl.constexpr, SUM_LAST: gl.constexpr):  # fmt: skip
        """w2's epilogue for a block's first N_A pairs from sorted slot ``first`` (``acc``) and the N_B after them
        (``acc_b``, where N_B > 0): :func:`_w2_rows` of each."""
        _w2_rows(acc, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_out, summed,
                 TOP_K, ATOMIC, BLOCK_N, N_A, SUM_LAST)  # fmt: skip
        if N_B > 0:
            _w2_rows(acc_b, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first + N_A, pid_n, num_pairs, N, stride_out,
                     summed, TOP_K, ATOMIC, BLOCK_N, N_B, SUM_LAST)  # fmt: skip

    @gluon.jit
    def _weight_rows(qw_ptr, expert, rows, rows_ok, stride_qw_e, stride_qw_band, stride_qw_row):
        """Each weight row's first word [rows, 1] and its mask, in the copy layout (kernels.common.word_strides)."""
        W_COPY_LAYOUT: gl.constexpr = w_copy_layout(gl.num_warps())
        rows = gl.convert_layout(rows, gl.SliceLayout(1, W_COPY_LAYOUT))
        ok = gl.convert_layout(rows_ok, gl.SliceLayout(1, W_COPY_LAYOUT))
        w_rows = qw_ptr + expert * stride_qw_e + gl.expand_dims(word_rows(rows, stride_qw_band, stride_qw_row), 1)
        return w_rows, gl.expand_dims(ok, 1)

    @gluon.jit
    def _zero_share(ptr, numel):
        """This program's share of ``ptr[:numel]`` set to zero: w13 clears the output that w2 then adds the top-k
        into (``reduce="out"``), so the sum costs no launch of its own. Every program takes part, live or not."""
        ZERO_BLOCK: gl.constexpr = 8 * 32 * gl.num_warps()  # 16-byte stores of fp16, one per thread per step
        ZERO_LAYOUT: gl.constexpr = zero_layout(gl.num_warps())
        span = gl.cdiv(gl.cdiv(numel, gl.num_programs(0)), ZERO_BLOCK) * ZERO_BLOCK
        start = gl.program_id(0) * span
        end = gl.minimum(numel, start + span)
        offs = gl.arange(0, ZERO_BLOCK, layout=ZERO_LAYOUT)
        for z in range(start, end, ZERO_BLOCK):
            idx = z + offs
            gl.store(ptr + idx, gl.zeros([ZERO_BLOCK], ptr.dtype.element_ty, ZERO_LAYOUT), mask=idx < end)

    @gluon.jit
    def _w13_block(w_rows, w_ok, stride_step, rows_ok, scales_e, zeros_e, rows, x_ptr, token_rows, pair_mask,
                   perm_row_ptr, K, stride_s_g, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_inter,
                   ROWS: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_LEN: gl.constexpr, HAS_ZEROS: gl.constexpr,
                   SYM_ZERO: gl.constexpr, HAS_PERM: gl.constexpr, STAGES: gl.constexpr, SCALE_AFTER: gl.constexpr,
                   BLOCK_N: gl.constexpr, N_A: gl.constexpr, N_B: gl.constexpr):  # fmt: skip
        """One w13 program: the K loop for its first N_A pairs (and the N_B after them), then their stores."""
        acc, acc_b = _k_loop(w_rows, w_ok, stride_step, rows_ok, scales_e, zeros_e, rows, x_ptr, token_rows, pair_mask,
                             perm_row_ptr, K, stride_s_g, ROWS, BLOCK_M, GROUP_LEN, HAS_ZEROS, SYM_ZERO, HAS_PERM,
                             STAGES, SCALE_AFTER, N_A, N_B)  # fmt: skip
        _w13_store(acc, acc_b, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_inter, BLOCK_N, N_A, N_B,
                   False)  # fmt: skip

    @gluon.jit
    def _w2_block(w_rows, w_ok, stride_step, rows_ok, scales_e, zeros_e, rows, x_ptr, token_rows, pair_mask,
                  perm_row_ptr, K, stride_s_g, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs,
                  N, stride_out, summed, ROWS: gl.constexpr, BLOCK_M: gl.constexpr, GROUP_LEN: gl.constexpr,
                  HAS_ZEROS: gl.constexpr, SYM_ZERO: gl.constexpr, STAGES: gl.constexpr, SCALE_AFTER: gl.constexpr,
                  TOP_K: gl.constexpr, ATOMIC: gl.constexpr, N_A: gl.constexpr, N_B: gl.constexpr,
                  SUM_LAST: gl.constexpr):  # fmt: skip
        """One w2 program: the K loop for its first N_A pairs (and the N_B after them), then their weighted stores
        or adds."""
        acc, acc_b = _k_loop(w_rows, w_ok, stride_step, rows_ok, scales_e, zeros_e, rows, x_ptr, token_rows, pair_mask,
                             perm_row_ptr, K, stride_s_g, ROWS, BLOCK_M, GROUP_LEN, HAS_ZEROS, SYM_ZERO, False,
                             STAGES, SCALE_AFTER, N_A, N_B)  # fmt: skip
        _w2_store(acc, acc_b, topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_out,
                  summed, TOP_K, ATOMIC, ROWS, N_A, N_B, SUM_LAST)  # fmt: skip

    @gluon.jit
    def _w13_kernel(
        x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, inter_ptr,
        sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, zero_ptr,
        num_pairs, num_pid_m, N, K, zero_numel,
        stride_x, stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g, stride_inter,
        TOP_K: gl.constexpr, GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr,
        HAS_PERM: gl.constexpr, ZERO_OUT: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
        SCALE_AFTER: gl.constexpr, RAGGED: gl.constexpr = False, DEPENDENT: gl.constexpr = False,
    ):  # fmt: skip
        """inter[pair, n] = silu(gate_n . x) * (up_n . x): gate rows then up rows of BLOCK_N channels form one
        A tile of 2 * BLOCK_N rows, split by the epilogue. With ZERO_OUT, also ``zero_ptr[:zero_numel] = 0``.
        RAGGED: the MMAs as wide as the block's real pairs (:data:`RAGGED_TILES`)."""
        ROWS: gl.constexpr = 2 * BLOCK_N
        WORD_LAYOUT: gl.constexpr = word_layout(ROWS, gl.num_warps())
        await_previous_kernel(DEPENDENT)
        if ZERO_OUT:
            _zero_share(zero_ptr, zero_numel)
        pid_m, pid_n, pairs, expert, live = _block(gl.program_id(0), sorted_pairs_ptr, block_experts_ptr,
                                                   num_blocks_ptr, num_pid_m, N, BLOCK_M, BLOCK_N,
                                                   GROUP_M)  # fmt: skip
        pair_mask = pairs < num_pairs
        if live:
            offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, WORD_LAYOUT))
            channels = pid_n * BLOCK_N + offs_r % BLOCK_N
            rows = channels + (offs_r // BLOCK_N) * N
            rows_ok = channels < N
            w_rows, w_ok = _weight_rows(qw_ptr, expert, rows, rows_ok, stride_qw_e, stride_qw_band, stride_qw_row)
            token_rows = x_ptr + (pairs // TOP_K).to(gl.int64) * stride_x
            first = pid_m * BLOCK_M
            # fmt: off
            args = (w_rows, w_ok, stride_qw_step, rows_ok, scales_ptr + expert * stride_s_e,
                    zeros_ptr + expert * stride_s_e, rows, x_ptr, token_rows, pair_mask, perm_ptr + expert * K, K,
                    stride_s_g, inter_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N,
                    stride_inter)  # the runtime arguments (a tuple's constexprs would turn into tensors)
            path = _ragged_path(sorted_pairs_ptr, first, num_pairs, BLOCK_M, RAGGED)
            for p in gl.static_range(ragged_paths(RAGGED)):  # one K loop per width; a block runs one
                if path == p:
                    _w13_block(*args, ROWS, BLOCK_M, GROUP_LEN, HAS_ZEROS, SYM_ZERO, HAS_PERM, STAGES, SCALE_AFTER,
                               BLOCK_N, ragged_width(BLOCK_M, p, 0), ragged_width(BLOCK_M, p, 1))
            # fmt: on

    @gluon.jit
    def _w2_kernel(
        inter_ptr, qw_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr,
        sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, sum_ptr, counts_ptr,
        num_pairs, num_pid_m, N, K,
        stride_inter, stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g, stride_out,
        stride_sum,
        TOP_K: gl.constexpr, GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr,
        ATOMIC: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
        SCALE_AFTER: gl.constexpr, RAGGED: gl.constexpr = False, DEPENDENT: gl.constexpr = False,
        SUM_LAST: gl.constexpr = False,
    ):  # fmt: skip
        """out[pair or token, n] (+)= w[pair] * (W2[e] @ inter[pair])[n] (RAGGED: as the w13 kernel); SUM_LAST: out
        holds per-pair rows, and each token's are summed into ``sum_ptr`` [M, N] where its last one is written
        (``counts_ptr``: [M, N / BLOCK_N] int32 that w13 cleared; :func:`_sum_last_rows`)."""
        await_previous_kernel(DEPENDENT)
        WORD_LAYOUT: gl.constexpr = word_layout(BLOCK_N, gl.num_warps())
        pid_m, pid_n, pairs, expert, live = _block(gl.program_id(0), sorted_pairs_ptr, block_experts_ptr,
                                                   num_blocks_ptr, num_pid_m, N, BLOCK_M, BLOCK_N,
                                                   GROUP_M)  # fmt: skip
        pair_mask = pairs < num_pairs
        if live:
            rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WORD_LAYOUT))
            rows_ok = rows < N
            w_rows, w_ok = _weight_rows(qw_ptr, expert, rows, rows_ok, stride_qw_e, stride_qw_band, stride_qw_row)
            token_rows = inter_ptr + pairs.to(gl.int64) * stride_inter
            first = pid_m * BLOCK_M
            # fmt: off
            args = (w_rows, w_ok, stride_qw_step, rows_ok, scales_ptr + expert * stride_s_e,
                    zeros_ptr + expert * stride_s_e, rows, inter_ptr, token_rows, pair_mask, inter_ptr, K, stride_s_g,
                    topk_weights_ptr, out_ptr, sorted_pairs_ptr, first, pid_n, num_pairs, N, stride_out,
                    (sum_ptr, counts_ptr, stride_sum))  # the runtime arguments, as in the w13 kernel
            path = _ragged_path(sorted_pairs_ptr, first, num_pairs, BLOCK_M, RAGGED)
            for p in gl.static_range(ragged_paths(RAGGED)):  # as the w13 kernel
                if path == p:
                    _w2_block(*args, BLOCK_N, BLOCK_M, GROUP_LEN, HAS_ZEROS, SYM_ZERO, STAGES, SCALE_AFTER, TOP_K,
                              ATOMIC, ragged_width(BLOCK_M, p, 0), ragged_width(BLOCK_M, p, 1), SUM_LAST)
            # fmt: on


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------


def scale_after(tile: GluonTile, dtype: torch.dtype) -> bool:
    """Whether ``tile``'s K steps sum exact ``q - zero`` times x and scale each step's fp32 sum once per accumulator
    element, for one more accumulator's registers: bf16 token tiles up to SCALE_AFTER_MAX_BLOCK_M, where it takes
    five of the seven instructions per two weights away (M = 16..256 11-18% faster on the H200, and exact); in fp16
    it saves one of three and measured within +-5% either way, so fp16 keeps the scale in the dequantization
    (benchmarks/KERNEL_NOTES.md item 20), unless :data:`SCALE_AFTER_FP16_PERSISTENT` asks it of the persistent tiles."""
    scaled = dtype == torch.bfloat16 or (SCALE_AFTER_FP16_PERSISTENT and tile.per_sm > 0)
    return scaled and tile.block_m <= SCALE_AFTER_MAX_BLOCK_M


def ragged(tile: GluonTile, dtype: torch.dtype) -> bool:
    """Whether ``tile``'s MMAs follow each block's real pairs (:data:`RAGGED_TILES`): persistent tiles of 64 tokens
    and up (a quarter is a whole 16-token MMA), one program per tile from :data:`RAGGED_ONE_PROGRAM_MIN_M` tokens,
    whose K steps are not scaled after the sum."""
    least = 64 if tile.per_sm else max(64, RAGGED_ONE_PROGRAM_MIN_M)
    return RAGGED_TILES and tile.block_m >= least and not scale_after(tile, dtype)


def launch_constants(tile: GluonTile, kernel: str, *, top_k: int, group_len: int, has_zeros: bool,
                     has_perm: bool = False, atomic: bool = False, zero_out: bool = False, sum_last: bool = False,
                     dtype: torch.dtype = torch.float16) -> dict:  # fmt: skip
    """The constexprs and launch options of ``kernel`` ("w13" or "w2") for ``tile``: what :func:`launch` launches
    and the CPU compile test (tests/runtime/test_gluon_compile_sm90.py) builds. The layouts are the kernels' own."""
    flags = dict(HAS_PERM=has_perm, ZERO_OUT=zero_out) if kernel == "w13" else dict(ATOMIC=atomic, SUM_LAST=sum_last)
    return dict(
        flags,
        TOP_K=top_k,
        GROUP_LEN=group_len,
        SYM_ZERO=8,
        HAS_ZEROS=has_zeros,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n if kernel == "w13" else tile.w2_rows,
        GROUP_M=tile.group_m,
        STAGES=tile.stages,
        SCALE_AFTER=scale_after(tile, dtype),
        RAGGED=ragged(tile, dtype),
        num_warps=tile.warps,
        **({"maxnreg": TWO_PROGRAMS_MAXNREG} if two_programs(tile, kernel) else {}),
    )


SM90_SHARED_PER_SM = 228 * 1024  # an H100's / H200's shared memory per SM
SM90_BLOCK_RESERVED = 1024  # of it, what the driver keeps for each resident program


def ring_bytes(tile: GluonTile, kernel: str) -> int:
    """Shared memory of one program of ``kernel``, all of it the ring (the epilogue reuses it): per stage the
    [rows, 16] int32 words and the [2 * block_m, 64] fp16 / bf16 activations."""
    rows = 2 * tile.block_n if kernel == "w13" else tile.w2_rows
    return tile.stages * (rows * 16 * 4 + 2 * tile.block_m * 64 * 2)


def two_programs(tile: GluonTile, kernel: str) -> bool:
    """Whether ``kernel`` of ``tile`` is capped at :data:`TWO_PROGRAMS_MAXNREG` registers to run two programs an SM."""
    fits = 2 * (ring_bytes(tile, kernel) + SM90_BLOCK_RESERVED) <= SM90_SHARED_PER_SM
    return bool(TWO_PROGRAMS_MAXNREG) and tile.warps == 8 and not tile.per_sm and fits


def launch(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights,  # an mma128 stack (:func:`reads`)
    topk_ids: torch.Tensor,  # [M, T] int32/int64
    topk_weights: torch.Tensor,  # [M, T] fp32
    rows: Alignment,  # pairs sorted by expert into blocks of config.gluon.block_m
    inter: torch.Tensor,  # [P, I] activation dtype: w13's output, w2's input
    target: torch.Tensor,  # [P, H] activation dtype ("pairs", "last"), else [M, H] added to: fp32 ("atomic") or out
    config: KernelConfig,  # its ``gluon`` tile (set) and ``reduce``; the tl tile is not read
    x_per_pair: bool = False,  # x is [P, H], one row per pair (act-order rows gathered by kernels/act_order.py)
    out: torch.Tensor | None = None,  # [M, H]: where "last" sums each token's rows
) -> None:
    """w13 then w2 over the aligned token blocks ``rows``: ``inter`` receives ``silu(gate) * up``, ``target`` the
    weighted w2 output, added to in fp32 (``reduce="atomic"``) or one row per pair (summed into ``out`` by w2 itself
    where ``reduce="last"``)."""
    tile = config.gluon
    if tile is None or rows.block_m != tile.block_m:
        raise ValueError(f"gluon_sm90.launch: alignment blocks of {rows.block_m} rows for the Gluon tile {tile}")
    top_k = topk_ids.shape[1]
    h, n_inter, num_pairs = weights.hidden_size, weights.intermediate_size, topk_ids.numel()
    num_pid_m = rows.max_blocks
    zeros13 = weights.w13_zeros if weights.w13_zeros is not None else weights.w13_scales
    has_perm, has_zeros = weights.w13_perm is not None, weights.w13_zeros is not None
    perm = weights.w13_perm if has_perm else rows.sorted_pairs
    w13, s13 = weights.w13_qweight, weights.w13_scales
    row_args = [rows.sorted_pairs, rows.block_experts, rows.num_blocks, num_pairs, num_pid_m]
    grid13 = (num_pid_m * triton.cdiv(n_inter, tile.block_n),)
    # the [M, H] target w2 adds into is contiguous: fused_moe makes sure
    cleared, numel, counts = cleared_by_w13(config.reduce, target, topk_ids.shape[0], h, tile.w2_rows)
    _w13_kernel[grid13](
        x, w13, s13, zeros13, perm, inter, *row_args[:3], cleared, *row_args[3:], n_inter, h, numel,
        x.stride(0), *word_strides(w13, weights.tiled), s13.stride(0), s13.stride(1), inter.stride(0),
        **launch_constants(tile, "w13", top_k=1 if x_per_pair else top_k, group_len=weights.group_len(h),
                           has_zeros=has_zeros, has_perm=has_perm, zero_out=numel > 0, dtype=x.dtype),
        **dependent_launches(x.device),
    )  # fmt: skip
    launch_w2(inter, weights, topk_ids, topk_weights, rows, target, tile, config.reduce, out, counts)


def adds_into_target(reduce: str) -> bool:
    """Whether w2 adds into an [M, H] target ("out", "atomic") rather than writing one row per pair."""
    return reduce in ("out", "atomic")


def cleared_by_w13(
    reduce: str, target: torch.Tensor, m: int, h: int, w2_rows: int
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """(what w13 clears, how many elements, the tickets of "last" or None): the [M, H] target w2 adds into ("out",
    "atomic"); the [M, H / w2_rows] int32 tickets of "last" (w2's top-k sum: one per token and weight-row tile, left
    uninitialised here); nothing for "pairs" (the target, 0 elements)."""
    if reduce == "last":
        counts = torch.empty(m * triton.cdiv(h, w2_rows), dtype=torch.int32, device=target.device)
        return counts, counts.numel(), counts
    return target, target.numel() if adds_into_target(reduce) else 0, None


def last_sum_args(reduce: str, target: torch.Tensor, out: torch.Tensor | None,
                  counts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """w2's (sum_ptr, counts_ptr, stride_sum): for "last" the [M, H] output each token's rows are summed into and the
    tickets w13 cleared; otherwise unread (the target stands in)."""
    if reduce != "last":
        return target, target, target.stride(0)
    if out is None or counts is None:
        raise ValueError("gluon_sm90: reduce 'last' sums into an output through counts w13 cleared")
    return out, counts, out.stride(0)


def launch_w2(
    inter: torch.Tensor,  # [P, I] activation dtype: w13's output
    weights: MoeWeights,
    topk_ids: torch.Tensor,  # [M, T]
    topk_weights: torch.Tensor,  # [M, T] fp32
    rows: Alignment,  # pairs sorted by expert into blocks of tile.block_m
    target: torch.Tensor,  # as :func:`launch`'s
    tile: GluonTile,
    reduce: str,  # "pairs", "out", "atomic" or "last"
    out: torch.Tensor | None = None,  # "last": [M, H], each token's rows summed into it
    counts: torch.Tensor | None = None,  # "last": :func:`cleared_by_w13`'s tickets for tile.w2_rows
) -> None:
    """w2 alone (:func:`launch`'s second launch; the warp-specialized w13 is followed by it where K is short)."""
    h, n_inter, num_pairs, num_pid_m = weights.hidden_size, weights.intermediate_size, topk_ids.numel(), rows.max_blocks
    zeros2 = weights.w2_zeros if weights.w2_zeros is not None else weights.w2_scales
    w2, s2 = weights.w2_qweight, weights.w2_scales
    row_args = [rows.sorted_pairs, rows.block_experts, rows.num_blocks]
    sum_ptr, counts_ptr, stride_sum = last_sum_args(reduce, target, out, counts)
    grid2 = (num_pid_m * triton.cdiv(h, tile.w2_rows),)
    _w2_kernel[grid2](
        inter, w2, s2, zeros2, topk_weights, target, *row_args, sum_ptr, counts_ptr, num_pairs, num_pid_m, h, n_inter,
        inter.stride(0), *word_strides(w2, weights.tiled), s2.stride(0), s2.stride(1), target.stride(0), stride_sum,
        **launch_constants(tile, "w2", top_k=topk_ids.shape[1], group_len=weights.group_len(n_inter),
                           has_zeros=weights.w2_zeros is not None, atomic=adds_into_target(reduce),
                           sum_last=reduce == "last", dtype=inter.dtype),
        **dependent_launches(inter.device),
    )  # fmt: skip


class GluonSm90(KernelFamily):
    """mma128 stacks on a Hopper GPU (:func:`reads`, :func:`runs_on`), unless $PORTABLE_ENV."""

    family = Family.GLUON_SM90
    topk_sum = TopkSum.BY_REDUCE
    clears_target = True  # w13 zeroes the [M, H] target ("atomic", "out") w2 adds into
    reduce_modes = ("pairs", "atomic", "out", "last")  # "last": w2 sums each token's rows (_sum_last_rows)
    interpreted = False  # Gluon: compiled for the GPU only

    def supports(self, call: Call) -> bool:
        return reads(call.weights) and os.environ.get(PORTABLE_ENV, "") != "1" and runs_on(call.device)

    def asked_by(self, config: KernelConfig) -> bool:
        """Its own configs and, where $GLUON_ENV is "1", every aligned tensor-core one."""
        tensor_core = config.family is not Family.DECODE and not config.direct
        return config.family is self.family or (tensor_core and os.environ.get(GLUON_ENV, "") == "1")

    def configure(self, config: KernelConfig, call: Call) -> KernelConfig | None:
        """A config with a tile of these kernels runs it; one without takes :func:`heuristic_tile`'s tile and
        :func:`heuristic_reduce`'s sum, where :func:`preferred` (or $GLUON_ENV) says so. "last" past
        :data:`SUM_LAST_MAX_M` tokens a tile is "pairs"."""
        if not self.supports(call):
            return None
        tile, reduce = config.gluon, config.reduce
        if tile is None:
            asked = os.environ.get(GLUON_ENV, "") == "1"
            if not asked and not preferred(call.weights, call.dtype):
                return None
            tile = heuristic_tile(call.num_pairs, call.weights.num_experts, call.dtype)
            reduce = heuristic_reduce(call.dtype)
        if reduce == "last" and tile.block_m > SUM_LAST_MAX_M:
            reduce = "pairs"
        return replace(config, family=self.family, gluon=fitted_tile(tile, call.weights, call.dtype), reduce=reduce)

    def heuristic(self, call: Call) -> KernelConfig | None:
        """Where these kernels run and are :func:`preferred` (or $GLUON_ENV asks): their heuristic's tile and sum,
        beside the weight-major heuristic's tl tile."""
        tl_tile = weight_major.heuristic_tile(call.num_pairs, call.weights.num_experts)
        return self.configure(KernelConfig(Family.GLUON_SM90, **tl_tile, scale_acc=False), call)

    def block_rows(self, config: KernelConfig) -> int:
        return config.gluon.block_m

    def run(self, work: Work, config: KernelConfig) -> None:
        """Act-order stacks (:data:`ACT_ORDER_GATHER`): each pair's row gathered once, then the plain kernels."""
        x, weights, x_per_pair = work.x, work.weights, False
        inter = torch.empty(work.topk_ids.numel(), weights.intermediate_size, dtype=x.dtype, device=x.device)
        if weights.w13_perm is not None and ACT_ORDER_GATHER:
            x, x_per_pair = gather_act_order(x, work.topk_ids, weights.w13_perm), True
            weights = replace(weights, w13_perm=None)
        if config.gluon.per_sm:  # the warp-specialized module imports this one
            from repack.runtime.kernels import gluon_ws_sm90

            gluon_ws_sm90.launch(x, weights, work.topk_ids, work.topk_weights, work.rows, inter, work.target,
                                 config.gluon, config.reduce, x_per_pair=x_per_pair, out=work.out)  # fmt: skip
        else:
            launch(x, weights, work.topk_ids, work.topk_weights, work.rows, inter, work.target, config,
                   x_per_pair=x_per_pair, out=work.out)  # fmt: skip


FAMILY = GluonSm90()
