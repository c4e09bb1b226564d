"""Decode kernels: the fused MoE for a few (token, expert) pairs on CUDA cores, no tensor cores.

At decode every pair is its own GEMV and the whole job is streaming int4 weights at HBM speed, so the
cost that matters is instructions per weight, and any shared-memory round trip or barrier is pure loss.
These kernels keep each int32 word of the layout (8 consecutive K values, SPEC.md section 3) in the
registers it was loaded into and never reshape it:

- nibble ``s < 5`` of word ``w`` is masked in place and OR-ed into the mantissa of ``2^23`` (fp32 bits
  ``0x4B000000``): the bitcast is exactly ``2^23 + q * 16^s`` (one LOP3); nibbles 5..7 take one shared shift
  by 12 first, landing at positions 2..4;
- subtracting ``2^23 + zero * 16^p`` (a per-column constant) leaves ``(q - zero) * 16^p`` exactly (one FADD);
- the activation is pre-multiplied by ``16^-p`` once per K value, shared by every output row (one FFMA).

About 3 instructions per weight (plus the activation, loaded once per K value), all full-rate fp32/int
ALU work, instead of shift + mask + convert + shared-memory store + ldmatrix + mma. Scales apply once per
group to the row sums (BLOCK_K divides the group).
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, s: tl.constexpr, BITS: tl.constexpr,
             HAS_PERM: tl.constexpr, MMA_ORDER: tl.constexpr):  # fmt: skip
    """x[input of field s of each word] * 16^-pos as fp32 [WORDS] (0 past K or past the fields of a word)."""
    VALS: tl.constexpr = 32 // BITS
    if s >= VALS:
        return tl.zeros(offs_w.shape, dtype=tl.float32)
    POS, _shift = _field_pos(s, BITS)
    k = _field_input(k0, offs_w, s, BITS, MMA_ORDER)
    k_ok = k < K
    if HAS_PERM:
        cols = tl.load(perm_ptr + perm_base + k, mask=k_ok, other=0)
    else:
        cols = k
    x = tl.load(x_ptr + x_base + cols, mask=k_ok, other=0.0).to(tl.float32)
    return x * (1.0 / (1 << (BITS * POS)))


@triton.jit
def _x_block(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
             MMA_ORDER: tl.constexpr):  # fmt: skip
    """The activations one K block multiplies, one [WORDS] vector per field (8; unused ones are 0).

    Returned as separate tensors so the loop can carry them: they are loaded one block ahead, like the
    weights, and never stall the arithmetic."""
    return (
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 0, BITS, HAS_PERM, MMA_ORDER),
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 1, BITS, HAS_PERM, MMA_ORDER),
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 2, BITS, HAS_PERM, MMA_ORDER),
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 3, BITS, HAS_PERM, MMA_ORDER),
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 4, BITS, HAS_PERM, MMA_ORDER),
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 5, BITS, HAS_PERM, MMA_ORDER),
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 6, BITS, HAS_PERM, MMA_ORDER),
        _x_field(x_ptr, x_base, k0, perm_ptr, perm_base, K, offs_w, 7, BITS, HAS_PERM, MMA_ORDER),
    )


@triton.jit
def _term(words, zf, xs, s: tl.constexpr, BITS: tl.constexpr):
    """(q - zero) * x for field ``s`` of every word: one LOP3 (+ a shared shift), one FADD, one FMUL/FFMA."""
    POS, SHIFT = _field_pos(s, BITS)
    field = ((words >> SHIFT) & (((1 << BITS) - 1) << (BITS * POS))) | 0x4B000000
    offset = 8388608.0 + zf * (1 << (BITS * POS))
    return (field.to(tl.float32, bitcast=True) - offset[:, None]) * xs[None, :]


@triton.jit
def _row_dot(words, zero, x0, x1, x2, x3, x4, x5, x6, x7, BITS: tl.constexpr):
    """sum_k x[k] * (q[n, k] - zero[n]) over one K block: [BN] fp32 (exact products, fp32 sums)."""
    zf = zero.to(tl.float32)
    acc = _term(words, zf, x0, 0, BITS) + _term(words, zf, x1, 1, BITS)
    acc += _term(words, zf, x2, 2, BITS) + _term(words, zf, x3, 3, BITS)
    if BITS == 4:
        acc += _term(words, zf, x4, 4, BITS) + _term(words, zf, x5, 5, BITS)
        acc += _term(words, zf, x6, 6, BITS) + _term(words, zf, x7, 7, BITS)
    return tl.sum(acc, axis=1)


@triton.jit
def _word_mask(n_mask, offs_w, first_word, k_words, EVEN_K: tl.constexpr):
    """Rows in range, and (only when K is not a multiple of BLOCK_K) words in range: a mask that varies
    along the words would split the 16-byte loads into single words."""
    if EVEN_K:
        return tl.broadcast_to(n_mask[:, None], (n_mask.shape[0], offs_w.shape[0]))
    return n_mask[:, None] & (first_word + offs_w < k_words)[None, :]


@triton.jit
def _quant_params(scale_ptrs, zero_ptrs, group, stride_s_g, n_mask, HAS_ZEROS: tl.constexpr,
                  SYM_ZERO: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(scale as stored, zero int32) rows of one group; shared with the tensor-core kernels of fused_moe.py."""
    scale = tl.load(scale_ptrs + group * stride_s_g, mask=n_mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(zero_ptrs + group * stride_s_g, mask=n_mask, other=0).to(tl.int32)
    else:
        zero = tl.full((BLOCK_N,), SYM_ZERO, tl.int32)
    return scale, zero


@triton.jit
def _expert_of(topk_ids_ptr, pair, num_experts):
    """The pair's expert, clamped into the stack: a bad id (NaN router logits) must not read past the weights."""
    return tl.minimum(tl.maximum(tl.load(topk_ids_ptr + pair), 0), num_experts - 1).to(tl.int64)


@triton.jit
def _w13_decode_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, inter_ptr, topk_ids_ptr,
    num_experts, N, K, group_len, stride_x, stride_qw_e, stride_qw_n, stride_s_e, stride_s_g, stride_inter,
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr, ACT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, MMA_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """inter[pair, n] = silu(gate_n . x) * (up_n . x) for one (token, expert) pair and BLOCK_N channels.

    Weights, scales and zeros are loaded PREFETCH (1 or 2) K blocks ahead and the activations one block
    ahead, so the arithmetic of a block never waits on the memory it needs."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = _expert_of(topk_ids_ptr, pair, num_experts)
    token = (pair // TOP_K).to(tl.int64)
    VALS: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // VALS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)
    gate_ptrs = qw_ptr + expert * stride_qw_e + offs_n[:, None].to(tl.int64) * stride_qw_n + offs_w[None, :]
    up_ptrs = gate_ptrs + N * stride_qw_n
    scale_ptrs = scales_ptr + expert * stride_s_e + offs_n
    zero_ptrs = zeros_ptr + expert * stride_s_e + offs_n
    x_base = token * stride_x
    perm_base = expert * K
    k_words = K // VALS
    acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Block 0 (and block 1 when PREFETCH == 2) before the loop; the loop loads block k0 + PREFETCH*BLOCK_K.
    gate_0, up_0, sg_0, zg_0, su_0, zu_0 = _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, 0, K, k_words,
                                                      group_len, stride_s_g, N, n_mask, offs_w, BITS, HAS_ZEROS,
                                                      SYM_ZERO, EVEN_K, BLOCK_N, BLOCK_K)  # fmt: skip
    gate_1, up_1, sg_1, zg_1, su_1, zu_1 = _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, BLOCK_K, K, k_words,
                                                      group_len, stride_s_g, N, n_mask, offs_w, BITS, HAS_ZEROS,
                                                      SYM_ZERO, EVEN_K, BLOCK_N,
                                                      BLOCK_K)  # fmt: skip
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_block(
        x_ptr, x_base, 0, perm_ptr, perm_base, K, offs_w, BITS, HAS_PERM, MMA_ORDER
    )
    for k0 in range(0, K, BLOCK_K):
        ahead = k0 + PREFETCH * BLOCK_K
        gate_n, up_n, sg_n, zg_n, su_n, zu_n = _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, ahead, K,
                                                          k_words, group_len, stride_s_g, N, n_mask, offs_w, BITS,
                                                          HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N, BLOCK_K)  # fmt: skip
        n0, n1, n2, n3, n4, n5, n6, n7 = _x_block(x_ptr, x_base, k0 + BLOCK_K, perm_ptr, perm_base, K, offs_w, BITS,
                                                  HAS_PERM, MMA_ORDER)  # fmt: skip
        acc_gate += sg_0 * _row_dot(gate_0, zg_0, x0, x1, x2, x3, x4, x5, x6, x7, BITS)
        acc_up += su_0 * _row_dot(up_0, zu_0, x0, x1, x2, x3, x4, x5, x6, x7, BITS)
        if PREFETCH == 2:
            gate_0, up_0, sg_0, zg_0, su_0, zu_0 = gate_1, up_1, sg_1, zg_1, su_1, zu_1
            gate_1, up_1, sg_1, zg_1, su_1, zu_1 = gate_n, up_n, sg_n, zg_n, su_n, zu_n
        else:
            gate_0, up_0, sg_0, zg_0, su_0, zu_0 = gate_n, up_n, sg_n, zg_n, su_n, zu_n
        x0, x1, x2, x3, x4, x5, x6, x7 = n0, n1, n2, n3, n4, n5, n6, n7
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(inter_ptr + pair.to(tl.int64) * stride_inter + offs_n, act.to(ACT_DTYPE), mask=n_mask)


@triton.jit
def _w13_block(gate_ptrs, up_ptrs, scale_ptrs, zero_ptrs, k0, K, k_words, group_len, stride_s_g, N, n_mask, offs_w,
               BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SYM_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Gate and up words, scales and zeros of the K block at ``k0``.

    A block past K (a prefetch the loop never uses) reads the last real block again instead: always in
    bounds, and no scalar term in the mask to break the 16-byte loads."""
    VALS: tl.constexpr = 32 // BITS
    k0 = tl.minimum(k0, (K - 1) // BLOCK_K * BLOCK_K)
    mask = _word_mask(n_mask, offs_w, k0 // VALS, k_words, EVEN_K)
    gate = tl.load(gate_ptrs + k0 // VALS, mask=mask, other=0)
    up = tl.load(up_ptrs + k0 // VALS, mask=mask, other=0)
    group = k0 // group_len
    scale_g, zero_g = _quant_params(scale_ptrs, zero_ptrs, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO, BLOCK_N)
    scale_u, zero_u = _quant_params(scale_ptrs + N, zero_ptrs + N, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO,
                                    BLOCK_N)  # fmt: skip
    return gate, up, scale_g, zero_g, scale_u, zero_u


@triton.jit
def _w2_block(w_ptrs, scale_ptrs, zero_ptrs, k0, K, k_words, group_len, stride_s_g, n_mask, offs_w,
              BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, SYM_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Words, scales and zeros of the K block at ``k0`` (past K: the last real block, as in _w13_block)."""
    VALS: tl.constexpr = 32 // BITS
    k0 = tl.minimum(k0, (K - 1) // BLOCK_K * BLOCK_K)
    mask = _word_mask(n_mask, offs_w, k0 // VALS, k_words, EVEN_K)
    words = tl.load(w_ptrs + k0 // VALS, mask=mask, other=0)
    group = k0 // group_len
    scale, zero = _quant_params(scale_ptrs, zero_ptrs, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO, BLOCK_N)
    return words, scale, zero


@triton.jit
def _w2_decode_kernel(
    inter_ptr, qw_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr, topk_ids_ptr,
    num_experts, N, K, group_len, stride_inter, stride_qw_e, stride_qw_n, stride_s_e, stride_s_g, stride_out,
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    ACT_DTYPE: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr, MMA_ORDER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """out[pair or token, n] (+)= w[pair] * (W2[e] @ inter[pair])[n] for one pair and BLOCK_N channels."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = _expert_of(topk_ids_ptr, pair, num_experts)
    VALS: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // VALS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)
    w_ptrs = qw_ptr + expert * stride_qw_e + offs_n[:, None].to(tl.int64) * stride_qw_n + offs_w[None, :]
    scale_ptrs = scales_ptr + expert * stride_s_e + offs_n
    zero_ptrs = zeros_ptr + expert * stride_s_e + offs_n
    x_base = pair.to(tl.int64) * stride_inter
    k_words = K // VALS
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_0, s_0, z_0 = _w2_block(w_ptrs, scale_ptrs, zero_ptrs, 0, K, k_words, group_len, stride_s_g, n_mask, offs_w,
                              BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N, BLOCK_K)  # fmt: skip
    w_1, s_1, z_1 = _w2_block(w_ptrs, scale_ptrs, zero_ptrs, BLOCK_K, K, k_words, group_len, stride_s_g, n_mask,
                              offs_w, BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N, BLOCK_K)  # fmt: skip
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_block(inter_ptr, x_base, 0, inter_ptr, 0, K, offs_w, BITS, False, MMA_ORDER)
    for k0 in range(0, K, BLOCK_K):
        w_n, s_n, z_n = _w2_block(w_ptrs, scale_ptrs, zero_ptrs, k0 + PREFETCH * BLOCK_K, K, k_words, group_len,
                                  stride_s_g, n_mask, offs_w, BITS, HAS_ZEROS, SYM_ZERO, EVEN_K, BLOCK_N,
                                  BLOCK_K)  # fmt: skip
        n0, n1, n2, n3, n4, n5, n6, n7 = _x_block(
            inter_ptr, x_base, k0 + BLOCK_K, inter_ptr, 0, K, offs_w, BITS, False, MMA_ORDER
        )
        acc += s_0 * _row_dot(w_0, z_0, x0, x1, x2, x3, x4, x5, x6, x7, BITS)
        if PREFETCH == 2:
            w_0, s_0, z_0 = w_1, s_1, z_1
            w_1, s_1, z_1 = w_n, s_n, z_n
        else:
            w_0, s_0, z_0 = w_n, s_n, z_n
        x0, x1, x2, x3, x4, x5, x6, x7 = n0, n1, n2, n3, n4, n5, n6, n7
    acc = acc * tl.load(topk_weights_ptr + pair).to(tl.float32)
    if ATOMIC:
        token = (pair // TOP_K).to(tl.int64)
        tl.atomic_add(out_ptr + token * stride_out + offs_n, acc, mask=n_mask)
    else:
        tl.store(out_ptr + pair.to(tl.int64) * stride_out + offs_n, acc.to(ACT_DTYPE), mask=n_mask)


def decode_grid(num_pairs: int, n: int, block_n: int) -> tuple[int, int]:
    return (num_pairs, triton.cdiv(n, block_n))
