"""Tensor-core decode for Hopper in Gluon: the decode family's launches (prepare -> w13 -> w2, slices of K meeting
in fp32 sums, the top-k summed in w2) with each K step on the tensor cores (the ``decode_mma`` family,
:data:`FAMILY`: mma128 stacks, fp16 or bf16, compute capability 9.0).

Why: the CUDA-core decode (kernels/decode.py) runs 3.8 instructions a weight in its K loop (benchmarks/
KERNEL_NOTES.md item 36), about as much issue as its bytes take at M = 1, and an M = 1 call is made of its programs'
chains (load, multiply, meet). Here one LOP3 and one packed add make two weights of a thread's MMA fragment (mma128
words, formats/SPEC.md section 3; the LOP3 of kernels/gluon_sm90.py), and the MMA does the multiply-adds: about 1.6
instructions a weight with the loads and the MMAs. Written in Gluon because the tl ``tl.dot`` of the same step
(tried: weight_major's dequantization, one warp or four) moved every weight or activation through shuffles or
shared memory with barriers, 3.4-3.5 instructions a weight; here every operand is loaded straight into the layout
the MMA takes, and nothing goes through shared memory.

Measured (benchmarks/KERNEL_NOTES.md item 39): correct in every case, and no faster than the CUDA-core decode at
M = 1; that premise was wrong. Both issue the same 32 weight loads a thread a step, and a program's time is the
latency of that chain, not its issue. So these kernels take no call by default (:data:`PREFERRED`); ``repack tune``
still searches their tiles on Hopper.

One program is one warp: one pair, ``BLOCK_N`` channels (w13: their gate and up rows; w2: ``BLOCK_N`` output rows)
and one slice of K, as the CUDA-core decode. Per K step of 128 inputs:

- the weight words arrive in the layout of the m16n8k16 MMA's A fragment (kernels/gluon_sm90.py ``word_layout``:
  rows ``l // 4 (+ 8)`` of each 16, words ``l % 4`` and ``l % 4 + 4`` of each half step), loaded a step ahead;
- the activations are the B operand, [16, 8] a chunk: the pair's token in column 0, zeros in the other seven (the
  narrowest MMA; the tensor cores idle at decode anyway), loaded straight into the B fragment (lanes 0-3 hold the
  token's inputs; act-order stacks read their pair's row, gathered through its permutation by the prepare launch);
- eight MMAs sum exact ``q - zero`` weights in fp32 and the step's sum is scaled once (one group a step), so fp16
  and bf16 are exact to the MMA's accumulation.

The prepare launch (kernels/decode.py) routes and zeroes the scratch; it prepares no activations (these kernels read
them as they are). w13 writes its intermediate in the activation dtype, row-major, as w2 reads it.

Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from repack.runtime.kernel_config import Family, KernelConfig
from repack.runtime.kernels import decode, gluon_sm90, split_k
from repack.runtime.kernels.common import (
    await_previous_kernel,
    dependent_launches,
    expert_of,
    projection_args,
    release_dependents,
    routing_weight,
    wait_for_previous_kernel,
    word_rows,
)
from repack.runtime.kernels.family import Call, Work
from repack.runtime.weights import MoeWeights

if gluon_sm90.available():
    from triton.experimental import gluon
    from triton.experimental.gluon import constexpr_function
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    from repack.runtime.kernels.gluon_sm90 import _dequant_pairs, _pack2

STEP_K = tl.constexpr(128)  # inputs per K step: one mma128 block of 16 words a row, one scale group
TOKENS = tl.constexpr(8)  # the MMA's N: the pair's token and seven columns of zeros (m16n8k16)


# ---------------------------------------------------------------------------------------------------------------
# Layouts: built inside the kernels from the warp count
# ---------------------------------------------------------------------------------------------------------------

if gluon_sm90.available():

    @constexpr_function
    def acc_layout(warps):
        """The m16n8k16 accumulator [rows, TOKENS]: warp w holds rows 16w .. 16w + 15 of every 16 * warps."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])

    @constexpr_function
    def operand_layout(index, warps):
        """The MMA's A (index 0: weights [rows, 16]) or B (index 1: activations [16, TOKENS]) operand in registers."""
        return gl.DotOperandLayout(operand_index=index, parent=acc_layout(warps), k_width=2)

    @constexpr_function
    def row_layout(warps):
        """[channels] vectors of the epilogue: one channel a thread, none held twice (the split-K sums are atomics)."""
        return gl.BlockedLayout([1], [32], [warps], [0])


# ---------------------------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------------------------

if gluon_sm90.available():

    @gluon.jit
    def _step_words(w_ptrs, k0, k_last, stride_step):
        """The [rows, 8] low and high half-step words of the K step at ``k0``, in the A fragment's layout; a step past
        the slice (a prefetch the loop never uses) reads the slice's last step ``k_last`` again, always in bounds."""
        ptrs = w_ptrs + gl.minimum(k0, k_last) // STEP_K * stride_step
        return gl.load(ptrs), gl.load(ptrs + 8)

    @gluon.jit
    def _chunk_inputs(x_row_ptr, k0, c: gl.constexpr, DTYPE: gl.constexpr, L2_ONLY: gl.constexpr = False):
        """The [16, TOKENS] B operand of chunk ``c`` of the K step at ``k0``: inputs ``k0 + 16c .. + 15`` of the pair's
        row in column 0, zeros elsewhere (lanes 0-3 load, the others only predicate). L2_ONLY: past L1 (``.cg``),
        for a routed w13 that reads x before its wait."""
        B: gl.constexpr = operand_layout(1, gl.num_warps())
        offs_k = gl.arange(0, 16, layout=gl.SliceLayout(1, B))
        offs_t = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, B))
        ptrs = x_row_ptr + k0 + c * 16 + gl.expand_dims(offs_k, 1) + gl.expand_dims(offs_t * 0, 0)
        first = gl.expand_dims(offs_k >= 0, 1) & gl.expand_dims(offs_t == 0, 0)
        if L2_ONLY:
            return gl.load(ptrs, mask=first, other=0.0, cache_modifier=".cg").to(DTYPE)
        return gl.load(ptrs, mask=first, other=0.0).to(DTYPE)

    @gluon.jit
    def _step_quant(scale_ptrs, zero_ptrs, zero_rows, k0, stride_s_g, GROUP_LEN: gl.constexpr,
                    HAS_ZEROS: gl.constexpr, SYM_ZERO: gl.constexpr, IS_FP16: gl.constexpr):  # fmt: skip
        """(scale [rows, 1] fp32 in the accumulator's layout, -(bias + zero), -(64 + zero) [rows, 1] packed x2 in the
        words' layout) of the K step at ``k0``: gluon_sm90's ``_step_quant`` with SCALE_AFTER, without its row masks
        (every row of these tiles is in range; the masks cost 30-40 instructions a K step in the w13 loop)."""
        group = k0 // GROUP_LEN
        scale = gl.expand_dims(gl.load(scale_ptrs + group * stride_s_g).to(gl.float32), 1)
        if HAS_ZEROS:
            zero = gl.load(zero_ptrs + group * stride_s_g + zero_rows).to(gl.int32)
        else:
            zero = gl.full(zero_rows.shape, SYM_ZERO, gl.int32, layout=zero_rows.type.layout)
        if IS_FP16:
            bias2 = _pack2((-(zero + 1024)).to(gl.float16).to(gl.int16, bitcast=True))
            odd2 = _pack2((-(zero + 64)).to(gl.float16).to(gl.int16, bitcast=True))
        else:  # bf16 has no odd-chunk shift: its second bias is unused
            bias2 = _pack2((-(zero + 128)).to(gl.bfloat16).to(gl.int16, bitcast=True))
            odd2 = bias2
        return scale, gl.expand_dims(bias2, 1), gl.expand_dims(odd2, 1)

    @gluon.jit
    def _mma_chunk(part, words, c: gl.constexpr, bias2, odd2, b, IS_FP16: gl.constexpr, DTYPE: gl.constexpr):
        """part + (W - zero)[rows, chunk c] @ b: one chunk of a K step (``words``: its half step's), its exact
        ``q - zero`` weights from gluon_sm90's dequantization (one LOP3 and one packed add per two weights), which
        already sit in the m16n8k16 A fragment: the step's sum is scaled after (``_step_quant``'s SCALE_AFTER)."""
        weights = _dequant_pairs(words, c % 4, bias2, bias2, odd2, IS_FP16, DTYPE, True)
        a = gl.convert_layout(weights, operand_layout(0, gl.num_warps()), assert_trivial=True)
        return mma_v2(a, b, part)

    @gluon.jit
    def _token_column(acc):
        """Column 0 of the accumulator [rows, TOKENS] (the pair's token) as [rows], one row a thread: the accumulator
        moved to whole rows a thread first (once a program), then summed in registers."""
        ROWS_LAYOUT: gl.constexpr = gl.BlockedLayout([1, TOKENS], [32, 1], [gl.num_warps(), 1], [1, 0])
        rows = gl.convert_layout(acc, ROWS_LAYOUT)
        first = gl.expand_dims(gl.arange(0, TOKENS, layout=gl.SliceLayout(0, ROWS_LAYOUT)) == 0, 0)
        column = gl.sum(gl.where(first, rows, gl.zeros_like(rows)), axis=1)
        return gl.convert_layout(column, row_layout(gl.num_warps()))

    @gluon.jit
    def _projection_ptrs(qw_e, scales_e, zeros_e, first_row, stride_qw_band, stride_qw_row, ROWS: gl.constexpr):
        """(word pointers [ROWS, 8] in the A fragment's layout, scale pointers [ROWS] in the accumulator's, zero rows
        [ROWS] and their pointers in the words') of weight rows ``first_row .. first_row + ROWS - 1``."""
        WORDS: gl.constexpr = gluon_sm90.word_layout(ROWS, gl.num_warps())
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, WORDS))
        offs_w = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS))
        w_ptrs = qw_e + gl.expand_dims(word_rows(rows, stride_qw_band, stride_qw_row), 1) + gl.expand_dims(offs_w, 0)
        scale_rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout(gl.num_warps())))
        return w_ptrs, scales_e + scale_rows, zeros_e, rows

    @gluon.jit
    def _key_weight(key):
        """The probability a top-k key holds (its high 32 bits), 0 for a key of no expert (-1)."""
        return gl.where(key >= 0, (key >> 32).to(gl.int32).to(gl.float32, bitcast=True), 0.0)

    @gluon.jit
    def _route_pair(logits_ptr, token, pair, num_experts, stride_logits, TOP_K: gl.constexpr,
                    RENORMALIZE: gl.constexpr, BLOCK_E: gl.constexpr):  # fmt: skip
        """(expert, routing weight) of ``pair``, routed from its token's router logits in this program: softmax in
        fp32, the top-k as TOP_K max-reductions over packed keys (probability bits above the complement of the expert
        id: ties go to the lower id, a NaN probability is chosen last, as expert 0 with weight 0), renormalised over
        the top-k if asked: kernels/routing.py's ``routed`` for one token, whose choice ``pair % TOP_K`` this is.
        The logits are read past L1 (``.cg``): a routed w13 reads them before its wait (they were written at least
        two launches back, as w2's ids are in the three-launch decode)."""
        LAYOUT: gl.constexpr = gl.BlockedLayout([max(1, BLOCK_E // (32 * gl.num_warps()))], [32], [gl.num_warps()],
                                                [0])  # fmt: skip
        experts = gl.arange(0, BLOCK_E, layout=LAYOUT)
        valid = experts < num_experts
        row = logits_ptr + token.to(gl.int64) * stride_logits + experts
        logits = gl.load(row, mask=valid, other=-float("inf"), cache_modifier=".cg").to(gl.float32)
        exps = gl.where(valid, gl.exp(logits - gl.max(logits, axis=0)), 0.0)
        probs = exps / gl.maximum(gl.sum(exps, axis=0), 1e-30)
        keys = (probs.to(gl.int32, bitcast=True).to(gl.int64) << 32) | (BLOCK_E - 1 - experts).to(gl.int64)
        keys = gl.where(valid & (probs == probs), keys, -1)
        choice = pair % TOP_K
        top = gl.max(keys, axis=0)
        mine = top  # the pair's key: the first round's, replaced in the pair's own round
        total = _key_weight(top)  # the top-k's probabilities, for RENORMALIZE (unused code without)
        for j in gl.static_range(1, TOP_K):
            keys = gl.where(keys == top, -1, keys)  # the last round's winner taken out
            top = gl.max(keys, axis=0)
            total += _key_weight(top)
            mine = gl.where(choice == j, top, mine)
        chosen = mine >= 0
        expert = gl.where(chosen, BLOCK_E - 1 - (mine & 0xFFFF).to(gl.int32), 0)
        weight = _key_weight(mine)
        if RENORMALIZE:
            weight = weight / gl.where(total > 0.0, total, 1.0)
        return expert.to(gl.int64), weight

    @gluon.jit
    def _w13_kernel(
        # pointers
        x_ptr, qw_ptr, scales_ptr, zeros_ptr, inter_ptr, topk_ids_ptr, sums_ptr, arrivals_ptr, logits_ptr,
        # sizes
        num_experts, N, K, blocks_per_split,
        # strides
        stride_x, stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g, stride_inter,
        stride_logits,
        # the stack and the activations
        TOP_K: gl.constexpr, GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr,
        ROW_PER_PAIR: gl.constexpr,
        # routing in this kernel (:data:`ROUTE_IN_GEMMS`)
        ROUTE: gl.constexpr, RENORMALIZE: gl.constexpr, BLOCK_E: gl.constexpr,
        # kernel switches and tile
        SPLIT_K: gl.constexpr, BLOCK_N: gl.constexpr, DEPENDENT: gl.constexpr,
    ):  # fmt: skip
        """inter[pair, n] = silu(gate_n . x) * (up_n . x) for one pair, BLOCK_N channels and (SPLIT_K) one slice of K;
        slices meet in fp32 sums and the last to arrive applies SiLU. ``x`` has a row a token, or with ROW_PER_PAIR a
        row a pair (act-order: gathered through the pair's permutation by the prepare launch).

        With ROUTE the program routes its pair from the router logits itself and waits for the prepare launch (which
        then only zeroes the scratch) just before its first write, its whole K slice computed meanwhile: the routing
        leaves the call's critical path. Without, the prepare launch routes and this kernel waits at its top."""
        pair = gl.program_id(0)
        pid_n = gl.program_id(1)
        if ROUTE:
            release_dependents(DEPENDENT)  # w2 may take the room this kernel's finished programs leave
            expert, _weight = _route_pair(logits_ptr, pair // TOP_K, pair, num_experts, stride_logits, TOP_K,
                                          RENORMALIZE, BLOCK_E)  # fmt: skip
        else:
            await_previous_kernel(DEPENDENT)  # the prepare launch routes the pairs: nothing to load before
            expert = expert_of(topk_ids_ptr, pair, num_experts)
        x_row = x_ptr + (pair if ROW_PER_PAIR else pair // TOP_K).to(gl.int64) * stride_x
        qw_e = qw_ptr + expert * stride_qw_e
        scales_e = scales_ptr + expert * stride_s_e
        zeros_e = zeros_ptr + expert * stride_s_e
        n0 = pid_n * BLOCK_N
        gate_w, gate_s, gate_z, gate_rows = _projection_ptrs(qw_e, scales_e, zeros_e, n0, stride_qw_band,
                                                             stride_qw_row, BLOCK_N)  # fmt: skip
        up_w, up_s, up_z, up_rows = _projection_ptrs(qw_e, scales_e, zeros_e, N + n0, stride_qw_band, stride_qw_row,
                                                     BLOCK_N)  # fmt: skip
        k_begin, k_end, k_last = split_k.k_range(K, blocks_per_split, STEP_K)
        DTYPE: gl.constexpr = x_ptr.dtype.element_ty  # the activations' (fp16 or bf16)
        IS_FP16: gl.constexpr = gl.float16 == DTYPE
        acc_gate = gl.full([BLOCK_N, TOKENS], 0.0, gl.float32, layout=acc_layout(gl.num_warps()))
        acc_up = acc_gate
        gate_low, gate_high = _step_words(gate_w, k_begin, k_last, stride_qw_step)
        up_low, up_high = _step_words(up_w, k_begin, k_last, stride_qw_step)
        for k0 in range(k_begin, k_end, STEP_K):
            next_gate = _step_words(gate_w, k0 + STEP_K, k_last, stride_qw_step)
            next_up = _step_words(up_w, k0 + STEP_K, k_last, stride_qw_step)
            scale_g, bias_g, odd_g = _step_quant(gate_s, gate_z, gate_rows, k0, stride_s_g, GROUP_LEN, HAS_ZEROS,
                                                 SYM_ZERO, IS_FP16)  # fmt: skip
            scale_u, bias_u, odd_u = _step_quant(up_s, up_z, up_rows, k0, stride_s_g, GROUP_LEN, HAS_ZEROS, SYM_ZERO,
                                                 IS_FP16)  # fmt: skip
            part_gate = gl.full([BLOCK_N, TOKENS], 0.0, gl.float32, layout=acc_layout(gl.num_warps()))
            part_up = part_gate
            for c in gl.static_range(8):
                b = _chunk_inputs(x_row, k0, c, DTYPE, ROUTE)
                part_gate = _mma_chunk(part_gate, gate_low if c < 4 else gate_high, c, bias_g, odd_g, b, IS_FP16,
                                       DTYPE)  # fmt: skip
                part_up = _mma_chunk(part_up, up_low if c < 4 else up_high, c, bias_u, odd_u, b, IS_FP16, DTYPE)
            acc_gate += part_gate * scale_g
            acc_up += part_up * scale_u
            gate_low, gate_high = next_gate
            up_low, up_high = next_up
        gate = _token_column(acc_gate)
        up = _token_column(acc_up)
        if ROUTE:
            wait_for_previous_kernel(DEPENDENT)  # the scratch zeroed, the previous call's reads of it done
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=row_layout(gl.num_warps()))
        n_ok = offs_n < N  # every row is (N is a multiple of 128): the split-K meeting's mask
        done = True
        if SPLIT_K:
            gate_row, up_row = split_k.gate_up_rows(sums_ptr, pair, offs_n, BLOCK_N)
            gl.atomic_add(gate_row, gate, mask=n_ok, sem="relaxed")
            counter = arrivals_ptr + pair * gl.num_programs(1) + pid_n
            done = split_k.add_and_arrive(up_row, up, n_ok, counter, gl.num_programs(2))
            if done:
                gate, up = split_k.totals(gate_row, up_row, n_ok)
        if done:
            act = gate / (1.0 + gl.exp(-gate)) * up
            gl.store(inter_ptr + pair.to(gl.int64) * stride_inter + offs_n, act.to(DTYPE))

    @gluon.jit
    def _w2_kernel(
        # pointers
        inter_ptr, qw_ptr, scales_ptr, zeros_ptr, topk_weights_ptr, out_ptr, topk_ids_ptr, sums_ptr, arrivals_ptr,
        logits_ptr,
        # sizes
        num_experts, N, K, blocks_per_split,
        # strides
        stride_inter, stride_qw_e, stride_qw_band, stride_qw_row, stride_qw_step, stride_s_e, stride_s_g, stride_out,
        stride_logits,
        # the stack and the activations
        TOP_K: gl.constexpr, GROUP_LEN: gl.constexpr, SYM_ZERO: gl.constexpr, HAS_ZEROS: gl.constexpr,
        # routing in this kernel (:data:`ROUTE_IN_GEMMS`)
        ROUTE: gl.constexpr, RENORMALIZE: gl.constexpr, BLOCK_E: gl.constexpr,
        # kernel switches and tile
        REDUCE: gl.constexpr, BLOCK_N: gl.constexpr, DEPENDENT: gl.constexpr,
    ):  # fmt: skip
        """out[token, n] = sum over the token's pairs of w[pair] * (W2[e] @ inter[pair])[n], BLOCK_N rows of one pair
        and one slice of K per program; with REDUCE the programs add into the token's fp32 row and the last of its
        TOP_K * slices writes it out. A dependent launch reads its pair's expert (written two launches back) past L1
        (with ROUTE it routes the pair itself, from logits written three launches back) and its first step's words
        while w13 still runs, and waits for w13 before its intermediate."""
        pair = gl.program_id(0)
        pid_n = gl.program_id(1)
        if ROUTE:
            expert, route_weight = _route_pair(logits_ptr, pair // TOP_K, pair, num_experts, stride_logits, TOP_K,
                                               RENORMALIZE, BLOCK_E)  # fmt: skip
        else:
            expert = expert_of(topk_ids_ptr, pair, num_experts, DEPENDENT)
            route_weight = routing_weight(topk_weights_ptr, pair, DEPENDENT)
        n0 = pid_n * BLOCK_N
        w_ptrs, scale_ptrs, zero_ptrs, zero_rows = _projection_ptrs(qw_ptr + expert * stride_qw_e,
                                                                    scales_ptr + expert * stride_s_e,
                                                                    zeros_ptr + expert * stride_s_e, n0,
                                                                    stride_qw_band, stride_qw_row,
                                                                    BLOCK_N)  # fmt: skip
        k_begin, k_end, k_last = split_k.k_range(K, blocks_per_split, STEP_K)
        low, high = _step_words(w_ptrs, k_begin, k_last, stride_qw_step)  # before the wait: w13 still runs
        await_previous_kernel(DEPENDENT)  # w13's intermediate from here on
        inter_row = inter_ptr + pair.to(gl.int64) * stride_inter
        DTYPE: gl.constexpr = inter_ptr.dtype.element_ty  # the activations' (fp16 or bf16)
        IS_FP16: gl.constexpr = gl.float16 == DTYPE
        acc = gl.full([BLOCK_N, TOKENS], 0.0, gl.float32, layout=acc_layout(gl.num_warps()))
        for k0 in range(k_begin, k_end, STEP_K):
            next_low, next_high = _step_words(w_ptrs, k0 + STEP_K, k_last, stride_qw_step)
            scale, bias2, odd2 = _step_quant(scale_ptrs, zero_ptrs, zero_rows, k0, stride_s_g, GROUP_LEN, HAS_ZEROS,
                                             SYM_ZERO, IS_FP16)  # fmt: skip
            part = gl.full([BLOCK_N, TOKENS], 0.0, gl.float32, layout=acc_layout(gl.num_warps()))
            for c in gl.static_range(8):
                b = _chunk_inputs(inter_row, k0, c, DTYPE)
                part = _mma_chunk(part, low if c < 4 else high, c, bias2, odd2, b, IS_FP16, DTYPE)
            acc += part * scale
            low, high = next_low, next_high
        result = _token_column(acc) * route_weight
        token = (pair // TOP_K).to(gl.int64)
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=row_layout(gl.num_warps()))
        n_ok = offs_n < N  # every row is (N is a multiple of 128): the split-K meeting's mask
        done = True
        if REDUCE:
            row = sums_ptr + token * N + offs_n
            counter = arrivals_ptr + token * gl.num_programs(1) + pid_n
            done = split_k.add_and_arrive(row, result, n_ok, counter, TOP_K * gl.num_programs(2))
            if done:
                result = split_k.total(row, n_ok)
        if done:
            gl.store(out_ptr + token * stride_out + offs_n, result.to(DTYPE))


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16)  # the activations these kernels take

# Whether these kernels take the calls the CUDA-core decode would (its heuristic's, kernels/decode.py
# ``Decode.heuristic``, and a tuned table's decode entries). Off: measured beside the CUDA-core decode (H100, same
# process, benchmarks/RESULTS.md 2026-12-07 13:04 UTC; KERNEL_NOTES.md item 39) they are no faster where they were
# meant to be, M = 1: Qwen3-30B 17.8 against 17.9 us, Qwen1.5-MoE 17.7 against 16.4, Qwen2-57B 58.2 against 56.4.
# Half the instructions a weight do not shorten a program's chain of loads, which is what a decode program waits on.
# `project:decode_mma.PREFERRED=True` runs them in the anchor. The heuristic's tile: channels a program, warps a
# program (each owns 16 of every 16 * warps rows) and K slices at up to 8 pairs (the CUDA-core decode's
# decode.FEW_PAIRS_SPLIT, measured for a loop of twice the instructions: the anchor patches them too).
PREFERRED = False
# Whether w13 and w2 route their pairs themselves when the call brings router logits (not act-order, whose rows the
# prepare launch gathers by expert): the prepare launch then only zeroes the scratch, and w13 waits for it just
# before its first write (item 37). Off: slower in every cell it changed (same run: Qwen3-30B M = 1 20.1 against 17.8
# us with the prepare launch routing, Qwen2-57B 69.7 against 58.2), each of w13's and w2's programs paying the routing
# that one launch did once (`project:decode_mma.PREFERRED=True;decode_mma.ROUTE_IN_GEMMS=True`).
ROUTE_IN_GEMMS = False
BLOCK_N = 32
WARPS = 1
FEW_PAIRS_SPLIT = 8


def launch(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights,
    topk_ids: torch.Tensor,  # [M, T] int32/int64
    topk_weights: torch.Tensor,  # [M, T] fp32
    out: torch.Tensor,  # [M, H] activation dtype: the result, written by w2
    config: KernelConfig,
    routing: tuple[torch.Tensor, bool] | None = None,  # (router logits [M, E] unit stride along E, renormalize)
) -> None:
    """prepare (routing, zeroed scratch, act-order rows) -> w13 -> w2 straight into ``out``: three launches, as the
    CUDA-core decode's; with :data:`ROUTE_IN_GEMMS` and ``routing`` w13 and w2 route themselves. From ``config``:
    block_n (channels a program), num_warps and split_k (slices of K). ``topk_ids`` and ``topk_weights`` are
    written only where the prepare launch routes."""
    m, h = x.shape
    n_inter, num_pairs, top_k = weights.intermediate_size, topk_ids.numel(), topk_ids.shape[1]
    block_n = config.block_n
    per_slice13, slices13 = split_k.k_slices(h, STEP_K, config.split_k)
    per_slice2, slices2 = split_k.k_slices(n_inter, STEP_K, config.split_k)
    tiles13, tiles2 = n_inter // block_n, h // block_n
    reduce2 = top_k * slices2 > 1
    scratch = split_k.DecodeScratch(m, num_pairs, h, n_inter, STEP_K, tiles13, tiles2, block_n, slices13 > 1, reduce2,
                                    x.device, inter_dtype=x.dtype)  # fmt: skip
    act_order = weights.w13_perm is not None
    route = ROUTE_IN_GEMMS and routing is not None and not act_order
    rows = decode.prepare(x, weights, topk_ids, topk_weights, scratch, "rows" if act_order else "none", STEP_K,
                          None if route else routing)  # fmt: skip
    x_rows = rows if act_order else x
    views = scratch.views
    logits, renormalize = routing if route else (x, False)  # logits unread without ROUTE
    shared = dict(
        topk_ids_ptr=topk_ids,
        logits_ptr=logits,
        stride_logits=logits.stride(0),
        ROUTE=route,
        RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(weights.num_experts),
        num_experts=weights.num_experts,
        TOP_K=top_k,
        SYM_ZERO=1 << (weights.bits - 1),
        HAS_ZEROS=weights.w13_zeros is not None,
        BLOCK_N=block_n,
        num_warps=config.num_warps,
        **dependent_launches(x.device),
    )
    args13 = projection_args(weights.w13_qweight, weights.w13_scales, weights.w13_zeros, weights.tiled)
    args13.update(x_ptr=x_rows, stride_x=x_rows.stride(0), inter_ptr=views["inter"], stride_inter=scratch.i_pad)
    args13.update(sums_ptr=views["gate_up_sums"], arrivals_ptr=views["gate_up_arrivals"], N=n_inter, K=h)
    args13.update(blocks_per_split=per_slice13, GROUP_LEN=weights.group_len(h), ROW_PER_PAIR=act_order)
    _w13_kernel[(num_pairs, tiles13, slices13)](**args13, **shared, SPLIT_K=slices13 > 1)
    args2 = projection_args(weights.w2_qweight, weights.w2_scales, weights.w2_zeros, weights.tiled)
    args2.update(inter_ptr=views["inter"], stride_inter=scratch.i_pad, topk_weights_ptr=topk_weights, out_ptr=out)
    args2.update(stride_out=out.stride(0), sums_ptr=views["out_sums"], arrivals_ptr=views["out_arrivals"], N=h)
    args2.update(K=n_inter, blocks_per_split=per_slice2, GROUP_LEN=weights.group_len(n_inter))
    _w2_kernel[(num_pairs, tiles2, slices2)](**args2, **shared, REDUCE=reduce2)


def fits(config: KernelConfig) -> bool:
    """Whether these kernels run ``config``'s tile: 16, 32 or 64 channels a program, every warp 16 rows of them."""
    return config.block_n in (16, 32, 64) and config.num_warps in (1, 2, 4) and config.block_n >= 16 * config.num_warps


class DecodeMma(decode.Decode):
    """mma128 stacks (4-bit, groups of a multiple of 128) in fp16 or bf16 on a compute capability 9.0 GPU, one warp
    per pair, channel tile and K slice; where they cannot run a config, the CUDA-core decode runs it. The CUDA-core
    decode's family otherwise: one program per pair, the top-k summed in w2, the routing in the first launch."""

    family = Family.DECODE_MMA
    interpreted = False

    def supports(self, call: Call) -> bool:
        return gluon_sm90.runs_on(call.device) and gluon_sm90.reads(call.weights) and call.dtype in DTYPES

    def heuristic(self, call: Call) -> KernelConfig | None:
        """The calls the CUDA-core decode's heuristic takes, while :data:`PREFERRED`."""
        if not PREFERRED or not self.supports(call) or decode.FAMILY.heuristic(call) is None:
            return None
        split = decode.heuristic_split(call.num_pairs, FEW_PAIRS_SPLIT)
        return KernelConfig(
            Family.DECODE_MMA, TOKENS.value, BLOCK_N, STEP_K.value, 1, WARPS, 1, direct=True, split_k=split
        )

    def asked_by(self, config: KernelConfig) -> bool:
        """Its own configs and, while :data:`PREFERRED`, the CUDA-core decode's (a tuned table's decode entries: the
        same tile and K slices, run here where :func:`fits`)."""
        return config.family is self.family or (PREFERRED and config.family is Family.DECODE)

    def configure(self, config: KernelConfig, call: Call) -> KernelConfig | None:
        if not (self.supports(call) and fits(config)):
            return None
        return replace(config, family=self.family, gluon=None, block_k=STEP_K.value)

    def run(self, work: Work, config: KernelConfig) -> None:
        launch(work.x, work.weights, work.topk_ids, work.topk_weights, work.out, config, work.routing)


FAMILY = DecodeMma()
