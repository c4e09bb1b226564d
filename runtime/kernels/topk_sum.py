"""The top-k sum of the tensor-core families: [M, T, H] per-pair rows -> [M, H], one launch, fp32 inside.

Why not ``torch.sum(rows.view(M, T, H), dim=1)``: torch reduces over the strided middle axis at about a third of
the copy bandwidth (benchmarks/KERNEL_NOTES.md item 17). Here each program owns BLOCK_T tokens x BLOCK_H
columns and adds the T rows of each token in order, in fp32, with 16-byte loads along H: one read of the rows,
one write of the output, and a result that does not depend on the launch (the same order every time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.runtime.kernels.common import TL_DTYPES, await_previous_kernel, dependent_launches


@triton.jit
def _topk_sum_kernel(rows_ptr, out_ptr, num_tokens, H, stride_out, stride_out_h, TOP_K: tl.constexpr,
                     OUT_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                     DEPENDENT: tl.constexpr = False):  # fmt: skip
    await_previous_kernel(DEPENDENT)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (tokens[:, None] < num_tokens) & (cols[None, :] < H)
    first = tokens.to(tl.int64)[:, None] * TOP_K * H + cols[None, :]  # row token * T of [P, H]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + first + k * H, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_out + cols[None, :] * stride_out_h
    tl.store(out_ptrs, acc.to(OUT_DTYPE), mask=mask)


def topk_sum(rows: torch.Tensor, top_k: int, out: torch.Tensor) -> torch.Tensor:
    """``out[m] = sum_j rows[m * top_k + j]`` for ``rows`` [M * top_k, H] (contiguous) into ``out`` [M, H] (any
    strides)."""
    m, h = out.shape
    block_h = min(1024, triton.next_power_of_2(h))
    block_t = max(1, 2048 // block_h)  # about 2048 outputs per program
    grid = (triton.cdiv(m, block_t), triton.cdiv(h, block_h))
    _topk_sum_kernel[grid](
        rows, out, m, h, out.stride(0), out.stride(1), TOP_K=top_k, OUT_DTYPE=TL_DTYPES[out.dtype], BLOCK_T=block_t,
        BLOCK_H=block_h, num_warps=4, **dependent_launches(out.device),
    )  # fmt: skip
    return out
