"""Slices of K that meet in fp32 sums, for the decode families (kernels/decode.py on CUDA cores, kernels/decode_mma.py
on tensor cores): a few (token, expert) pairs leave most of the GPU idle, so each pair's GEMV is cut into slices of
K, every slice a program, adding its partial sums into a zeroed fp32 row; the last program to arrive (an int32
count beside the row) reads the totals and finishes the row (SiLU in w13, the output in w2). The scratch all this
needs is one allocation the decode's prepare launch zeroes (:class:`DecodeScratch`), so no memset runs.

Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def k_slices(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(blocks per slice, slices) for splitting ``k`` into at most ``split_k`` slices of whole BLOCK_K blocks,
    none of them empty (the kernels' :func:`k_range`)."""
    blocks = triton.cdiv(k, block_k)
    per_slice = triton.cdiv(blocks, max(1, split_k))
    return per_slice, triton.cdiv(blocks, per_slice)


@triton.jit
def k_range(K, blocks_per_split, BLOCK_K: tl.constexpr):
    """(first K, end K, last block's K) of this program's slice of K: split ``program_id(2)`` of the
    ``blocks_per_split``-block slices (one slice, all of K, without split-K). The host sizes the split so
    none is empty (:func:`k_slices`)."""
    k_begin = tl.program_id(2) * blocks_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + blocks_per_split * BLOCK_K)
    return k_begin, k_end, (k_end - 1) // BLOCK_K * BLOCK_K


@triton.jit
def add_and_arrive(row_ptrs, values, mask, counter_ptr, expected):
    """Add ``values`` into fp32 ``row_ptrs`` and count this program in; True for the last of ``expected``.

    The barrier orders every thread's adds before the count, whose acq_rel atomic publishes them (and, in the
    last program, makes every other program's adds visible to the reads that follow)."""
    tl.atomic_add(row_ptrs, values, mask=mask, sem="relaxed")
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel") == expected - 1


@triton.jit
def total(row_ptrs, mask):
    """What every program added into ``row_ptrs``, read by an atomic (L2's value, never a stale L1 line)."""
    zeros = tl.where(mask, 0.0, 0.0)  # shaped (and, in Gluon, laid out) as the mask
    return tl.atomic_add(row_ptrs, zeros, mask=mask, sem="acquire")


@triton.jit
def gate_up_rows(sums_ptr, pair, offs_n, BLOCK_N: tl.constexpr):
    """Where w13's program (pair, channel tile program_id(1)) adds its gate and up partial sums: rows of
    ``[pair, gate/up, tiles x BLOCK_N]``, whole channel tiles a row, as :class:`DecodeScratch` lays them out."""
    n_pad = tl.num_programs(1) * BLOCK_N
    gate = sums_ptr + pair.to(tl.int64) * 2 * n_pad + offs_n
    return gate, gate + n_pad


@triton.jit
def totals(gate_ptrs, up_ptrs, mask):
    """:func:`total` of two rows (w13's gate and up), both read unmasked: a masked atomic is a branch of its own,
    and ptxas scheduled the first total's use before the second atomic, two L2 round trips where one does
    (KERNEL_NOTES.md item 41). The rows hold whole channel tiles (:class:`DecodeScratch`), so every lane's address
    is the scratch's; the lanes past N read zeros nobody adds to."""
    zeros = tl.where(mask, 0.0, 0.0)  # shaped (and, in Gluon, laid out) as the mask
    return tl.atomic_add(gate_ptrs, zeros, sem="acquire"), tl.atomic_add(up_ptrs, zeros, sem="acquire")


class DecodeScratch:
    """The fp32/int32 buffers one decode call needs, carved from one allocation the prepare launch zeroes.

    ``inter`` (w2's input, ``inter_dtype``: the CUDA-core decode's prepared fp32, the tensor-core decode's
    activation dtype) is inside the zeroed region only when I is not a multiple of BLOCK_K: its padding must read
    as 0, everything else in it is written by w13. w13's sums are ``[pair, gate/up, tiles13 x block_n]``: rows of
    whole channel tiles, so the last arriver reads its totals unmasked (:func:`totals`)."""

    def __init__(
        self,
        m: int,
        pairs: int,
        h: int,
        i: int,
        block_k: int,
        tiles13: int,
        tiles2: int,
        block_n: int,  # w13's channels a program (its tiles13 tiles cover I)
        split13: bool,
        reduce2: bool,
        device,
        inter_dtype: torch.dtype = torch.float32,
    ) -> None:
        i_pad = triton.cdiv(i, block_k) * block_k
        inter_bytes = pairs * i_pad * torch.empty((), dtype=inter_dtype).element_size()
        sizes = {  # int32 words
            "out_sums": m * h if reduce2 else 1,
            "out_arrivals": m * tiles2 if reduce2 else 1,
            "gate_up_sums": pairs * 2 * tiles13 * block_n if split13 else 1,
            "gate_up_arrivals": pairs * tiles13 if split13 else 1,
            "inter": triton.cdiv(inter_bytes, 4),
        }
        zeroed = list(sizes) if i_pad != i else list(sizes)[:-1]
        self.zeroed_len = sum(sizes[name] for name in zeroed)
        self.buffer = torch.empty(sum(sizes.values()), dtype=torch.int32, device=device)
        self.i_pad = i_pad
        start = 0
        self.views: dict[str, torch.Tensor] = {}
        for name, size in sizes.items():
            self.views[name] = self.buffer[start : start + size]
            start += size
        for name in ("out_sums", "gate_up_sums"):
            self.views[name] = self.views[name].view(torch.float32)
        self.views["inter"] = self.views["inter"].view(inter_dtype)[: pairs * i_pad].view(pairs, i_pad)
