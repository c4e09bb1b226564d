"""Decode kernels: the fused MoE for a few (token, expert) pairs on CUDA cores, no tensor cores (the ``decode``
family, :data:`FAMILY`: any stack, one program per pair, the top-k summed in its w2).

Dimension letters: runtime/kernels/__init__.py.

At decode every pair is its own GEMV and the whole job is streaming int4 weights at HBM speed, so the
cost that matters is instructions per weight (the profile that showed it: benchmarks/KERNEL_NOTES.md item 11),
and any shared-memory round trip or barrier in the loop is pure loss. These kernels keep each int32 word of the
layout (8 K values, SPEC.md section 3) in the registers it was loaded into and never reshape it:

- field ``s < 5`` of word ``w`` is masked in place and OR-ed into the mantissa of ``2^23`` (fp32 bits
  ``0x4B000000``): the bitcast is exactly ``2^23 + q * 16^s``. Mask and exponent come in as kernel
  arguments, so the AND+OR is one LOP3 (two immediates would cost two). Fields 5..7 take one shared shift
  by 12 first, landing at positions 2..4;
- subtracting ``2^23 + zero * 16^p`` (a per-row constant) leaves ``(q - zero) * 16^p`` exactly (one FADD);
- the activation comes pre-multiplied by ``16^-p`` and the products chain as FFMAs into a per-word
  accumulator that is summed once per program.

Three instructions per weight. The activations are *prepared* once per call by the first of three
launches (``_prepare_kernel``): fp32, pre-scaled, in field-major order (``[K block, field, word]``), so a
program loads each field's activations as one contiguous vector with no index math, and w13 writes w2's
input in the same form. That launch also zeroes the call's scratch, so split-K (slices of K per program,
meeting in fp32 sums) and the top-k sum (fp32 atomics, the last program of a token writes the output)
need no memset and no trailing sum or cast: prepare -> w13 -> w2 is the whole decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.runtime.kernel_config import DECODE_FAMILIES, Family, KernelConfig
from repack.runtime.kernels import gluon_sm90, split_k
from repack.runtime.kernels.common import (
    TL_DTYPES,
    await_previous_kernel,
    clamp_expert,
    dependent_launches,
    expert_of,
    projection_args,
    quant_params,
    routing_weight,
    word_mask,
    word_rows,
)
from repack.runtime.kernels.family import Call, KernelFamily, TopkSum, Work
from repack.runtime.kernels.routing import pow2_at_least, route_tokens, routed
from repack.runtime.weights import MoeWeights

FP32_TWO_POW_23 = 0x4B000000  # fp32 bits of 2^23: OR-ed with a field below bit 23, the float is 2^23 + field


@triton.jit
def _field_pos(s: tl.constexpr, BITS: tl.constexpr):
    """(position after the optional shift, shift) of field ``s``: fields that fit below bit 23 stay put."""
    VALS: tl.constexpr = 32 // BITS
    SPLIT: tl.constexpr = 5 if BITS == 4 else 2
    HIGH: tl.constexpr = s >= SPLIT
    POS: tl.constexpr = s - (VALS - SPLIT) if HIGH else s
    SHIFT: tl.constexpr = BITS * (VALS - SPLIT) if HIGH else 0
    return POS, SHIFT


@triton.jit
def _field_input(k0, offs_w, s: tl.constexpr, BITS: tl.constexpr, MMA_ORDER: tl.constexpr):
    """The input index field ``s`` of word ``offs_w`` (counted from ``k0``) holds, in the stack's word order
    (SPEC.md section 3): gptq ``k0 + pack*j + s``; mma128 per 16-word block ``16(4(j//8) + s%4) + 2(j%8) + s//4``."""
    if MMA_ORDER:
        j = offs_w % 16
        k = k0 + offs_w // 16 * 128 + (j // 8 * 4 + s % 4) * 16 + j % 8 * 2 + s // 4
    else:
        k = k0 + offs_w * (32 // BITS) + s
    return k


@triton.jit
def _term(acc, words, zf, xs, field_mask, magic, s: tl.constexpr, BITS: tl.constexpr):
    """acc + (q - zero) * 16^p * x' for field ``s`` of every word: one LOP3 (+ a shift shared by fields 5..7),
    one FADD, one FFMA.

    ``field_mask`` and ``magic`` arrive as kernel arguments, so they sit in registers: ``(w & m) | c`` with two
    immediates would cost ptxas two LOP3s (one immediate slot each), with registers it is one."""
    POS, SHIFT = _field_pos(s, BITS)
    field = ((words >> SHIFT) & (field_mask << (BITS * POS))) | magic
    offset = 8388608.0 + zf * (1 << (BITS * POS))
    return acc + (field.to(tl.float32, bitcast=True) - offset[:, None]) * xs[None, :]


@triton.jit
def _block_dot(acc, scale, words, zero, x0, x1, x2, x3, x4, x5, x6, x7, field_mask, magic, BITS: tl.constexpr):
    """acc + scale[n] * sum_s x_s[w] * (q[n, w, s] - zero[n]) for one K block, kept per word: [BN, WORDS] fp32.

    The words stay apart until the end of the K loop (one ``tl.sum`` per program, not one per block), and the
    field terms chain as FFMAs: about 3 instructions per weight plus one FFMA per word for the scale."""
    zf = zero.to(tl.float32)
    dot = _term(tl.zeros(words.shape, tl.float32), words, zf, x0, field_mask, magic, 0, BITS)
    dot = _term(dot, words, zf, x1, field_mask, magic, 1, BITS)
    dot = _term(dot, words, zf, x2, field_mask, magic, 2, BITS)
    dot = _term(dot, words, zf, x3, field_mask, magic, 3, BITS)
    if BITS == 4:
        dot = _term(dot, words, zf, x4, field_mask, magic, 4, BITS)
        dot = _term(dot, words, zf, x5, field_mask, magic, 5, BITS)
        dot = _term(dot, words, zf, x6, field_mask, magic, 6, BITS)
        dot = _term(dot, words, zf, x7, field_mask, magic, 7, BITS)
    return acc + scale.to(tl.float32)[:, None] * dot


@triton.jit
def _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, k0, k_last, k_words, stride_step, group_len, stride_s_g, N,
               n_mask, offs_w, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SYM_ZERO: tl.constexpr,
               EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Gate and up words, scales and zeros of the K block at ``k0``.

    A block past the program's K range (a prefetch the loop never uses) reads its last block ``k_last`` again
    instead: always in bounds, and no scalar term in the mask to break the 16-byte loads."""
    VALS: tl.constexpr = 32 // BITS
    k0 = tl.minimum(k0, k_last)
    mask = word_mask(n_mask, offs_w, k0 // VALS, k_words, EVEN_K)
    step = k0 // BLOCK_K * stride_step
    gate = tl.load(gate_ptrs + step, mask=mask, other=0)
    up = tl.load(up_ptrs + step, mask=mask, other=0)
    group = k0 // group_len
    scale_g, zero_g = quant_params(scale_ptrs, zero_ptrs, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO, BLOCK_N)
    scale_u, zero_u = quant_params(scale_ptrs + N, zero_ptrs + N, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO,
                                    BLOCK_N)  # fmt: skip
    return gate, up, scale_g, zero_g, scale_u, zero_u


@triton.jit
def _w2_block(w_ptrs, scale_ptrs, zero_ptrs, k0, k_last, k_words, stride_step, group_len, stride_s_g, n_mask, offs_w,
              BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SYM_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Words, scales and zeros of the K block at ``k0`` (past the range: block ``k_last``, as in _w13_block)."""
    VALS: tl.constexpr = 32 // BITS
    k0 = tl.minimum(k0, k_last)
    mask = word_mask(n_mask, offs_w, k0 // VALS, k_words, EVEN_K)
    words = tl.load(w_ptrs + k0 // BLOCK_K * stride_step, mask=mask, other=0)
    group = k0 // group_len
    scale, zero = quant_params(scale_ptrs, zero_ptrs, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO, BLOCK_N)
    return words, scale, zero


@triton.jit
def _xp_block(xp_ptr, row_base, k0, offs_w, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The prepared activations of the K block at ``k0`` (laid out by ``_prepare_kernel``): one [WORDS] fp32 vector
    per field, each a contiguous run (vector loads, no index math, no mask); fields a word lacks are 0."""
    VALS: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // VALS
    ptrs = xp_ptr + row_base + k0 + offs_w
    x0 = tl.load(ptrs)
    x1 = tl.load(ptrs + WORDS)
    x2 = tl.load(ptrs + 2 * WORDS)
    x3 = tl.load(ptrs + 3 * WORDS)
    if VALS == 8:
        x4 = tl.load(ptrs + 4 * WORDS)
        x5 = tl.load(ptrs + 5 * WORDS)
        x6 = tl.load(ptrs + 6 * WORDS)
        x7 = tl.load(ptrs + 7 * WORDS)
    else:
        x4 = tl.zeros(offs_w.shape, dtype=tl.float32)
        x5, x6, x7 = x4, x4, x4
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _field_major_slot(n, BITS: tl.constexpr, MMA_ORDER: tl.constexpr, BLOCK_K: tl.constexpr):
    """(offset in a prepared row, 16^-pos) of input ``n``: the inverse of ``_field_input`` within its block."""
    VALS: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // VALS
    SPLIT: tl.constexpr = 5 if BITS == 4 else 2
    r = n % BLOCK_K
    if MMA_ORDER:  # r = 64(j // 8) + 16(s % 4) + 2(j % 8) + s // 4 within a 128-input block
        s = r // 16 % 4 + r % 2 * 4
        w = r // 64 * 8 + r // 2 % 8
    else:
        s = r % VALS
        w = r // VALS
    pos = tl.where(s >= SPLIT, s - (VALS - SPLIT), s)
    inverse = ((127 - BITS * pos) << 23).to(tl.float32, bitcast=True)  # exactly 2^(-BITS * pos)
    return n - r + s * WORDS + w, inverse


@triton.jit
def _route_pair(logits_ptr, topk_weights_ptr, topk_ids_ptr, pair, token, num_experts, stride_logits,
                TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """The expert of ``pair`` (clamped into the stack), routed from its token's logits; the program of the first K
    block stores the pair's id and weight."""
    ids, weights = routed(logits_ptr, token, token + 1, num_experts, stride_logits, TOP_K, RENORMALIZE, 1, BLOCK_E)
    chosen = tl.arange(0, pow2_at_least(TOP_K))[None, :] == pair % TOP_K
    expert = tl.sum(tl.where(chosen, ids, 0))
    if tl.program_id(1) == 0:
        tl.store(topk_ids_ptr + pair, expert)
        tl.store(topk_weights_ptr + pair, tl.sum(tl.where(chosen, weights, 0.0)))
    return clamp_expert(expert, num_experts)


@triton.jit
def _prepare_kernel(
    # pointers
    x_ptr, perm_ptr, topk_ids_ptr, xp_ptr, scratch_ptr, logits_ptr, topk_weights_ptr,
    # sizes and the activations' row stride
    num_experts, K, k_pad, stride_x, scratch_len, zero_span, stride_logits,
    # the stack and the tile
    TOP_K: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr, MMA_ORDER: tl.constexpr,
    BLOCK_K: tl.constexpr, ZERO_BLOCK: tl.constexpr,
    # what the prepared rows hold (:data:`PREPARED`)
    PREPARED: tl.constexpr,
    # routing in this launch
    ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    DEPENDENT: tl.constexpr,
):  # fmt: skip
    """One K block of one prepared row (a token, or a pair under act-order, whose expert's permutation gathers
    it), then this program's share of the zeroed scratch: both jobs of the decode's first launch. The row is the
    CUDA-core kernels' pre-scaled fp32 in field-major order (PREPARED "field_major"), the tensor-core decode's
    gathered act-order row in the activation dtype ("rows"), or nothing ("none": those kernels read x itself,
    and this launch only routes and zeroes). With ROUTE the
    first K block's program of each token also routes it (kernels/routing.py), so w13 finds its ids: routing
    costs decode no launch of its own. An act-order row needs its pair's expert before its first load, so there
    every program routes its token (a few hundred instructions on one row of logits, where a routing launch of
    its own measured 4.5 us: benchmarks/RESULTS.md 2026-12-07 07:30 UTC) and the first K block's stores it."""
    await_previous_kernel(DEPENDENT)
    row = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    if ROUTE and not HAS_PERM:  # noqa: SIM102 (a constexpr: without it the routing is not compiled at all)
        if tl.program_id(1) == 0:
            route_tokens(logits_ptr, topk_weights_ptr, topk_ids_ptr, row, row + 1, num_experts, stride_logits,
                         TOP_K, RENORMALIZE, 1, BLOCK_E)  # fmt: skip
    VALS: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // VALS
    offs_w = tl.arange(0, WORDS)
    if HAS_PERM:
        token = (row // TOP_K).to(tl.int64)
        if ROUTE:
            expert = _route_pair(logits_ptr, topk_weights_ptr, topk_ids_ptr, row, token, num_experts, stride_logits,
                                 TOP_K, RENORMALIZE, BLOCK_E)  # fmt: skip
        else:
            expert = expert_of(topk_ids_ptr, row, num_experts)
        perm_base = expert * K
    else:
        perm_base = 0
        token = row.to(tl.int64)
    if PREPARED == "field_major":
        out = xp_ptr + row.to(tl.int64) * k_pad + k0 + offs_w
        for s in tl.static_range(VALS):
            pos, _shift = _field_pos(s, BITS)
            k = _field_input(k0, offs_w, s, BITS, MMA_ORDER)
            k_ok = k < K
            if HAS_PERM:
                cols = tl.load(perm_ptr + perm_base + k, mask=k_ok, other=0)
            else:
                cols = k
            x = tl.load(x_ptr + token * stride_x + cols, mask=k_ok, other=0.0).to(tl.float32)
            tl.store(out + s * WORDS, x * (1.0 / (1 << (BITS * pos))))
    elif PREPARED == "rows":
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        cols = tl.load(perm_ptr + perm_base + k, mask=k_ok, other=0) if HAS_PERM else k
        x = tl.load(x_ptr + token * stride_x + cols, mask=k_ok, other=0.0)
        tl.store(xp_ptr + row.to(tl.int64) * k_pad + k, x, mask=k_ok)
    program = row * tl.num_programs(1) + tl.program_id(1)
    offs = tl.arange(0, ZERO_BLOCK)
    end = tl.minimum(scratch_len, (program + 1) * zero_span)
    for start in range(program * zero_span, end, ZERO_BLOCK):
        tl.store(scratch_ptr + start + offs, tl.zeros((ZERO_BLOCK,), tl.int32), mask=start + offs < end)


@triton.jit
def _w13_decode_kernel(
    # pointers
    xp_ptr, qw_ptr, scales_ptr, zeros_ptr, inter_ptr, topk_ids_ptr, sums_ptr, arrivals_ptr,
    # sizes (and the field mask and exponent bits, in registers: see _term)
    num_experts, N, K, k_pad, i_pad, group_len, blocks_per_split, field_mask, magic,
    # strides
    stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g,
    # the stack and the activations
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr, ACT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, MMA_ORDER: tl.constexpr,
    # kernel switches and tile
    SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr,
):  # fmt: skip
    """inter[pair, n] = silu(gate_n . x) * (up_n . x) for one (token, expert) pair and BLOCK_N channels,
    written as w2's prepared input (field-major, pre-scaled fp32 of the value rounded to the activation dtype).

    Weights, scales and zeros are loaded PREFETCH (1 or 2) K blocks ahead and the activations one block ahead,
    so the arithmetic of a block never waits on the memory it needs. With SPLIT_K, program_id(2) takes one
    slice of K; the slices meet in fp32 sums and the last to arrive applies SiLU: more programs, and more bytes
    in flight, when the pairs alone do not fill the GPU."""
    await_previous_kernel(DEPENDENT)  # the prepare launch routes the pairs: nothing to load before
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = expert_of(topk_ids_ptr, pair, num_experts)
    if HAS_PERM:  # one prepared row per pair (its expert's permutation), else per token
        xp_row = pair.to(tl.int64) * k_pad
    else:
        xp_row = (pair // TOP_K).to(tl.int64) * k_pad
    VALS: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // VALS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)
    expert_words = qw_ptr + expert * stride_qw_e + offs_w[None, :]
    gate_ptrs = expert_words + word_rows(offs_n, stride_qw_band, stride_qw_row)[:, None]
    up_ptrs = expert_words + word_rows(offs_n + N, stride_qw_band, stride_qw_row)[:, None]
    scale_ptrs = scales_ptr + expert * stride_s_e + offs_n
    zero_ptrs = zeros_ptr + expert * stride_s_e + offs_n
    k_words = K // VALS
    k_begin, k_end, k_last = split_k.k_range(K, blocks_per_split, BLOCK_K)
    acc_gate = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    # The first block (and the second when PREFETCH == 2) before the loop; the loop loads k0 + PREFETCH*BLOCK_K.
    gate_0, up_0, sg_0, zg_0, su_0, zu_0 = _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, k_begin, k_last,
                                                      k_words, stride_qw_step, group_len, stride_s_g, N, n_mask,
                                                      offs_w, BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N,
                                                      BLOCK_K)  # fmt: skip
    gate_1, up_1, sg_1, zg_1, su_1, zu_1 = _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, k_begin + BLOCK_K,
                                                      k_last, k_words, stride_qw_step, group_len, stride_s_g, N,
                                                      n_mask, offs_w, BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N,
                                                      BLOCK_K)  # fmt: skip
    x0, x1, x2, x3, x4, x5, x6, x7 = _xp_block(xp_ptr, xp_row, k_begin, offs_w, BITS, BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ahead = k0 + PREFETCH * BLOCK_K
        k_next = tl.minimum(k0 + BLOCK_K, k_last)
        gate_n, up_n, sg_n, zg_n, su_n, zu_n = _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, ahead, k_last,
                                                          k_words, stride_qw_step, group_len, stride_s_g, N, n_mask,
                                                          offs_w, BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N,
                                                          BLOCK_K)  # fmt: skip
        n0, n1, n2, n3, n4, n5, n6, n7 = _xp_block(xp_ptr, xp_row, k_next, offs_w, BITS, BLOCK_K)
        acc_gate = _block_dot(acc_gate, sg_0, gate_0, zg_0, x0, x1, x2, x3, x4, x5, x6, x7, field_mask, magic, BITS)
        acc_up = _block_dot(acc_up, su_0, up_0, zu_0, x0, x1, x2, x3, x4, x5, x6, x7, field_mask, magic, BITS)
        if PREFETCH == 2:
            gate_0, up_0, sg_0, zg_0, su_0, zu_0 = gate_1, up_1, sg_1, zg_1, su_1, zu_1
            gate_1, up_1, sg_1, zg_1, su_1, zu_1 = gate_n, up_n, sg_n, zg_n, su_n, zu_n
        else:
            gate_0, up_0, sg_0, zg_0, su_0, zu_0 = gate_n, up_n, sg_n, zg_n, su_n, zu_n
        x0, x1, x2, x3, x4, x5, x6, x7 = n0, n1, n2, n3, n4, n5, n6, n7
    gate = tl.sum(acc_gate, axis=1)
    up = tl.sum(acc_up, axis=1)
    done = True
    if SPLIT_K:
        gate_row, up_row = split_k.gate_up_rows(sums_ptr, pair, offs_n, BLOCK_N)
        tl.atomic_add(gate_row, gate, mask=n_mask, sem="relaxed")
        counter = arrivals_ptr + pair * tl.num_programs(1) + pid_n
        done = split_k.add_and_arrive(up_row, up, n_mask, counter, tl.num_programs(2))
        if done:
            gate, up = split_k.totals(gate_row, up_row, n_mask)
    if done:
        act = (gate / (1.0 + tl.exp(-gate)) * up).to(ACT_DTYPE).to(tl.float32)
        slot, inverse = _field_major_slot(offs_n, BITS, MMA_ORDER, BLOCK_K)
        tl.store(inter_ptr + pair.to(tl.int64) * i_pad + slot, act * inverse, mask=n_mask)


@triton.jit
def _w2_decode_kernel(
    # pointers
    inter_ptr, qw_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr, topk_ids_ptr, sums_ptr, arrivals_ptr,
    # sizes (and the field mask and exponent bits, in registers: see _term)
    num_experts, N, K, i_pad, group_len, blocks_per_split, field_mask, magic,
    # strides
    stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g, stride_out,
    # the stack and the activations
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    ACT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, MMA_ORDER: tl.constexpr,
    # kernel switches and tile
    REDUCE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEPENDENT: tl.constexpr,
):  # fmt: skip
    """out[token, n] = sum over the token's pairs of w[pair] * (W2[e] @ inter[pair])[n], BLOCK_N channels of one
    pair (and one K slice) per program.

    With REDUCE (top-k > 1 or split-K) every program adds its share into the token's fp32 row and the last of
    the token's TOP_K * slices programs writes the row out in the activation dtype: no torch sum, no cast.

    A dependent launch loads its first weight blocks while w13 still runs (the ids and routing weights were written
    two launches back, by the prepare launch, and are read from L2) and waits for w13 before its intermediate."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = expert_of(topk_ids_ptr, pair, num_experts, DEPENDENT)
    route_weight = routing_weight(topk_weights_ptr, pair, DEPENDENT)
    VALS: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // VALS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)
    w_ptrs = qw_ptr + expert * stride_qw_e + word_rows(offs_n, stride_qw_band, stride_qw_row)[:, None] + offs_w[None, :]
    scale_ptrs = scales_ptr + expert * stride_s_e + offs_n
    zero_ptrs = zeros_ptr + expert * stride_s_e + offs_n
    xp_row = pair.to(tl.int64) * i_pad
    k_words = K // VALS
    k_begin, k_end, k_last = split_k.k_range(K, blocks_per_split, BLOCK_K)
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    w_0, s_0, z_0 = _w2_block(w_ptrs, scale_ptrs, zero_ptrs, k_begin, k_last, k_words, stride_qw_step, group_len,
                              stride_s_g, n_mask, offs_w, BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N,
                              BLOCK_K)  # fmt: skip
    w_1, s_1, z_1 = _w2_block(w_ptrs, scale_ptrs, zero_ptrs, k_begin + BLOCK_K, k_last, k_words, stride_qw_step,
                              group_len, stride_s_g, n_mask, offs_w, BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N,
                              BLOCK_K)  # fmt: skip
    await_previous_kernel(DEPENDENT)  # w13's intermediate from here on
    x0, x1, x2, x3, x4, x5, x6, x7 = _xp_block(inter_ptr, xp_row, k_begin, offs_w, BITS, BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_next = tl.minimum(k0 + BLOCK_K, k_last)
        w_n, s_n, z_n = _w2_block(w_ptrs, scale_ptrs, zero_ptrs, k0 + PREFETCH * BLOCK_K, k_last, k_words,
                                  stride_qw_step, group_len, stride_s_g, n_mask, offs_w, BITS, HAS_ZEROS, SYM_ZERO,
                                  EVEN_K, BLOCK_N, BLOCK_K)  # fmt: skip
        n0, n1, n2, n3, n4, n5, n6, n7 = _xp_block(inter_ptr, xp_row, k_next, offs_w, BITS, BLOCK_K)
        acc = _block_dot(acc, s_0, w_0, z_0, x0, x1, x2, x3, x4, x5, x6, x7, field_mask, magic, BITS)
        if PREFETCH == 2:
            w_0, s_0, z_0 = w_1, s_1, z_1
            w_1, s_1, z_1 = w_n, s_n, z_n
        else:
            w_0, s_0, z_0 = w_n, s_n, z_n
        x0, x1, x2, x3, x4, x5, x6, x7 = n0, n1, n2, n3, n4, n5, n6, n7
    result = tl.sum(acc, axis=1) * route_weight
    token = (pair // TOP_K).to(tl.int64)
    done = True
    if REDUCE:
        row = sums_ptr + token * N + offs_n
        counter = arrivals_ptr + token * tl.num_programs(1) + pid_n
        done = split_k.add_and_arrive(row, result, n_mask, counter, TOP_K * tl.num_programs(2))
        if done:
            result = split_k.total(row, n_mask)
    if done:
        tl.store(out_ptr + token * stride_out + offs_n, result.to(ACT_DTYPE), mask=n_mask)


# What the decode's prepare launch writes per row (``_prepare_kernel``'s PREPARED): the CUDA-core kernels' pre-scaled
# fp32 in field-major order, the tensor-core decode's act-order rows gathered in the activation dtype, or nothing.
PREPARED = ("field_major", "rows", "none")


def prepare(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights,
    topk_ids: torch.Tensor,  # [M, T] int32/int64
    topk_weights: torch.Tensor,  # [M, T] fp32
    scratch: split_k.DecodeScratch,
    prepared: str,  # one of PREPARED
    block_k: int,  # inputs per K block of the kernels that read the rows (field-major rows are laid out per block)
    routing: tuple[torch.Tensor, bool] | None,  # (router logits [M, E] unit stride along E, renormalize)
) -> torch.Tensor | None:
    """The decode's first launch: the prepared rows (``prepared``; one a token, or one a pair under act-order,
    gathered through its expert's permutation), the scratch zeroed and, with ``routing``, every token routed into
    ``topk_ids`` and ``topk_weights``. Returns the prepared rows [rows, K padded to block_k] (None for "none")."""
    if prepared not in PREPARED:
        raise ValueError(f"decode.prepare: prepared must be one of {PREPARED}, not {prepared!r}")
    m, h = x.shape
    has_perm = weights.w13_perm is not None and prepared != "none"
    k_pad = triton.cdiv(h, block_k) * block_k
    rows = topk_ids.numel() if has_perm else m  # one per pair under act-order (its expert's permutation)
    xp = None
    if prepared != "none":  # field-major: [rows, K blocks * field * word] fp32; rows: [rows, K] as x
        xp = torch.empty(rows, k_pad, dtype=torch.float32 if prepared == "field_major" else x.dtype, device=x.device)
    blocks = k_pad // block_k
    zero_span = triton.cdiv(triton.cdiv(scratch.zeroed_len, rows * blocks), 256) * 256
    logits, renormalize = routing if routing is not None else (x, False)  # logits unread without ROUTE
    _prepare_kernel[(rows, blocks)](
        x_ptr=x,
        perm_ptr=weights.w13_perm if has_perm else topk_ids,
        topk_ids_ptr=topk_ids,
        xp_ptr=xp if xp is not None else x,
        scratch_ptr=scratch.buffer,
        logits_ptr=logits,
        topk_weights_ptr=topk_weights,
        num_experts=weights.num_experts,
        K=h,
        k_pad=k_pad,
        scratch_len=scratch.zeroed_len,
        zero_span=zero_span,
        stride_x=x.stride(0),
        stride_logits=logits.stride(0),
        TOP_K=topk_ids.shape[1],
        BITS=weights.bits,
        HAS_PERM=has_perm,
        MMA_ORDER=weights.mma_order,
        BLOCK_K=block_k,
        ZERO_BLOCK=256,
        PREPARED=prepared,
        ROUTE=routing is not None,
        RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(weights.num_experts),
        num_warps=1,
        **dependent_launches(x.device),
    )
    return xp


def launch(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights,
    topk_ids: torch.Tensor,  # [M, T] int32/int64
    topk_weights: torch.Tensor,  # [M, T] fp32
    out: torch.Tensor,  # [M, H] activation dtype: the result, written by w2
    config: KernelConfig,
    routing: tuple[torch.Tensor, bool] | None = None,  # (router logits [M, E] unit stride along E, renormalize)
) -> None:
    """The decode path: prepare (activations + zeroed scratch) -> w13 -> w2 straight into ``out``: three launches.
    With ``routing`` the prepare launch also routes every token into ``topk_ids`` and ``topk_weights``.

    From ``config``: block_n, block_k (128 on mma128 stacks: one word-order block per step), num_warps,
    num_stages, prefetch (K blocks loaded ahead, 1 or 2) and split_k (slices of K per (pair, tile): more
    programs when the pairs are few). The top-k sum is always w2's own (fp32 adds, the last program writes)."""
    m, h = x.shape
    n_inter, num_pairs, top_k = weights.intermediate_size, topk_ids.numel(), topk_ids.shape[1]
    block_n = config.block_n
    block_k = 128 if weights.mma_order else config.block_k
    has_perm = weights.w13_perm is not None
    per_slice13, slices13 = split_k.k_slices(h, block_k, config.split_k)
    per_slice2, slices2 = split_k.k_slices(n_inter, block_k, config.split_k)
    tiles13, tiles2 = triton.cdiv(n_inter, block_n), triton.cdiv(h, block_n)
    reduce2 = top_k * slices2 > 1
    scratch = split_k.DecodeScratch(m, num_pairs, h, n_inter, block_k, tiles13, tiles2, block_n, slices13 > 1, reduce2,
                                    x.device)  # fmt: skip
    xp = prepare(x, weights, topk_ids, topk_weights, scratch, "field_major", block_k, routing)
    k_pad = xp.shape[1]
    order = dict(MMA_ORDER=weights.mma_order, BLOCK_K=block_k)
    launched = dependent_launches(x.device)
    shared = dict(
        topk_ids_ptr=topk_ids,
        num_experts=weights.num_experts,
        field_mask=(1 << weights.bits) - 1,  # the field mask and exponent bits, passed in registers: see _term
        magic=FP32_TWO_POW_23,
        i_pad=scratch.i_pad,
        TOP_K=top_k,
        BITS=weights.bits,
        SYM_ZERO=1 << (weights.bits - 1),
        HAS_ZEROS=weights.w13_zeros is not None,
        ACT_DTYPE=TL_DTYPES[x.dtype],
        PREFETCH=config.prefetch,
        BLOCK_N=block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **order,
        **launched,
    )
    views = scratch.views
    args13 = projection_args(
        weights.w13_qweight, weights.w13_scales, weights.w13_zeros, weights.tiled, block_k, weights.bits
    )
    args13.update(xp_ptr=xp, inter_ptr=views["inter"], sums_ptr=views["gate_up_sums"], N=n_inter, K=h, k_pad=k_pad)
    args13.update(arrivals_ptr=views["gate_up_arrivals"], group_len=weights.group_len(h), blocks_per_split=per_slice13)
    args13.update(HAS_PERM=has_perm, EVEN_K=h % block_k == 0, SPLIT_K=slices13 > 1)
    _w13_decode_kernel[(num_pairs, tiles13, slices13)](**args13, **shared)
    args2 = projection_args(
        weights.w2_qweight, weights.w2_scales, weights.w2_zeros, weights.tiled, block_k, weights.bits
    )
    args2.update(inter_ptr=views["inter"], topk_weights_ptr=topk_weights, out_ptr=out, stride_out=out.stride(0))
    args2.update(sums_ptr=views["out_sums"], arrivals_ptr=views["out_arrivals"], N=h, K=n_inter)
    args2.update(group_len=weights.group_len(n_inter), blocks_per_split=per_slice2)
    args2.update(EVEN_K=n_inter % block_k == 0, REDUCE=reduce2)
    _w2_decode_kernel[(num_pairs, tiles2, slices2)](**args2, **shared)


def direct_mode(num_pairs: int, num_experts: int) -> bool:
    """Decode: one CUDA-core program per (token, k) pair beats sorting while pairs rarely share experts
    (where the H200 crossover sits: benchmarks/RESULTS.md). Each pair reads its expert's weights: with more pairs
    than experts (Mixtral's eight at 16 tokens: four reads of every expert) the sorted path reads each once."""
    return num_pairs <= max(32, num_experts // 2) and num_pairs <= max(8, num_experts)


# The heuristic's K slices at up to 8 pairs, K blocks loaded ahead and channel tile, as measured at M = 1 on the
# H100 (benchmarks/KERNEL_NOTES.md item 34: a program's time is a chain of dependent loads, so two K blocks a slice
# beat four; 16 slices, two blocks ahead and 16 channels were slower). The anchor's variants patch them
# (`project:decode.FEW_PAIRS_SPLIT=6`).
FEW_PAIRS_SPLIT = 8
PREFETCH = 1
BLOCK_N = 32

GLUON_DECODE_HIDDEN = 6144  # from this hidden size up the Gluon kernels beat these at every M (DeepSeek-V3's 7168)
GLUON_DECODE_PAIRS = 24  # from this many pairs up the persistent Gluon kernels beat these (M = 4 of top-6 and top-8)
GLUON_DECODE_WEIGHTS = 10**8  # from this many weights streamed per call up (pairs x hidden x intermediate) the same


def heuristic_split(num_pairs: int, few_pairs_split: int) -> int:
    """K slices for ``num_pairs`` pairs: ``few_pairs_split`` up to 8 pairs, 2 up to 16, then whole K (KERNEL_NOTES.md
    items 10 and 34)."""
    return few_pairs_split if num_pairs <= 8 else 2 if num_pairs <= 16 else 1


def gluon_streams_better(call: Call) -> bool:
    """Where the Gluon sm_90 kernels run the call, whether they beat these kernels even with few pairs, as measured
    on the H200 (benchmarks/KERNEL_NOTES.md items 20 and 26, same process): a hidden size of GLUON_DECODE_HIDDEN or
    more (DeepSeek-V3, M = 1..16: 9-18% faster); few experts shared by many pairs (Mixtral M = 4: eight pairs on
    about 5.5 distinct experts, each read once there and once per pair here: 218 against 250 us); and, since the
    warp-specialized persistent kernels, GLUON_DECODE_PAIRS pairs or more (M = 4: Qwen3-30B 39.6 against 47.9 us,
    DeepSeek-V2-Lite 46.8 against 56.3, Qwen3-235B 122.3 against 140.3; at M = 1 these kernels stayed ahead by
    1-12%: too few weight tiles to fill the GPU there, while these split K); and GLUON_DECODE_WEIGHTS weights or
    more streamed by the call, where even a few pairs give the Gluon kernels enough tiles (Mixtral M = 1: two
    experts of 4096 x 14336, 78.8 against 95.7 us; Qwen3-235B's 8 x 4096 x 1536 stayed here, 42.6 against 45.5)."""
    if not gluon_sm90.FAMILY.supports(call):
        return False
    weights = call.weights
    experts = weights.num_experts
    return (
        weights.hidden_size >= GLUON_DECODE_HIDDEN
        or call.num_pairs >= GLUON_DECODE_PAIRS
        or call.num_pairs * weights.hidden_size * weights.intermediate_size >= GLUON_DECODE_WEIGHTS
        or (experts < 32 and call.num_pairs > experts // 2)
    )


class Decode(KernelFamily):
    """Any stack (bits, word order, groups, act-order), one program per pair and BLOCK_N channels."""

    family = Family.DECODE
    topk_sum = TopkSum.IN_W2

    def supports(self, call: Call) -> bool:
        return True

    def asked_by(self, config: KernelConfig) -> bool:
        """Its own configs and the tensor-core decode's (kernels/decode_mma.py), which it runs where those cannot."""
        return config.family in DECODE_FAMILIES

    def heuristic(self, call: Call) -> KernelConfig | None:
        """While :func:`direct_mode` and the Gluon kernels do not stream the call faster (:func:`gluon_streams_better`):
        few pairs leave most of the GPU idle, so slices of K give it programs (KERNEL_NOTES.md item 10)."""
        if not direct_mode(call.num_pairs, call.weights.num_experts) or gluon_streams_better(call):
            return None
        split = heuristic_split(call.num_pairs, FEW_PAIRS_SPLIT)
        return KernelConfig(
            Family.DECODE, 16, BLOCK_N, 128, 1, num_warps=1, num_stages=1, direct=True, split_k=split, prefetch=PREFETCH
        )

    def block_rows(self, config: KernelConfig) -> None:
        return None

    def routes_in_first_launch(self, weights: MoeWeights) -> bool:
        """The prepare launch routes each token (under act-order each of its programs routes its pair's token)."""
        return True

    def run(self, work: Work, config: KernelConfig) -> None:
        launch(work.x, work.weights, work.topk_ids, work.topk_weights, work.out, config, work.routing)


FAMILY = Decode()
