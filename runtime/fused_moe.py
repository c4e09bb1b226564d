"""The fused W4A16 MoE: two Triton GEMMs that read the repack-moe layout as stored.

``fused_moe`` computes ``sum_k w[m,k] * W2[e] @ (silu(W1[e] x) * (W3[e] x))`` with ``e = topk_ids[m,k]``.

Which kernels run: decode configs (``DIRECT``) take the CUDA-core kernels of runtime/kernels/decode.py (any
word order); ``WEIGHT_MAJOR`` configs, and every tensor-core config on an mma128 stack, take the weight-major
kernels of runtime/kernels/weight_major.py (the tuned default past decode); the kernels below serve the gptq-order
stacks those cannot run (groups under 128, K not a multiple of 128, 8-bit):

- w13 kernel: one program per (row block, n tile) loads the gate rows ``n0..`` and the up rows ``I+n0..``
  of its expert (SPEC.md section 3 puts matching channels there), runs two tensor-core dots into fp32
  and stores ``silu(gate) * up`` in the activation dtype, one row per (token, k) pair.
- w2 kernel: the same GEMM on that intermediate; the routing weight is applied in fp32 and the top-k sum
  is either a torch ``sum`` over per-pair rows (``REDUCE="pairs"``) or fp32 atomics into [M, H]
  (``REDUCE="atomic"``).
- Rows: "direct" mode (decode) gives each pair its own block (one valid row, expert read from
  ``topk_ids``: no alignment launch); "aligned" mode sorts pairs by expert into BLOCK_M blocks
  (runtime/kernels/align.py) so each weight tile is dequantised once per block of up to BLOCK_M tokens.
- Dequantisation: the int32 words are viewed as int16 (4 nibbles of consecutive K each), a shift and a
  mask give the nibble, an OR with 0x6400 and a bitcast give the fp16 ``1024 + q`` with no int-to-float
  conversion, then ``(v - (1024 + zero)) * scale`` (the subtraction is exact, the product rounds once:
  GPTQModel's own ``fp16(scale * (q - zero))``). bf16 uses ``0x4300`` (128 + q) and an fp32 product.

Nothing here synchronises with the host, so the whole call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.formats.errors import RepackError
from repack.runtime.kernel_config import fit_config, get_config
from repack.runtime.kernels import weight_major
from repack.runtime.kernels.align import align_pairs, block_rows, tile_ids
from repack.runtime.kernels.decode import _quant_params, _word_mask, run_decode
from repack.runtime.weights import MoeWeights


@triton.jit
def _dequant(words, scale, zero, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             ACT_DTYPE: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """int16 words [BLOCK_N, BLOCK_K*BITS/16] -> weights [BLOCK_N, BLOCK_K] in ACT_DTYPE.

    ``scale`` fp16 [BLOCK_N], ``zero`` int32 [BLOCK_N] (true zero point). FAST: exponent-OR conversion.
    """
    VALS: tl.constexpr = 16 // BITS
    shifts = (tl.arange(0, VALS) * BITS).to(tl.int16)
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCK_N, BLOCK_K))
    if FAST and tl.float16 == ACT_DTYPE:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q, exact
        zf = (zero + 1024).to(tl.float16)
        w = (v - zf[:, None]) * scale[:, None]
    elif FAST and tl.bfloat16 == ACT_DTYPE:
        v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q, exact (4-bit only)
        zf = (zero + 128).to(tl.bfloat16)
        w = ((v - zf[:, None]).to(tl.float32) * scale.to(tl.float32)[:, None]).to(tl.bfloat16)
    else:
        w = ((q.to(tl.float32) - zero.to(tl.float32)[:, None]) * scale.to(tl.float32)[:, None]).to(ACT_DTYPE)
    return w


@triton.jit
def _nibble_dot(acc, x_rows, k0, perm_ptrs, words, scale, zero, s: tl.constexpr, j_mask, a_mask, offs_j,
                HAS_PERM: tl.constexpr, BITS: tl.constexpr, ACT_DTYPE: tl.constexpr,
                SCALE_ACC: tl.constexpr):  # fmt: skip
    """acc += A[:, k0 + pack*j + s] @ W[:, k0 + pack*j + s]^T for field ``s`` of every int32 word.

    No reshape and no interleave: field s of the [BLOCK_N, BLOCK_K/pack] word tile is a 2-D tile in the
    layout the words were loaded in, and the activation columns it multiplies are gathered (stride pack).
    SCALE_ACC: the weights stay the exact integers ``q - zero`` (the caller scales the K step's sum once per
    output column: no per-weight multiply, and no fp32 round trip for bf16); else they are dequantized.
    """
    VALS: tl.constexpr = 32 // BITS
    cols = k0 + offs_j * VALS + s
    if HAS_PERM:
        cols = tl.load(perm_ptrs + cols, mask=j_mask, other=0)
    a = tl.load(x_rows + cols[None, :], mask=a_mask, other=0.0)
    q = (words >> (BITS * s)) & ((1 << BITS) - 1)
    if tl.float16 == ACT_DTYPE:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q, exact
        w = v - (zero + 1024).to(tl.float16)[:, None]  # q - zero, exact
        if not SCALE_ACC:
            w = w * scale[:, None]
    elif SCALE_ACC and BITS == 4:
        v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q, exact
        w = v - (zero + 128).to(tl.bfloat16)[:, None]
    elif SCALE_ACC:
        w = (q - zero[:, None]).to(ACT_DTYPE)  # |q - zero| <= 255: exact in bf16
    else:
        w = ((q - zero[:, None]).to(tl.float32) * scale.to(tl.float32)[:, None]).to(ACT_DTYPE)
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _w13_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, inter_ptr,
    sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
    num_pairs, num_pid_m, N, K, group_len,
    stride_x, stride_qw_e, stride_qw_n, stride_s_e, stride_s_g, stride_inter,
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, FAST: tl.constexpr, ACT_DTYPE: tl.constexpr,
    NIBBLE_DOTS: tl.constexpr, SCALE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """inter[pair, n] = silu(gate_n . x) * (up_n . x) for the rows of one block and BLOCK_N channels.

    EVEN_K (K a multiple of BLOCK_K) drops the K masks so weight and activation loads stay 16 bytes wide.
    NIBBLE_DOTS: ``qw_ptr`` is the int32 view and each K step runs one dot per nibble position (needs
    BLOCK_K >= 16 * pack and one group per K step); otherwise the int16 view is unpacked by a reshape.
    """
    pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pairs, row_mask, expert = block_rows(pid_m, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    tokens = (pairs // TOP_K).to(tl.int64)
    VALS: tl.constexpr = (32 if NIBBLE_DOTS else 16) // BITS
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
        w_mask = _word_mask(n_mask, offs_w, k0 // VALS, K // VALS, EVEN_K)
        gate_words = tl.load(gate_ptrs, mask=w_mask, other=0)
        up_words = tl.load(up_ptrs, mask=w_mask, other=0)
        group = k0 // group_len
        scale_gate, zero_gate = _quant_params(scale_ptrs, zero_ptrs, group, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO,
                                              BLOCK_N)  # fmt: skip
        scale_up, zero_up = _quant_params(scale_ptrs + N, zero_ptrs + N, group, stride_s_g, n_mask, HAS_ZEROS,
                                          SYM_ZERO, BLOCK_N)  # fmt: skip
        if NIBBLE_DOTS:
            j_mask = (k0 + offs_w * VALS) < K
            a_mask = row_mask[:, None] & j_mask[None, :]
            if SCALE_ACC:
                part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            else:
                part_g = acc_gate
                part_u = acc_up
            for s in tl.static_range(VALS):
                part_g = _nibble_dot(part_g, x_rows, k0, perm_ptrs, gate_words, scale_gate, zero_gate, s, j_mask,
                                     a_mask, offs_w, HAS_PERM, BITS, ACT_DTYPE, SCALE_ACC)  # fmt: skip
                part_u = _nibble_dot(part_u, x_rows, k0, perm_ptrs, up_words, scale_up, zero_up, s, j_mask,
                                     a_mask, offs_w, HAS_PERM, BITS, ACT_DTYPE, SCALE_ACC)  # fmt: skip
            if SCALE_ACC:
                acc_gate += part_g * scale_gate.to(tl.float32)[None, :]
                acc_up += part_u * scale_up.to(tl.float32)[None, :]
            else:
                acc_gate = part_g
                acc_up = part_u
        else:
            k_mask = k0 + offs_k < K
            if EVEN_K:
                a_mask = tl.broadcast_to(row_mask[:, None], (BLOCK_M, BLOCK_K))
            else:
                a_mask = row_mask[:, None] & k_mask[None, :]
            if HAS_PERM:
                cols = tl.load(perm_ptrs + k0 + offs_k, mask=k_mask, other=0)
            else:
                cols = k0 + offs_k
            a = tl.load(x_rows + cols[None, :], mask=a_mask, other=0.0)
            w_gate = _dequant(gate_words, scale_gate, zero_gate, BITS, BLOCK_N, BLOCK_K, ACT_DTYPE, FAST)
            acc_gate = tl.dot(a, tl.trans(w_gate), acc_gate)
            w_up = _dequant(up_words, scale_up, zero_up, BITS, BLOCK_N, BLOCK_K, ACT_DTYPE, FAST)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up)
        gate_ptrs += WORDS_K
        up_ptrs += WORDS_K
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out_ptrs = inter_ptr + pairs[:, None].to(tl.int64) * stride_inter + offs_n[None, :]
    tl.store(out_ptrs, act.to(ACT_DTYPE), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _w2_kernel(
    inter_ptr, qw_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr,
    sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
    num_pairs, num_pid_m, N, K, group_len,
    stride_inter, stride_qw_e, stride_qw_n, stride_s_e, stride_s_g, stride_out,
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, FAST: tl.constexpr, ACT_DTYPE: tl.constexpr, ATOMIC: tl.constexpr,
    NIBBLE_DOTS: tl.constexpr, SCALE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[pair or token, n] (+)= w[pair] * (W2[e] @ inter[pair])[n] (NIBBLE_DOTS as in _w13_kernel)."""
    pid_m, pid_n = tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pairs, row_mask, expert = block_rows(pid_m, sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M)
    VALS: tl.constexpr = (32 if NIBBLE_DOTS else 16) // BITS
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
        words = tl.load(w_ptrs, mask=_word_mask(n_mask, offs_w, k0 // VALS, K // VALS, EVEN_K), other=0)
        scale, zero = _quant_params(scale_ptrs, zero_ptrs, k0 // group_len, stride_s_g, n_mask, HAS_ZEROS, SYM_ZERO,
                                    BLOCK_N)  # fmt: skip
        if NIBBLE_DOTS:
            j_mask = (k0 + offs_w * VALS) < K
            a_mask = row_mask[:, None] & j_mask[None, :]
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) if SCALE_ACC else acc
            for s in tl.static_range(VALS):
                part = _nibble_dot(part, a_rows, k0, a_rows, words, scale, zero, s, j_mask, a_mask, offs_w, False, BITS,
                                   ACT_DTYPE, SCALE_ACC)  # fmt: skip
            acc = acc + part * scale.to(tl.float32)[None, :] if SCALE_ACC else part
        else:
            if EVEN_K:
                a_mask = tl.broadcast_to(row_mask[:, None], (BLOCK_M, BLOCK_K))
            else:
                a_mask = row_mask[:, None] & ((k0 + offs_k) < K)[None, :]
            a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=a_mask, other=0.0)
            w = _dequant(words, scale, zero, BITS, BLOCK_N, BLOCK_K, ACT_DTYPE, FAST)
            acc = tl.dot(a, tl.trans(w), acc)
        w_ptrs += WORDS_K
    route_w = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    mask = row_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tokens = (pairs // TOP_K).to(tl.int64)
        tl.atomic_add(out_ptr + tokens[:, None] * stride_out + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :], acc.to(ACT_DTYPE), mask=mask)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _check_inputs(hidden_states: torch.Tensor, weights: MoeWeights, topk_ids: torch.Tensor, topk_weights) -> None:
    """Turn shape/dtype/device mistakes into one-line RepackErrors before any kernel runs."""
    if hidden_states.dtype not in _TL_DTYPES:
        raise RepackError(
            f"fused_moe: hidden_states dtype {hidden_states.dtype} is not supported; pass float16 or bfloat16"
        )
    if hidden_states.dim() != 2 or hidden_states.shape[1] != weights.hidden_size:
        raise RepackError(
            f"fused_moe: hidden_states shape {list(hidden_states.shape)} does not match the stack's hidden size "
            f"{weights.hidden_size}; pass [tokens, {weights.hidden_size}]"
        )
    m = hidden_states.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise RepackError(
            f"fused_moe: topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
            f"[{m}, top_k] for {m} tokens"
        )
    if weights.bits not in (4, 8):
        raise RepackError(f"fused_moe: {weights.bits}-bit weights are not supported; use a 4- or 8-bit stack")
    group = weights.group_size
    for name, k in (("hidden", weights.hidden_size), ("intermediate", weights.intermediate_size)):
        if group != -1 and k % group:
            raise RepackError(f"fused_moe: {name} size {k} is not a multiple of group size {group}")
    if weights.mma_order and not supports_weight_major(weights):
        raise RepackError(
            "fused_moe: an mma128 stack needs 4-bit weights, hidden and intermediate sizes and the group size "
            "in multiples of 128; re-convert the checkpoint with this repack"
        )
    tensors = [weights.w13_qweight, weights.w13_scales, weights.w2_qweight, weights.w2_scales, topk_ids]
    if any(t.device != hidden_states.device for t in tensors):
        raise RepackError(
            f"fused_moe: weights, topk_ids and hidden_states must be on one device (hidden_states is on "
            f"{hidden_states.device}); move them with .to(device)"
        )


def _launch(kernel, num_pid_m: int, n: int, args: list, constexprs: dict, config: dict, device) -> None:
    """Launch over (row blocks x n tiles) with a config that fits the device's shared memory (shrunk at run
    time if it does not; the grid follows the fitted BLOCK_N)."""

    def launch(c: dict) -> None:
        kernel[(num_pid_m * triton.cdiv(n, c["BLOCK_N"]),)](*args, **constexprs, **c)

    fit_config(config, device, launch, kernel.fn.__name__)


def fused_moe(
    hidden_states: torch.Tensor,
    weights: MoeWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, H]`` fp16/bf16 -> ``[M, H]`` same dtype: the routed experts' weighted sum for every token.

    ``topk_ids`` [M, k] (int32 or int64, values in [0, E)), ``topk_weights`` [M, k] (any float dtype).
    ``config`` overrides the tuned/heuristic kernel config (keys BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    num_warps, num_stages, and optionally DIRECT, WEIGHT_MAJOR, SCALE_ACC, REDUCE "pairs"|"atomic"; the CUDA-core
    decode path (DIRECT without WEIGHT_MAJOR) takes PREFETCH and SPLIT_K and always sums the top-k in its w2
    kernel). ``out`` receives the result.
    """
    _check_inputs(hidden_states, weights, topk_ids, topk_weights)
    m, h = hidden_states.shape
    top_k = topk_ids.shape[1]
    n_inter = weights.intermediate_size
    device = hidden_states.device
    dtype = hidden_states.dtype
    if out is None:
        out = torch.empty(m, h, dtype=dtype, device=device)
    if m == 0:
        return out
    cfg = dict(config) if config is not None else get_config(weights, m, top_k, dtype, device)
    cfg = _fit_blocks(cfg, weights)
    direct = bool(cfg.pop("DIRECT", False))
    reduce = cfg.pop("REDUCE", "pairs")
    num_pairs = m * top_k
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    ids = topk_ids.contiguous()
    route_w = topk_weights.to(torch.float32).contiguous()
    common = dict(
        TOP_K=top_k,
        BITS=weights.bits,
        SYM_ZERO=1 << (weights.bits - 1),
        HAS_ZEROS=weights.w13_zeros is not None,
        ACT_DTYPE=_TL_DTYPES[dtype],
    )
    zeros13 = weights.w13_zeros if weights.w13_zeros is not None else weights.w13_scales
    zeros2 = weights.w2_zeros if weights.w2_zeros is not None else weights.w2_scales
    weight_major_config = bool(cfg.pop("WEIGHT_MAJOR", False))
    if direct and not weight_major_config:
        run_decode(x, weights, ids, route_w, out, zeros13, zeros2, cfg, common)
        return out
    inter = torch.empty(num_pairs, n_inter, dtype=dtype, device=device)
    perm = weights.w13_perm if weights.w13_perm is not None else ids
    atomic = reduce == "atomic"
    if atomic:
        target = torch.zeros(m, h, dtype=torch.float32, device=device)
    elif top_k == 1 and out.is_contiguous():
        target = out
    else:
        target = torch.empty(num_pairs, h, dtype=dtype, device=device)
    if weights.mma_order or (weight_major_config and supports_weight_major(weights)):
        # The weight-major kernels are the only tensor-core kernels that read mma128 words.
        _run_weight_major(x, weights, ids, route_w, inter, target, zeros13, zeros2, perm, common, atomic, direct, cfg)
    else:
        _run_aligned(x, weights, ids, route_w, inter, target, zeros13, zeros2, perm, common, atomic, cfg, device)
    if atomic:
        out.copy_(target)
    elif target is not out:
        torch.sum(target.view(m, top_k, h), dim=1, out=out)
    return out


def _run_aligned(x, weights, ids, route_w, inter, target, zeros13, zeros2, perm, common, atomic, cfg, device) -> None:
    """Blocks of BLOCK_M pairs sharing an expert (runtime/kernels/align.py), tensor-core kernels above."""
    h, n_inter, num_pairs = weights.hidden_size, weights.intermediate_size, ids.numel()
    rows = align_pairs(ids, weights.num_experts, cfg["BLOCK_M"])
    num_pid_m = rows.max_blocks
    # One dot per nibble position needs K >= 16 per dot: BLOCK_K >= 16 * pack (a small group shrinks BLOCK_K).
    nibble_dots = bool(cfg.pop("NIBBLE_DOTS", False)) and cfg["BLOCK_K"] // (32 // weights.bits) >= 16
    mma = dict(
        common,
        FAST=not (common["ACT_DTYPE"] == tl.bfloat16 and weights.bits == 8),
        NIBBLE_DOTS=nibble_dots,
        SCALE_ACC=bool(cfg.pop("SCALE_ACC", True)),
    )
    row_args = [rows.sorted_pairs, rows.block_experts, rows.num_blocks, num_pairs, num_pid_m]
    view = torch.int32 if nibble_dots else torch.int16
    w13_words = weights.w13_qweight.view(view)
    args13 = [x, w13_words, weights.w13_scales, zeros13, perm, inter, *row_args, n_inter, h,
              weights.group_len(h), x.stride(0), w13_words.stride(0), w13_words.stride(1),
              weights.w13_scales.stride(0), weights.w13_scales.stride(1), inter.stride(0)]  # fmt: skip
    flags13 = {**mma, "HAS_PERM": weights.w13_perm is not None, "EVEN_K": h % cfg["BLOCK_K"] == 0}
    _launch(_w13_kernel, num_pid_m, n_inter, args13, flags13, cfg, device)
    w2_words = weights.w2_qweight.view(view)
    args2 = [inter, w2_words, weights.w2_scales, zeros2, route_w, target, *row_args, h, n_inter,
             weights.group_len(n_inter), inter.stride(0), w2_words.stride(0), w2_words.stride(1),
             weights.w2_scales.stride(0), weights.w2_scales.stride(1), target.stride(0)]  # fmt: skip
    flags2 = {**mma, "ATOMIC": atomic, "EVEN_K": n_inter % cfg["BLOCK_K"] == 0}
    _launch(_w2_kernel, num_pid_m, h, args2, flags2, cfg, device)


# bf16 activations on the weight-major kernels (past decode). True (default): each fp16 scale is rounded to bf16
# inside the dequantized weight, as serving stacks that cast GPTQ scales to the model dtype do; bf16 then runs as
# fast as fp16 (H200: -4% to +9% at every M measured). False: the scale is applied exactly, in fp32 once per K step,
# at the cost of a second accumulator and half-width tiles (+15% to +58% past M=128). Relative error against a
# float32 reference, H200, Qwen2-57B / Qwen1.5-MoE shapes: 4.0e-3 / 4.5e-3 rounded, 2.6e-3 / 2.8e-3 exact
# (benchmarks/RESULTS.md). The decode kernels apply scales in fp32 either way.
BF16_SCALES_IN_WEIGHTS = True


def supports_weight_major(weights: MoeWeights) -> bool:
    return weight_major.supports(weights.bits, weights.hidden_size, weights.intermediate_size, weights.group_size)


def _run_weight_major(x, weights, ids, route_w, inter, target, zeros13, zeros2, perm, common, atomic, direct, cfg):
    """The weight-major kernels (runtime/kernels/weight_major.py): weights as the MMA's register operand. mma128 stacks
    read the activations as they are; aligned blocks of gptq-order stacks read them in nibble-major order (one
    copy of x; w13 writes the intermediate that way). DIRECT gives each pair its own block (no alignment) and
    gathers its few activations."""
    h, n_inter, num_pairs = weights.hidden_size, weights.intermediate_size, ids.numel()
    has_perm = weights.w13_perm is not None
    if direct:
        num_pid_m = num_pairs
        row_ptrs = [ids, ids, ids]  # unused: DIRECT blocks read their pair's expert from topk_ids
    else:
        rows = align_pairs(ids, weights.num_experts, cfg["BLOCK_M"])
        num_pid_m = rows.max_blocks
        row_ptrs = [rows.sorted_pairs, rows.block_experts, rows.num_blocks]
    mma_order = weights.mma_order
    nibble_major_x = not (has_perm or direct or mma_order)
    x_in = weight_major.nibble_major(x) if nibble_major_x else x
    flags = {k: v for k, v in common.items() if k != "BITS"}
    scale_acc = bool(cfg.pop("SCALE_ACC", True))
    quant_ahead = bool(cfg.pop("QUANT_AHEAD", False))
    cfg = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages")}  # BLOCK_K is 128
    if common["ACT_DTYPE"] == tl.bfloat16 and not scale_acc and not BF16_SCALES_IN_WEIGHTS:
        # Exact bf16: the scale applied in fp32 (SCALE_ACC); its second accumulator would double the registers of a
        # tile chosen for fp16 (spills), so the tile gives up half its rows instead.
        scale_acc = True
        cfg["BLOCK_N"] = max(32, cfg["BLOCK_N"] // 2)
    # Inline PTX (one LOP3 per two weights) where the kernels are compiled for an NVIDIA GPU, not interpreted.
    inline_ptx = x.is_cuda and torch.version.hip is None
    flags.update(SCALE_ACC=scale_acc, DIRECT=direct, MMA_ORDER=mma_order, QUANT_AHEAD=quant_ahead,
                 INLINE_PTX=inline_ptx)  # fmt: skip
    row_args = [*row_ptrs, ids, num_pairs, num_pid_m, weights.num_experts]
    w13, w2 = weights.w13_qweight, weights.w2_qweight
    args13 = [x_in, w13, weights.w13_scales, zeros13, perm, inter, *row_args, n_inter, h, x_in.stride(0), w13.stride(0),
              w13.stride(1), weights.w13_scales.stride(0), weights.w13_scales.stride(1), inter.stride(0)]  # fmt: skip
    flags13 = dict(flags, HAS_PERM=has_perm, NIBBLE_MAJOR_X=nibble_major_x, GROUP_LEN=weights.group_len(h))
    _launch(weight_major._w13_weight_major_kernel, num_pid_m, n_inter, args13, flags13, cfg, x.device)
    args2 = [inter, w2, weights.w2_scales, zeros2, route_w, target, *row_args, h, n_inter, inter.stride(0),
             w2.stride(0), w2.stride(1), weights.w2_scales.stride(0), weights.w2_scales.stride(1),
             target.stride(0)]  # fmt: skip
    flags2 = dict(flags, ATOMIC=atomic, GROUP_LEN=weights.group_len(n_inter))
    _launch(weight_major._w2_weight_major_kernel, num_pid_m, h, args2, flags2, cfg, x.device)


def _fit_blocks(cfg: dict, weights: MoeWeights) -> dict:
    """BLOCK_K must divide the group (one scale row per K step); shrink it when a config says otherwise."""
    group = weights.group_size
    if group != -1:
        while group % cfg["BLOCK_K"]:
            cfg["BLOCK_K"] //= 2
    cfg["BLOCK_K"] = max(cfg["BLOCK_K"], 16)
    return cfg
