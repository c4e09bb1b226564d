"""Act-order activations gathered once per (token, expert) pair, so the plain GEMMs run act-order stacks.

An act-order stack keeps w13's input columns in GPTQ's permuted order (formats/SPEC.md: the format folds w2's
permutation into w13's rows, so w2 needs none): expert ``e`` reads ``x[token, perm[e, j]]`` as its input ``j``.
The tensor-core kernels can gather those columns inside their K loop, through registers, at 1.5-1.9x the time
of the plain kernels (benchmarks/RESULTS.md, act-order rows). Here one launch writes each pair's gathered row
``xg[pair, j] = x[pair // T, perm[expert(pair), j]]`` instead; the plain w13 then reads ``xg`` one row per
pair. Cost: one [P, H] write (the permutation rows and ``x`` stay in L2), against a gather in every K step of
every weight tile of w13.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.runtime.kernels.common import await_previous_kernel, dependent_launches, expert_of

BLOCK_H = 1024  # columns per program: 16-byte stores of eight fp16/bf16 per thread at 4 warps
# Gather from the token's whole row staged in shared memory (``tl.gather``), one program per pair: every global load
# and store coalesced, where `_gather_kernel` loads each of its columns on its own (eight 2-byte loads a thread into
# a 7 KB row). Measured at Qwen2-57B act-order M = 256 (H100, same process, benchmarks/RESULTS.md 2026-12-07 13:04
# UTC): the gather launch 19.0 -> 11.4 us, the call 551.0 -> 544.6; M = 16 4.8 -> 4.3 us. The per-column kernel stays
# for the anchor's comparison (`project:act_order.GATHER_IN_SHARED=False`; KERNEL_NOTES.md item 38).
GATHER_IN_SHARED = True
SHARED_COLUMNS = 2048  # output columns a step of the shared-memory gather (a step's indices and values in registers)


@triton.jit
def _gather_kernel(x_ptr, ids_ptr, perm_ptr, out_ptr, H, num_experts, stride_x, TOP_K: tl.constexpr,
                   BLOCK_H: tl.constexpr, DEPENDENT: tl.constexpr = False):  # fmt: skip
    await_previous_kernel(DEPENDENT)
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    expert = expert_of(ids_ptr, pair, num_experts)
    src = tl.load(perm_ptr + expert * H + cols, mask=ok, other=0)
    row = tl.load(x_ptr + (pair // TOP_K).to(tl.int64) * stride_x + src, mask=ok, other=0.0)
    tl.store(out_ptr + pair.to(tl.int64) * H + cols, row, mask=ok)


@triton.jit
def _gather_shared_kernel(x_ptr, ids_ptr, perm_ptr, out_ptr, H, num_experts, stride_x, TOP_K: tl.constexpr,
                          H_POW: tl.constexpr, BLOCK_H: tl.constexpr, DEPENDENT: tl.constexpr = False):  # fmt: skip
    """Row ``pair`` of the gathered activations: the token's row loaded whole (coalesced; Triton stages it in shared
    memory for ``tl.gather``), then BLOCK_H columns a step gathered from it through the expert's permutation."""
    await_previous_kernel(DEPENDENT)
    pair = tl.program_id(0)
    expert = expert_of(ids_ptr, pair, num_experts)
    columns = tl.arange(0, H_POW)
    row = tl.load(x_ptr + (pair // TOP_K).to(tl.int64) * stride_x + columns, mask=columns < H, other=0.0)
    for start in tl.static_range(0, H_POW, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        ok = cols < H
        src = tl.load(perm_ptr + expert * H + cols, mask=ok, other=0)
        tl.store(out_ptr + pair.to(tl.int64) * H + cols, tl.gather(row, src, 0), mask=ok)


def gather_act_order(x: torch.Tensor, topk_ids: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``[P, H]``: row ``p`` is token ``p // T``'s activations in expert ``topk_ids.flat[p]``'s column order.

    ``x`` [M, H] (unit stride along H), ``topk_ids`` [M, T] contiguous, ``perm`` int32 [E, H] (the stack's
    ``w13_perm``). Ids outside [0, E) are clamped (their rows are never read: the GEMMs skip such pairs)."""
    m, h = x.shape
    top_k = topk_ids.shape[1]
    out = torch.empty(m * top_k, h, dtype=x.dtype, device=x.device)
    if not out.numel():
        return out
    if GATHER_IN_SHARED:
        h_pow = triton.next_power_of_2(h)
        _gather_shared_kernel[(m * top_k,)](x, topk_ids, perm, out, h, perm.shape[0], x.stride(0), TOP_K=top_k,
                                            H_POW=h_pow, BLOCK_H=min(h_pow, SHARED_COLUMNS), num_warps=8,
                                            **dependent_launches(x.device))  # fmt: skip
    else:
        grid = (m * top_k, triton.cdiv(h, BLOCK_H))
        _gather_kernel[grid](x, topk_ids, perm, out, h, perm.shape[0], x.stride(0), TOP_K=top_k, BLOCK_H=BLOCK_H,
                             **dependent_launches(x.device))  # fmt: skip
    return out
