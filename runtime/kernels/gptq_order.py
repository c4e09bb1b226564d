"""The gptq-order tensor-core kernels: tokens as the MMA's A operand, the dequantized weights as its B.

They serve the stacks the weight-major kernels cannot read (groups under 128, K not a multiple of 128, 8-bit:
runtime/kernels/weight_major.py ``supports``), always on aligned row blocks (runtime/kernels/align.py), so each
weight tile is dequantized once per block of up to BLOCK_M tokens. Why they are slower where both can run:
benchmarks/KERNEL_NOTES.md items 4 and 7.

- w13: one program per (row block, N tile) loads the gate rows ``n0..`` and the up rows ``I+n0..`` of its
  expert (SPEC.md section 3 puts matching channels there), runs two dots into fp32 and stores
  ``silu(gate) * up`` in the activation dtype, one row per (token, k) pair.
- w2: the same GEMM on that intermediate; the routing weight is applied in fp32, the top-k sum is the
  dispatcher's (per-pair rows) or fp32 atomics into [M, H] (``ATOMIC``).
- Dequantization (EXPONENT_TRICK): the int32 words are viewed as int16 (4 nibbles of consecutive K each), a
  shift and a mask give the nibble, an OR with 0x6400 and a bitcast give the fp16 ``1024 + q`` with no
  int-to-float conversion, then ``(v - (1024 + zero)) * scale`` (the subtraction is exact, the product rounds
  once: GPTQModel's own ``fp16(scale * (q - zero))``). bf16 uses ``0x4300`` (128 + q) and an fp32 product.
The ``gptq_order`` family (:data:`FAMILY`): gptq-order stacks only, always aligned, the top-k sum as the config's
``reduce`` says; it runs another family's tl tile where that family cannot read the stack. (A per-nibble-dot variant,
``NIBBLE_DOTS``, was retired: no shipped table or default chose it; KERNEL_NOTES.md item 4 has its numbers.)

Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from repack.runtime.kernel_config import Family, KernelConfig
from repack.runtime.kernels.align import Alignment
from repack.runtime.kernels.common import (
    TL_DTYPES,
    block_rows,
    launch_tiles,
    quant_args,
    quant_params,
    tile_ids,
    word_mask,
)
from repack.runtime.kernels.family import Call, KernelFamily, TopkSum, Work
from repack.runtime.kernels.weight_major import heuristic_tile
from repack.runtime.weights import MoeWeights


@triton.jit
def _dequant(
    words,
    scale,
    zero,  # int16 [BLOCK_N, BLOCK_K*BITS/16], fp16 [BLOCK_N], int32 [BLOCK_N] (the true zero point)
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    EXPONENT_TRICK: tl.constexpr,
):
    """int16 words -> weights [BLOCK_N, BLOCK_K] in ACT_DTYPE; EXPONENT_TRICK: the exponent-OR conversion."""
    VALS: tl.constexpr = 16 // BITS
    shifts = (tl.arange(0, VALS) * BITS).to(tl.int16)
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCK_N, BLOCK_K))  # [BLOCK_N, BLOCK_K/VALS, VALS] -> [BLOCK_N, BLOCK_K]
    if EXPONENT_TRICK and tl.float16 == ACT_DTYPE:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q, exact
        zf = (zero + 1024).to(tl.float16)
        w = (v - zf[:, None]) * scale[:, None]
    elif EXPONENT_TRICK and tl.bfloat16 == ACT_DTYPE:
        v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q, exact (4-bit only)
        zf = (zero + 128).to(tl.bfloat16)
        w = ((v - zf[:, None]).to(tl.float32) * scale.to(tl.float32)[:, None]).to(tl.bfloat16)
    else:
        w = ((q.to(tl.float32) - zero.to(tl.float32)[:, None]) * scale.to(tl.float32)[:, None]).to(ACT_DTYPE)
    return w


@triton.jit
def _w13_kernel(
    # pointers
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, inter_ptr,
    sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
    # sizes
    num_pairs, num_pid_m, N, K, group_len,
    # strides
    stride_x, stride_qw_e, stride_qw_n, stride_s_e, stride_s_g, stride_inter,
    # the stack and the activations
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr, ACT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
    # kernel switches
    EXPONENT_TRICK: tl.constexpr,
    # tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """inter[pair, n] = silu(gate_n . x) * (up_n . x) for the rows of one block and BLOCK_N channels.

    EVEN_K (K a multiple of BLOCK_K) drops the K masks so weight and activation loads stay 16 bytes wide.
    ``qw_ptr`` is the int16 view of the words, unpacked by a reshape.
    """
    pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pairs, row_mask, expert = block_rows(pid_m, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    tokens = (pairs // TOP_K).to(tl.int64)
    VALS: tl.constexpr = 16 // BITS
    WORDS_K: tl.constexpr = BLOCK_K // VALS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, WORDS_K)
    gate_ptrs = qw_ptr + expert * stride_qw_e + offs_n[:, None].to(tl.int64) * stride_qw_n + offs_w[None, :]
    up_ptrs = gate_ptrs + N * stride_qw_n
    x_rows = x_ptr + tokens[:, None] * stride_x
    perm_ptrs = perm_ptr + expert * K
    scale_ptrs = scales_ptr + expert * stride_s_e + offs_n
    zero_ptrs = zeros_ptr + expert * stride_s_e + offs_n
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_mask = word_mask(n_mask, offs_w, k0 // VALS, K // VALS, EVEN_K)
        gate_words = tl.load(gate_ptrs, mask=w_mask, other=0)  # [BLOCK_N, WORDS_K]
        up_words = tl.load(up_ptrs, mask=w_mask, other=0)
        group = k0 // group_len
        scale_gate, zero_gate = quant_params(
            scale_ptrs, zero_ptrs, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO, BLOCK_N
        )
        scale_up, zero_up = quant_params(
            scale_ptrs + N, zero_ptrs + N, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO, BLOCK_N
        )
        k_mask = k0 + offs_k < K
        if EVEN_K:
            a_mask = tl.broadcast_to(row_mask[:, None], (BLOCK_M, BLOCK_K))
        else:
            a_mask = row_mask[:, None] & k_mask[None, :]
        if HAS_PERM:
            cols = tl.load(perm_ptrs + k0 + offs_k, mask=k_mask, other=0)
        else:
            cols = k0 + offs_k
        a = tl.load(x_rows + cols[None, :], mask=a_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        w_gate = _dequant(gate_words, scale_gate, zero_gate, BITS, BLOCK_N, BLOCK_K, ACT_DTYPE, EXPONENT_TRICK)
        acc_gate = tl.dot(a, tl.trans(w_gate), acc_gate)
        w_up = _dequant(up_words, scale_up, zero_up, BITS, BLOCK_N, BLOCK_K, ACT_DTYPE, EXPONENT_TRICK)
        acc_up = tl.dot(a, tl.trans(w_up), acc_up)
        gate_ptrs += WORDS_K
        up_ptrs += WORDS_K
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out_ptrs = inter_ptr + pairs[:, None].to(tl.int64) * stride_inter + offs_n[None, :]
    tl.store(out_ptrs, act.to(ACT_DTYPE), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _w2_kernel(
    # pointers
    inter_ptr, qw_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr,
    sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
    # sizes
    num_pairs, num_pid_m, N, K, group_len,
    # strides
    stride_inter, stride_qw_e, stride_qw_n, stride_s_e, stride_s_g, stride_out,
    # the stack and the activations
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    ACT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
    # kernel switches
    EXPONENT_TRICK: tl.constexpr, ATOMIC: tl.constexpr,
    # tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[pair or token, n] (+)= w[pair] * (W2[e] @ inter[pair])[n]."""
    pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pairs, row_mask, expert = block_rows(pid_m, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    VALS: tl.constexpr = 16 // BITS
    WORDS_K: tl.constexpr = BLOCK_K // VALS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, WORDS_K)
    w_ptrs = qw_ptr + expert * stride_qw_e + offs_n[:, None].to(tl.int64) * stride_qw_n + offs_w[None, :]
    a_rows = inter_ptr + pairs[:, None].to(tl.int64) * stride_inter
    scale_ptrs = scales_ptr + expert * stride_s_e + offs_n
    zero_ptrs = zeros_ptr + expert * stride_s_e + offs_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        words = tl.load(w_ptrs, mask=word_mask(n_mask, offs_w, k0 // VALS, K // VALS, EVEN_K), other=0)
        scale, zero = quant_params(
            scale_ptrs, zero_ptrs, k0 // group_len, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO, BLOCK_N
        )
        if EVEN_K:
            a_mask = tl.broadcast_to(row_mask[:, None], (BLOCK_M, BLOCK_K))
        else:
            a_mask = row_mask[:, None] & ((k0 + offs_k) < K)[None, :]
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=a_mask, other=0.0)
        w = _dequant(words, scale, zero, BITS, BLOCK_N, BLOCK_K, ACT_DTYPE, EXPONENT_TRICK)
        acc = tl.dot(a, tl.trans(w), acc)
        w_ptrs += WORDS_K
    route_w = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    mask = row_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tokens = (pairs // TOP_K).to(tl.int64)
        tl.atomic_add(out_ptr + tokens[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                      mask=mask, sem="relaxed")  # fmt: skip
    else:
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :], acc.to(ACT_DTYPE), mask=mask)


def _projection_args(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> dict:
    """``qw_ptr`` (row-major words [E, N, K/VALS], any word width) with its expert and row strides, and
    :func:`quant_args`."""
    return dict(qw_ptr=words, stride_qw_e=words.stride(0), stride_qw_n=words.stride(1), **quant_args(scales, zeros))


def launch(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights,
    topk_ids: torch.Tensor,  # [M, T] int32/int64
    topk_weights: torch.Tensor,  # [M, T] fp32
    rows: Alignment,  # pairs sorted by expert into blocks of config.block_m
    inter: torch.Tensor,  # [P, I] activation dtype: w13's output, w2's input
    target: torch.Tensor,  # [P, H] activation dtype ("pairs"), else [M, H] added to: fp32 ("atomic") or out ("out")
    config: KernelConfig,
) -> None:
    """w13 then w2 over the aligned blocks: ``target`` gets each pair's weighted row (or the token's atomic sum)."""
    h, n_inter, num_pairs = weights.hidden_size, weights.intermediate_size, topk_ids.numel()
    # the words as int16, four (4-bit) or two (8-bit) consecutive inputs each: [E, 2I, H/VALS] and [E, H, I/VALS]
    args13 = _projection_args(weights.w13_qweight.view(torch.int16), weights.w13_scales, weights.w13_zeros)
    args2 = _projection_args(weights.w2_qweight.view(torch.int16), weights.w2_scales, weights.w2_zeros)
    act_dtype = TL_DTYPES[x.dtype]
    stack = dict(
        TOP_K=topk_ids.shape[1],
        BITS=weights.bits,
        SYM_ZERO=1 << (weights.bits - 1),
        HAS_ZEROS=weights.w13_zeros is not None,
        ACT_DTYPE=act_dtype,
    )
    # bf16's mantissa holds 128 + q only for 4-bit q: 8-bit bf16 converts instead
    switches = dict(EXPONENT_TRICK=not (act_dtype == tl.bfloat16 and weights.bits == 8))
    shared = dict(sorted_pairs_ptr=rows.sorted_pairs, block_experts_ptr=rows.block_experts, **stack, **switches)
    shared.update(num_blocks_ptr=rows.num_blocks, num_pairs=num_pairs, num_pid_m=rows.max_blocks)
    has_perm = weights.w13_perm is not None
    args13.update(x_ptr=x, inter_ptr=inter, N=n_inter, K=h, stride_x=x.stride(0), stride_inter=inter.stride(0))
    args13.update(
        perm_ptr=weights.w13_perm if has_perm else topk_ids, HAS_PERM=has_perm, group_len=weights.group_len(h)
    )
    args2.update(
        inter_ptr=inter, out_ptr=target, N=h, K=n_inter, stride_inter=inter.stride(0), stride_out=target.stride(0)
    )
    args2.update(topk_weights_ptr=topk_weights, ATOMIC=config.reduce != "pairs", group_len=weights.group_len(n_inter))
    meta = config.meta()
    launch_tiles(
        _w13_kernel, rows.max_blocks, n_inter, meta, x.device, **args13, **shared, EVEN_K=h % config.block_k == 0
    )
    launch_tiles(
        _w2_kernel, rows.max_blocks, h, meta, x.device, **args2, **shared, EVEN_K=n_inter % config.block_k == 0
    )


class GptqOrder(KernelFamily):
    """gptq-order stacks of any bits and group size, aligned row blocks only."""

    family = Family.GPTQ_ORDER
    topk_sum = TopkSum.BY_REDUCE
    runs_tl_tiles = True

    def supports(self, call: Call) -> bool:
        return not call.weights.mma_order

    def configure(self, config: KernelConfig, call: Call) -> KernelConfig | None:
        """Any tl tile (one block per pair, ``direct``, becomes aligned blocks of ``block_m`` rows)."""
        return replace(config, family=Family.GPTQ_ORDER, direct=False, gluon=None) if self.supports(call) else None

    def heuristic(self, call: Call) -> KernelConfig | None:
        if not self.supports(call):
            return None
        return KernelConfig(Family.GPTQ_ORDER, **heuristic_tile(call.num_pairs, call.weights.num_experts))

    def run(self, work: Work, config: KernelConfig) -> None:
        x, weights = work.x, work.weights
        inter = torch.empty(work.topk_ids.numel(), weights.intermediate_size, dtype=x.dtype, device=x.device)
        launch(x, weights, work.topk_ids, work.topk_weights, work.rows, inter, work.target, config)


FAMILY = GptqOrder()
