"""Token-to-expert block alignment on the GPU: one Triton launch, no host synchronisation.

The tensor-core families work on blocks of BLOCK_M rows that all use one expert. This module sorts the
(token, k) pairs by expert and pads every expert's segment to a multiple of BLOCK_M with a sentinel pair
(``M * k``, masked by the GEMMs). Sizes are upper bounds known on the host (``max_blocks``), the real
block count stays in device memory (``num_blocks``), so the whole step is CUDA-graph capturable.

A single program does it in three phases separated by barriers: count pairs per expert, write each
block's expert id (and -1 for blocks past the end), scatter each pair to its expert's segment at
``offset[e] + rank``, the rank coming from a running count plus a cumulative sum inside a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass
class Alignment:
    """Where each GEMM block reads its rows from.

    ``sorted_pairs`` int32 [max_blocks * block_m]: pair index ``token * k + j`` or the sentinel ``M * k``;
    ``block_experts`` int32 [max_blocks]: the expert of each block, -1 past the end;
    ``num_blocks`` int32 [1]: blocks actually used (device memory; never read on the host).
    """

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return int(self.block_experts.shape[0])


def max_aligned_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / block_m) over every possible routing."""
    return min(triton.cdiv(num_pairs, block_m) + num_experts, num_pairs)


@triton.jit
def _align_kernel(
    ids_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_blocks_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)

    # Phase 1: pairs per expert.
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        counts += tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_blocks_ptr, total // BLOCK_M)

    # Phase 2: expert of every block (-1 past the end) and sentinel rows everywhere.
    sentinel = num_pairs
    for start in range(0, max_blocks, CHUNK):
        blocks = start + lanes
        first_row = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first_row < total, owner, -1)
        tl.store(block_experts_ptr + blocks, owner, mask=blocks < max_blocks)
    for start in range(0, max_blocks * BLOCK_M, CHUNK):
        rows = start + lanes
        tl.store(sorted_pairs_ptr + rows, tl.full([CHUNK], 0, tl.int32) + sentinel, mask=rows < max_blocks * BLOCK_M)
    tl.debug_barrier()

    # Phase 3: scatter pairs to starts[e] + (pairs of e seen before this one).
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pairs = start + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]
        slot = tl.sum(onehot * (starts[None, :] + rank), axis=1)
        # An id outside [0, E) has no segment: skip it rather than land on slot 0 over another token's pair.
        known = tl.sum(onehot, axis=1) > 0
        tl.store(sorted_pairs_ptr + slot, pairs, mask=(pairs < num_pairs) & known)
        seen += tl.sum(onehot, axis=0)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the (token, k) pairs of ``topk_ids`` [M, k] by expert into blocks of ``block_m`` rows."""
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(32, min(1024, 16384 // block_e))
    _align_kernel[(1,)](
        topk_ids.reshape(-1),
        sorted_pairs,
        block_experts,
        num_blocks,
        num_pairs,
        num_experts,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        CHUNK=chunk,
        num_warps=8,
    )
    return Alignment(sorted_pairs, block_experts, num_blocks, block_m)
