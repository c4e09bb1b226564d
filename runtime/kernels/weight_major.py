"""Weight-major tensor-core kernels: the dequantized int4 weights are the MMA's A operand, tokens its N side.

Hopper's wgmma takes A from registers and B from shared memory. With tokens on A (the usual orientation)
every dequantized weight has to be stored to shared memory and read back before the MMA, element by element
(what kept the kernels of fused_moe.py at a third of the fp16 kernel's throughput). Swapping the operands,
``out^T = W @ x^T``, sends the weights words -> registers -> dequantized -> MMA: only the int4 words (by
cp.async) and the activations go through shared memory, and the token side can be as narrow as 16 rows,
so a block of a few tokens wastes no weight bytes.

Each K step of 128 runs eight 16-deep dots on the words of that step, the unpacking elementwise in the
registers the words were loaded into (shift, mask, exponent OR, fp16x2 subtract and multiply). How a dot's
16 K values sit in the words depends on the stack's word order (SPEC.md section 3):

- ``mma128`` (what the converter writes when it can): one ``(word >> 4i) & 0x000F000F | 0x64006400`` gives
  an fp16x2 register holding inputs ``k, k + 1`` of chunk ``c = 4g + i``, exactly the pair a thread of the
  wgmma A fragment holds, so one mask serves two weights and chunk c multiplies the contiguous activation
  columns ``16c .. 16c + 15``: no activation reordering anywhere.
- ``gptq`` (plain GPTQ order, field ``s`` of word ``j`` is input ``8j + s``): one dot per nibble position
  ``s``; its columns ``k0 + 8j + s`` are read in *nibble-major* order, where position ``16s + j`` of each
  128-block holds column ``8j + s``: w13 reads the hidden states through ``nibble_major`` (one copy per
  call) and writes its intermediate in that order (a tile of output positions computes the channels those
  positions hold; every weight row is its own contiguous run, so choosing rows costs nothing).

Act-order stacks gather their activation columns through the permutation instead; DIRECT (decode) blocks
gather their few tokens' columns and need no copy.

Needs 4-bit weights, K % 128 == 0 for both GEMMs, and groups of a multiple of 128 (one scale row per K
step): :func:`supports`; fused_moe runs other stacks on the gptq-order kernels (runtime/kernels/gptq_order.py).
The ``weight_major`` family (:data:`FAMILY`): aligned row blocks or one block per pair (``direct``), the top-k
sum as the config's ``reduce`` says; it also runs the tl tile of a ``gluon_sm90`` config where the Gluon kernels
do not run, and of a ``gptq_order`` config on an mma128 stack (the only tl family that reads mma128 words). The
gptq order is what version-1 checkpoints hold (formats/SPEC.md section 6): the defaults reach it there.
Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.formats.stacks import MMA128_BLOCK, MMA_ORDERS, choose_word_order
from repack.runtime.kernel_config import Family, KernelConfig
from repack.runtime.kernels.align import Alignment
from repack.runtime.kernels.common import (
    TL_DTYPES,
    block_rows,
    expert_of,
    launch_tiles,
    projection_args,
    tile_ids,
    word_rows,
)
from repack.runtime.kernels.family import Call, KernelFamily, TopkSum, Work
from repack.runtime.weights import MoeWeights

STEP_K = MMA128_BLOCK  # K values per step: 16 int32 words per row, eight 16-deep dots
WORDS = STEP_K // 8
# bf16 activations on these kernels. True (default): each fp16 scale is rounded to bf16 inside the dequantized
# weight, as serving stacks that cast GPTQ scales to the model dtype do; bf16 then runs as fast as fp16. False: the
# scale is applied exactly, in fp32 once per K step, at the cost of a second accumulator and half-width tiles. Speed
# and error of both: benchmarks/KERNEL_NOTES.md item 13. The decode and Gluon kernels apply scales in fp32 anyway.
BF16_SCALES_IN_WEIGHTS = True


def supports(bits: int, hidden_size: int, intermediate_size: int, group_size: int) -> bool:
    """Whether these kernels can run a stack (else fused_moe uses the gptq-order kernels): exactly the
    stacks the converter writes in an mma128 order, whose rule is this kernel's K step of 128 (SPEC.md section 3)."""
    return choose_word_order(bits, hidden_size, intermediate_size, group_size) in MMA_ORDERS


def nibble_major(x: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [M, K] with position ``128b + 16s + j`` holding column ``128b + 8j + s`` (a copy)."""
    m, k = x.shape
    return x.reshape(m, k // STEP_K, WORDS, 8).transpose(2, 3).reshape(m, k)


@triton.jit
def _channel_of(position):
    """The channel stored at nibble-major position ``position`` (the inverse of ``nibble_major``'s order)."""
    return position // 128 * 128 + position % 16 * 8 + position % 128 // 16


@triton.jit
def _nibble_weights(words, zero_f, scale, s: tl.constexpr, ACT_DTYPE: tl.constexpr, SCALE_ACC: tl.constexpr):
    """Field ``s`` of each int32 word as an MMA operand: ``q - zero`` exactly (SCALE_ACC), else its fp16 product
    with the scale (one rounding: GPTQModel's ``fp16(scale * (q - zero))``).

    ``zero_f`` is ``1024 + zero`` (fp16) or ``128 + zero`` (bf16): OR-ing the nibble into the mantissa of 1024
    (0x6400) or 128 (0x4300) makes ``bias + q`` without an int-to-float conversion, and the subtraction is exact.
    """
    q = (words >> (4 * s)) & 0xF
    if tl.float16 == ACT_DTYPE:
        biased = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        biased = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return _unbias(biased, zero_f, scale, ACT_DTYPE, SCALE_ACC)


@triton.jit
def _mask_or(words, MASK: tl.constexpr, MAGIC: tl.constexpr, INLINE_PTX: tl.constexpr):
    """``(words & MASK) | MAGIC`` as one LOP3 per 32-bit word.

    Written as ``&`` then ``|``, ptxas emits two LOP3s (SASS has one immediate slot and it does not hoist the other
    into a register); with mask and magic as kernel arguments it is one, but Triton then stopped rematerialising the
    dequantization in the MMA operand layout and sent every dequantized weight through shared memory. PTX ``lop3``
    with both immediates gives the one LOP3 and keeps the layout (the SASS counts: benchmarks/KERNEL_NOTES.md
    item 14). The interpreter cannot run PTX: ``INLINE_PTX`` is False there."""
    if INLINE_PTX:
        return tl.inline_asm_elementwise(
            f"lop3.b32 $0, $1, {MASK}, {MAGIC}, 0xEA;", "=r,r", [words], dtype=tl.int32, is_pure=True, pack=1
        )
    return (words & MASK) | MAGIC


@triton.jit
def pair_weights(words, zero_f, zero_odd, scale, i: tl.constexpr, ACT_DTYPE: tl.constexpr, SCALE_ACC: tl.constexpr,
                  INLINE_PTX: tl.constexpr):  # fmt: skip
    """Chunk ``4g + i`` of ``mma128`` words [rows, 8] (half ``g`` of a K step) as a [rows, 16] MMA operand.

    One LOP3 per two weights: fields ``i`` and ``4 + i`` of word ``m`` are inputs ``2m`` and ``2m + 1`` of the chunk,
    and ``(w & mask) | magic`` (:func:`_mask_or`) lands them as the low and high fp16 (or bf16) of one 32-bit value;
    join + reshape puts them side by side along K without moving them.

    fp16 saves the shifts too: an odd chunk's fields sit four bits up, where the mask keeps them as ``1024 + 16q``,
    and ``v / 16 - (64 + zero)`` is ``q - zero`` exactly (one HFMA2, as the even chunks' ``v - (1024 + zero)`` is one
    HADD2); chunks 2 and 3 share one shift by 8. bf16 has three mantissa bits fewer, so ``16q`` would reach its
    exponent: every chunk is shifted down to bits 0..3 and 16..19 first.
    """
    if tl.float16 == ACT_DTYPE:
        src = words if i < 2 else words >> 8
        both = _mask_or(src, 0x00F000F0 if i % 2 == 1 else 0x000F000F, 0x64006400, INLINE_PTX)
    else:
        both = _mask_or(words >> (4 * i), 0x000F000F, 0x43004300, INLINE_PTX)
    lo = (both & 0xFFFF).to(tl.int16).to(ACT_DTYPE, bitcast=True)
    hi = (both >> 16).to(tl.int16).to(ACT_DTYPE, bitcast=True)
    biased = tl.reshape(tl.join(lo, hi), (words.shape[0], 16))  # [rows, 8] x 2 -> [rows, 8, 2] -> [rows, 16]
    if tl.float16 == ACT_DTYPE and i % 2 == 1:
        return _unbias(biased * 0.0625, zero_odd, scale, ACT_DTYPE, SCALE_ACC)  # 1024 + 16q -> 64 + q, exact
    return _unbias(biased, zero_f, scale, ACT_DTYPE, SCALE_ACC)


@triton.jit
def _unbias(biased, zero_f, scale, ACT_DTYPE: tl.constexpr, SCALE_ACC: tl.constexpr):
    """``bias + q`` [rows, K] -> ``q - zero`` (exact), times the row's scale in the activation dtype unless SCALE_ACC
    (which scales the K step's fp32 sum instead). In bf16 the fp16 scale is rounded to bf16 first, as serving stacks
    that cast GPTQ scales to the model dtype do: 2^-9 relative per scale, where SCALE_ACC keeps it exact."""
    w = biased - zero_f[:, None]
    if not SCALE_ACC:
        w = w * scale[:, None].to(ACT_DTYPE)
    return w


@triton.jit
def zero_bias(zero, ACT_DTYPE: tl.constexpr):
    """``1024 + zero`` (fp16) or ``128 + zero`` (bf16): what the exponent trick leaves in each weight, plus its zero."""
    if tl.float16 == ACT_DTYPE:
        bias = (zero + 1024).to(tl.float16)
    else:
        bias = (zero + 128).to(tl.bfloat16)
    return bias


@triton.jit
def _block_pairs(pid_m, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, topk_ids_ptr, num_pairs, num_experts,
                 BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):  # fmt: skip
    """(pairs, pair mask, expert, whether the block exists) of row block ``pid_m``.

    DIRECT (decode): block ``pid_m`` is pair ``pid_m`` alone, its expert read from ``topk_ids``, so no
    alignment launch runs; its other BLOCK_M - 1 columns hold the sentinel ``num_pairs`` and are masked.
    """
    if DIRECT:
        lane = tl.arange(0, BLOCK_M)
        pairs = tl.where(lane == 0, pid_m, num_pairs)
        expert = expert_of(topk_ids_ptr, pid_m, num_experts)
        live = pid_m < num_pairs
    else:
        pairs, _mask, expert = block_rows(pid_m, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
        live = pid_m < tl.load(num_blocks_ptr)
    return pairs, pairs < num_pairs, expert, live


@triton.jit
def _activation_columns(k0, c: tl.constexpr, offs_j, perm_row_ptr, HAS_PERM: tl.constexpr, MMA_ORDER: tl.constexpr,
                        NIBBLE_MAJOR_X: tl.constexpr):  # fmt: skip
    """The [16] activation columns dot ``c`` of the K step at ``k0`` multiplies.

    mma128: the contiguous inputs ``k0 + 16c + j``. gptq: inputs ``k0 + 8j + c`` (nibble ``c`` of each word),
    contiguous at ``k0 + 16c + j`` when the activations are in nibble-major order, else gathered. Act-order:
    gathered through the permutation, whose index is the input."""
    if MMA_ORDER:
        inputs = k0 + c * 16 + offs_j
    else:
        inputs = k0 + offs_j * 8 + c
    if HAS_PERM:
        cols = tl.load(perm_row_ptr + inputs)
    elif NIBBLE_MAJOR_X and not MMA_ORDER:
        cols = k0 + c * 16 + offs_j
    else:
        cols = inputs
    return cols


@triton.jit
def _step_quant(scales_ptr, zeros_ptr, rows, k0, stride_s_g, row_mask, GROUP_LEN: tl.constexpr,
                HAS_ZEROS: tl.constexpr, SYM_ZERO: tl.constexpr, ACT_DTYPE: tl.constexpr):  # fmt: skip
    """(scale, zero bias, odd-chunk zero bias ``64 + zero``) of the rows for the group holding K step ``k0``.

    ``GROUP_LEN`` is a compile-time constant: a division by a run-time group length cost ~25 instructions per step."""
    group = k0 // GROUP_LEN
    scale = tl.load(scales_ptr + group * stride_s_g + rows, mask=row_mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + group * stride_s_g + rows, mask=row_mask, other=0).to(tl.int32)
    else:
        zero = tl.full(rows.shape, SYM_ZERO, tl.int32)
    return scale, zero_bias(zero, ACT_DTYPE), (zero + 64).to(tl.float16)


@triton.jit
def _k_loop(acc, w_ptrs, stride_step, a_cols, perm_row, scales_e, zeros_e, rows, row_mask, pair_mask, K, stride_s_g,
            GROUP_LEN: tl.constexpr, HAS_ZEROS: tl.constexpr, SYM_ZERO: tl.constexpr, ACT_DTYPE: tl.constexpr,
            SCALE_ACC: tl.constexpr, HAS_PERM: tl.constexpr, MMA_ORDER: tl.constexpr, NIBBLE_MAJOR_X: tl.constexpr,
            QUANT_AHEAD: tl.constexpr, INLINE_PTX: tl.constexpr):  # fmt: skip
    """acc [rows, BLOCK_M] += W[rows, :] @ A[:, pairs]: the K loop both GEMMs share.

    ``w_ptrs`` [rows, 8] (mma128: half a K step per load) or [rows, 16] (gptq) int32 words of the first step,
    ``stride_step`` words from there to the next step's (kernels.common.word_strides);
    ``a_cols`` [1, BLOCK_M] the activation rows of the block's pairs. SCALE_ACC: exact ``q - zero`` weights,
    the K step's sum scaled once per row in fp32 (bf16); else fp16 weights scaled as dequantized.

    QUANT_AHEAD loads scales and zeros one step ahead: the pipeliner stages only the loads that feed a dot, so a
    scale loaded in the step that uses it waits on a global load every step. The loop-carried scale costs a layout
    conversion, though, and on some tiles (w2 with 64 rows on 4 warps, bf16 w13) it made Triton send every
    dequantized weight through shared memory: the tuner chooses.
    """
    offs_j = tl.arange(0, 16)
    if QUANT_AHEAD:
        scale, zero_f, zero_odd = _step_quant(scales_e, zeros_e, rows, 0, stride_s_g, row_mask, GROUP_LEN, HAS_ZEROS,
                                              SYM_ZERO, ACT_DTYPE)  # fmt: skip
    for k0 in range(0, K, 128):
        if QUANT_AHEAD:
            next_quant = _step_quant(scales_e, zeros_e, rows, tl.minimum(k0 + 128, K - 128), stride_s_g, row_mask,
                                     GROUP_LEN, HAS_ZEROS, SYM_ZERO, ACT_DTYPE)  # fmt: skip
        else:
            scale, zero_f, zero_odd = _step_quant(scales_e, zeros_e, rows, k0, stride_s_g, row_mask, GROUP_LEN,
                                                  HAS_ZEROS, SYM_ZERO, ACT_DTYPE)  # fmt: skip
        part = tl.zeros(acc.shape, dtype=tl.float32) if SCALE_ACC else acc
        if MMA_ORDER:
            low = tl.load(w_ptrs, mask=row_mask[:, None], other=0)  # chunks 0..3
            high = tl.load(w_ptrs + 8, mask=row_mask[:, None], other=0)  # chunks 4..7
            for c in tl.static_range(8):
                cols = _activation_columns(k0, c, offs_j, perm_row, HAS_PERM, MMA_ORDER, NIBBLE_MAJOR_X)
                at = tl.load(a_cols + cols[:, None], mask=pair_mask[None, :], other=0.0)
                words = low if c < 4 else high
                weights = pair_weights(words, zero_f, zero_odd, scale, c % 4, ACT_DTYPE, SCALE_ACC, INLINE_PTX)
                part = tl.dot(weights, at, part)
        else:
            words = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
            for s in tl.static_range(8):
                cols = _activation_columns(k0, s, offs_j, perm_row, HAS_PERM, MMA_ORDER, NIBBLE_MAJOR_X)
                at = tl.load(a_cols + cols[:, None], mask=pair_mask[None, :], other=0.0)
                part = tl.dot(_nibble_weights(words, zero_f, scale, s, ACT_DTYPE, SCALE_ACC), at, part)
        acc = acc + part * scale.to(tl.float32)[:, None] if SCALE_ACC else part
        if QUANT_AHEAD:
            scale, zero_f, zero_odd = next_quant
        w_ptrs += stride_step
    return acc


@triton.jit
def _w13_weight_major_kernel(
    # pointers
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, inter_ptr,
    sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, topk_ids_ptr,
    # sizes
    num_pairs, num_pid_m, num_experts, N, K,
    # strides
    stride_x, stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g, stride_inter,
    # the stack and the activations
    TOP_K: tl.constexpr, GROUP_LEN: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr, MMA_ORDER: tl.constexpr, NIBBLE_MAJOR_X: tl.constexpr, ACT_DTYPE: tl.constexpr,
    # kernel switches
    SCALE_ACC: tl.constexpr, DIRECT: tl.constexpr, QUANT_AHEAD: tl.constexpr, INLINE_PTX: tl.constexpr,
    # tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """inter[pair, p] = silu(gate . x) * (up . x) for the pairs of one block and BLOCK_N output positions ``p``.

    A position is the channel itself (mma128), or the channel a nibble-major position holds (gptq, so w2
    reads its input contiguously). Gate and up rows of those channels form one [2*BLOCK_N, K] A operand
    (one MMA chain per dot, not two); the epilogue splits the accumulator into its gate and up halves.
    """
    pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    pairs, pair_mask, expert, live = _block_pairs(pid_m, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
                                                  topk_ids_ptr, num_pairs, num_experts, BLOCK_M, DIRECT)  # fmt: skip
    if not live:
        return
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_r = tl.arange(0, 2 * BLOCK_N)
    positions = pid_n * BLOCK_N + offs_r % BLOCK_N
    row_mask = positions < N
    channels = positions if MMA_ORDER else _channel_of(positions)
    rows = channels + offs_r // BLOCK_N * N  # gate rows, then the up rows of the same channels
    WORDS_PER_LOAD: tl.constexpr = 8 if MMA_ORDER else 16
    offs_w = tl.arange(0, WORDS_PER_LOAD)
    w_ptrs = qw_ptr + expert * stride_qw_e + word_rows(rows, stride_qw_band, stride_qw_row)[:, None] + offs_w[None, :]
    acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
    x_cols = x_ptr + tokens[None, :] * stride_x
    acc = _k_loop(acc, w_ptrs, stride_qw_step, x_cols, perm_ptr + expert * K, scales_ptr + expert * stride_s_e,
                  zeros_ptr + expert * stride_s_e, rows, row_mask, pair_mask, K, stride_s_g, GROUP_LEN, HAS_ZEROS,
                  SYM_ZERO, ACT_DTYPE, SCALE_ACC, HAS_PERM, MMA_ORDER, NIBBLE_MAJOR_X, QUANT_AHEAD,
                  INLINE_PTX)  # fmt: skip
    # [2*BLOCK_N, BLOCK_M] -> [2, BLOCK_N, BLOCK_M] -> [BLOCK_N, BLOCK_M, 2] -> gate, up [BLOCK_N, BLOCK_M]
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    act = gate / (1.0 + tl.exp(-gate)) * up
    offs_p = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = inter_ptr + pairs[None, :].to(tl.int64) * stride_inter + offs_p[:, None]
    tl.store(out_ptrs, act.to(ACT_DTYPE), mask=(offs_p < N)[:, None] & pair_mask[None, :])


@triton.jit
def _w2_weight_major_kernel(
    # pointers
    inter_ptr, qw_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr,
    sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, topk_ids_ptr,
    # sizes
    num_pairs, num_pid_m, num_experts, N, K,
    # strides
    stride_inter, stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g, stride_out,
    # the stack and the activations
    TOP_K: tl.constexpr, GROUP_LEN: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    MMA_ORDER: tl.constexpr, ACT_DTYPE: tl.constexpr,
    # kernel switches
    ATOMIC: tl.constexpr, SCALE_ACC: tl.constexpr, DIRECT: tl.constexpr, QUANT_AHEAD: tl.constexpr,
    INLINE_PTX: tl.constexpr,
    # tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[pair or token, n] (+)= w[pair] * (W2[e] @ inter[pair])[n]; ``inter`` as the w13 kernel wrote it."""
    pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    pairs, pair_mask, expert, live = _block_pairs(pid_m, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
                                                  topk_ids_ptr, num_pairs, num_experts, BLOCK_M, DIRECT)  # fmt: skip
    if not live:
        return
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    WORDS_PER_LOAD: tl.constexpr = 8 if MMA_ORDER else 16
    offs_w = tl.arange(0, WORDS_PER_LOAD)
    w_ptrs = qw_ptr + expert * stride_qw_e + word_rows(rows, stride_qw_band, stride_qw_row)[:, None] + offs_w[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = _k_loop(acc, w_ptrs, stride_qw_step, inter_ptr + pairs[None, :].to(tl.int64) * stride_inter, inter_ptr,
                  scales_ptr + expert * stride_s_e, zeros_ptr + expert * stride_s_e, rows, row_mask, pair_mask, K,
                  stride_s_g, GROUP_LEN, HAS_ZEROS, SYM_ZERO, ACT_DTYPE, SCALE_ACC, False, MMA_ORDER, True,
                  QUANT_AHEAD, INLINE_PTX)  # fmt: skip
    route_w = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    acc = acc * route_w[None, :]
    mask = row_mask[:, None] & pair_mask[None, :]
    if ATOMIC:
        tokens = (pairs // TOP_K).to(tl.int64)
        tl.atomic_add(out_ptr + tokens[None, :] * stride_out + rows[:, None], acc.to(out_ptr.dtype.element_ty),
                      mask=mask, sem="relaxed")  # fmt: skip
    else:
        out_ptrs = out_ptr + pairs[None, :].to(tl.int64) * stride_out + rows[:, None]
        tl.store(out_ptrs, acc.to(ACT_DTYPE), mask=mask)


def launch(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights,
    topk_ids: torch.Tensor,  # [M, T] int32/int64
    topk_weights: torch.Tensor,  # [M, T] fp32
    rows: Alignment | None,  # pairs sorted by expert into blocks of config.block_m; None with config.direct
    inter: torch.Tensor,  # [P, I] activation dtype: w13's output, w2's input
    target: torch.Tensor,  # [P, H] activation dtype ("pairs"), else [M, H] added to: fp32 ("atomic") or out ("out")
    config: KernelConfig,
    *,
    exact_bf16_scales: bool = False,
) -> None:
    """w13 then w2, the weights as the MMA's register operand. mma128 stacks read the activations as they are;
    aligned blocks of gptq-order stacks read them in nibble-major order (one copy of x; w13 writes the
    intermediate that way). ``config.direct`` gives each pair its own block (no alignment) and gathers its few
    activations. ``exact_bf16_scales`` (:data:`BF16_SCALES_IN_WEIGHTS` off) applies bf16 scales in fp32."""
    h, n_inter, num_pairs = weights.hidden_size, weights.intermediate_size, topk_ids.numel()
    has_perm = weights.w13_perm is not None
    direct = config.direct
    if direct:
        num_pid_m = num_pairs
        # unused: DIRECT blocks read their pair's expert from topk_ids
        blocks = dict(sorted_pairs_ptr=topk_ids, block_experts_ptr=topk_ids, num_blocks_ptr=topk_ids)
    else:
        num_pid_m = rows.max_blocks
        blocks = dict(sorted_pairs_ptr=rows.sorted_pairs, block_experts_ptr=rows.block_experts)
        blocks.update(num_blocks_ptr=rows.num_blocks)
    mma_order = weights.mma_order
    nibble_major_x = not (has_perm or direct or mma_order)
    x_in = nibble_major(x) if nibble_major_x else x  # [M, H], columns in nibble-major order when set
    act_dtype = TL_DTYPES[x.dtype]
    scale_acc = config.scale_acc
    meta = config.meta(with_block_k=False)  # BLOCK_K is STEP_K
    if act_dtype == tl.bfloat16 and not scale_acc and exact_bf16_scales:
        # Exact bf16: the scale applied in fp32 (SCALE_ACC); its second accumulator would double the registers of a
        # tile chosen for fp16 (spills), so the tile gives up half its rows instead.
        scale_acc = True
        meta["BLOCK_N"] = max(32, meta["BLOCK_N"] // 2)
    stack = dict(
        TOP_K=topk_ids.shape[1],
        SYM_ZERO=1 << (weights.bits - 1),
        HAS_ZEROS=weights.w13_zeros is not None,
        MMA_ORDER=mma_order,
        ACT_DTYPE=act_dtype,
    )
    switches = dict(
        SCALE_ACC=scale_acc,
        DIRECT=direct,
        QUANT_AHEAD=config.quant_ahead,
        # Inline PTX (one LOP3 per two weights) where the kernels are compiled for an NVIDIA GPU, not interpreted.
        INLINE_PTX=x.is_cuda and torch.version.hip is None,
    )
    shared = dict(**blocks, **stack, **switches, topk_ids_ptr=topk_ids, num_pairs=num_pairs, num_pid_m=num_pid_m)
    shared.update(num_experts=weights.num_experts)
    args13 = projection_args(weights.w13_qweight, weights.w13_scales, weights.w13_zeros, weights.tiled)
    args13.update(x_ptr=x_in, inter_ptr=inter, N=n_inter, K=h, stride_x=x_in.stride(0), stride_inter=inter.stride(0))
    args13.update(perm_ptr=weights.w13_perm if has_perm else topk_ids, HAS_PERM=has_perm, NIBBLE_MAJOR_X=nibble_major_x)
    args2 = projection_args(weights.w2_qweight, weights.w2_scales, weights.w2_zeros, weights.tiled)
    args2.update(
        inter_ptr=inter, out_ptr=target, N=h, K=n_inter, stride_inter=inter.stride(0), stride_out=target.stride(0)
    )
    args2.update(topk_weights_ptr=topk_weights, ATOMIC=config.reduce != "pairs")
    w13_kernel, w2_kernel = _w13_weight_major_kernel, _w2_weight_major_kernel
    launch_tiles(w13_kernel, num_pid_m, n_inter, meta, x.device, **args13, **shared, GROUP_LEN=weights.group_len(h))
    launch_tiles(w2_kernel, num_pid_m, h, meta, x.device, **args2, **shared, GROUP_LEN=weights.group_len(n_inter))


def heuristic_tile(num_pairs: int, num_experts: int) -> dict:
    """The tile for a shape nobody tuned, as the H200 sweep picked for the tuned ones: the token tile grows with the
    rows each expert gets (also the gptq-order kernels' heuristic: they were never swept past these)."""
    per_expert = num_pairs / max(1, num_experts)
    if per_expert <= 8:
        block_m, block_n, group_m = 16, 128, 1
    elif per_expert <= 24:
        block_m, block_n, group_m = 32, 64, 4
    else:
        block_m, block_n, group_m = 64, 128, 8
    return dict(block_m=block_m, block_n=block_n, block_k=128, group_m=group_m, num_warps=4, num_stages=3)


class WeightMajor(KernelFamily):
    """mma128-able stacks (:func:`supports`), either word order; aligned blocks or one block per pair."""

    family = Family.WEIGHT_MAJOR
    topk_sum = TopkSum.BY_REDUCE
    runs_tl_tiles = True

    def supports(self, call: Call) -> bool:
        w = call.weights
        return supports(w.bits, w.hidden_size, w.intermediate_size, w.group_size)

    def heuristic(self, call: Call) -> KernelConfig | None:
        if not self.supports(call):
            return None
        tile = heuristic_tile(call.num_pairs, call.weights.num_experts)
        return KernelConfig(Family.WEIGHT_MAJOR, **tile, scale_acc=False)

    def block_rows(self, config: KernelConfig) -> int | None:
        return None if config.direct else config.block_m

    def run(self, work: Work, config: KernelConfig) -> None:
        x, weights = work.x, work.weights
        inter = torch.empty(work.topk_ids.numel(), weights.intermediate_size, dtype=x.dtype, device=x.device)
        launch(x, weights, work.topk_ids, work.topk_weights, work.rows, inter, work.target, config,
               exact_bf16_scales=not BF16_SCALES_IN_WEIGHTS)  # fmt: skip


FAMILY = WeightMajor()
