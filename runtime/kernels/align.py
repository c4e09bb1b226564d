"""Token-to-expert block alignment on the GPU: O(pairs + E) work over many programs, no host synchronisation.

The tensor-core families work on blocks of BLOCK_M rows that all use one expert. This module sorts the
(token, k) pairs by expert and pads every expert's segment to a multiple of BLOCK_M with a sentinel pair
(``M * k``, masked by the GEMMs). Sizes are upper bounds known on the host (``max_blocks``), the real
block count stays in device memory (``num_blocks``), so the whole step is CUDA-graph capturable.

Why not one program: a single program walking every pair with a one-hot [chunk, E] cumsum (the first version
of this module) took 69% of a Qwen3-30B call at M=4096 (benchmarks/KERNEL_NOTES.md item 17). Now the pairs are
cut into chunks of up to MAX_CHUNK, one program each, and the work is O(pairs + E):

1. ``_count_kernel`` (grid: chunks): the chunk's pairs per expert (``tl.histogram``), and this program's share
   of the output filled with the sentinel;
2. ``_scan_kernel`` (one program, O(chunks x E)): the counts summed, every expert's padded segment end
   (a scan over E), ``num_blocks``, and a cursor per (chunk, expert): where that chunk's pairs of that expert
   begin (a scan over chunks);
3. ``_scatter_kernel`` (grid: chunks): every pair takes the next slot of its (chunk, expert) cursor with one
   atomic (contended only inside its chunk), and each program writes the expert of its share of the blocks.

The order of the pairs inside a segment is the order the atomics land in: not fixed on a GPU, the pair order
in Triton's interpreter. No result depends on it: every GEMM row is its pair's own dot products, and the top-k
sum reads the rows back by pair index.

Up to MAX_CHUNK pairs one program (``_one_program_kernel``) does it all with the counts, segment ends and block
owners in registers: one barrier and one atomic per pair after the ids are loaded, where the three steps pass
through memory three times. Given router logits (``route_and_align``), the first launch also routes: the one
program routes every token before it counts; past MAX_CHUNK pairs each count program routes one routing step's
tokens (its chunk), as the routing kernel's own grid would. Either way routing costs no launch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from repack.formats.errors import RepackError
from repack.runtime.kernels.routing import route_outputs, route_tokens

MAX_CHUNK = 1024  # pairs one program counts and places; the chunk count (grid of steps 1 and 3) is pairs / MAX_CHUNK
SCAN_TILE = 8192  # elements of one [chunks, E] tile in the scan program


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
def _chunk_ids(ids_ptr, chunk, chunk_pairs, num_pairs, CHUNK: tl.constexpr):
    """(pair indices [CHUNK], their expert ids, -1 past the chunk) of chunk ``chunk`` of ``chunk_pairs`` pairs."""
    lanes = tl.arange(0, CHUNK)
    pairs = chunk * chunk_pairs + lanes
    return pairs, tl.load(ids_ptr + pairs, mask=(lanes < chunk_pairs) & (pairs < num_pairs), other=-1)


@triton.jit
def _count_chunk(ids_ptr, chunk, chunk_pairs, num_pairs, num_experts, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs per expert [BLOCK_E] of one chunk; ids outside [0, E) are not counted."""
    _, ids = _chunk_ids(ids_ptr, chunk, chunk_pairs, num_pairs, CHUNK)
    return tl.histogram(ids, BLOCK_E, mask=(ids >= 0) & (ids < num_experts))


@triton.jit
def _fill_sentinel(sorted_pairs_ptr, program, programs, total_rows, sentinel, FILL: tl.constexpr):
    """Program ``program`` of ``programs`` writes the sentinel into its share of ``sorted_pairs``."""
    span = tl.cdiv(tl.cdiv(total_rows, programs), FILL) * FILL
    lanes = tl.arange(0, FILL)
    end = tl.minimum(total_rows, (program + 1) * span)
    for start in range(program * span, end, FILL):
        rows = start + lanes
        tl.store(sorted_pairs_ptr + rows, tl.full([FILL], 0, tl.int32) + sentinel, mask=rows < end)


@triton.jit
def _segments(counts_ptr, cursors_ptr, ends_ptr, num_blocks_ptr, chunks, BLOCK_M: tl.constexpr,
              BLOCK_E: tl.constexpr, TILE_C: tl.constexpr):  # fmt: skip
    """From the per-chunk counts [chunks, BLOCK_E]: every expert's padded segment end (``ends``), the block
    count, and ``cursors[c, e]``, the first slot of chunk c's pairs of expert e (segment start + pairs of e in
    the chunks before c), so the scatter's atomics only meet other pairs of their own chunk and expert."""
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, TILE_C)
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, chunks, TILE_C):
        in_range = (c0 + rows)[:, None] < chunks
        tile = tl.load(counts_ptr + (c0 + rows)[:, None] * BLOCK_E + experts[None, :], mask=in_range, other=0)
        totals += tl.sum(tile, axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(ends_ptr + experts, ends)
    tl.store(num_blocks_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    running = ends - padded
    for c0 in range(0, chunks, TILE_C):
        offs = (c0 + rows)[:, None] * BLOCK_E + experts[None, :]
        in_range = (c0 + rows)[:, None] < chunks
        tile = tl.load(counts_ptr + offs, mask=in_range, other=0)
        tl.store(cursors_ptr + offs, running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=in_range)
        running += tl.sum(tile, axis=0)


@triton.jit
def _block_experts(ends_ptr, block_experts_ptr, program, programs, max_blocks, BLOCK_M: tl.constexpr,
                   BLOCK_E: tl.constexpr, TILE_B: tl.constexpr):  # fmt: skip
    """Program ``program`` of ``programs`` writes the expert of its share of the blocks: the number of segments
    that end at or before the block's first row, -1 past the last segment."""
    ends = tl.load(ends_ptr + tl.arange(0, BLOCK_E))
    total = tl.max(ends, axis=0)
    span = tl.cdiv(tl.cdiv(max_blocks, programs), TILE_B) * TILE_B
    lanes = tl.arange(0, TILE_B)
    end = tl.minimum(max_blocks, (program + 1) * span)
    for b0 in range(program * span, end, TILE_B):
        blocks = b0 + lanes
        first_row = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(first_row < total, owner, -1), mask=blocks < end)


@triton.jit
def _scatter_chunk(ids_ptr, cursors_ptr, sorted_pairs_ptr, chunk, chunk_pairs, num_pairs, num_experts,
                   BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """Place one chunk's pairs: each takes the next slot of its (chunk, expert) cursor (one atomic)."""
    pairs, ids = _chunk_ids(ids_ptr, chunk, chunk_pairs, num_pairs, CHUNK)
    placed = (ids >= 0) & (ids < num_experts)  # an id outside [0, E) has no segment: it is never placed
    slot = tl.atomic_add(cursors_ptr + chunk * BLOCK_E + ids, 1, mask=placed, sem="relaxed")
    tl.store(sorted_pairs_ptr + slot, pairs, mask=placed)


@triton.jit
def _route_chunk(logits_ptr, weights_ptr, ids_ptr, chunk, chunk_pairs, num_tokens, num_experts, stride_logits,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """Route the tokens of one chunk (``chunk_pairs // TOP_K`` of them), BLOCK_T at a time; the barrier makes
    their ids visible to this program's count and scatter."""
    chunk_tokens = chunk_pairs // TOP_K
    first = chunk * chunk_tokens
    end = tl.minimum(num_tokens, first + chunk_tokens)
    for t0 in range(first, end, BLOCK_T):
        route_tokens(logits_ptr, weights_ptr, ids_ptr, t0, end, num_experts, stride_logits, TOP_K, RENORMALIZE,
                     BLOCK_T, BLOCK_E, BLOCK_K)  # fmt: skip
    tl.debug_barrier()


@triton.jit
def _count_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, sorted_pairs_ptr, chunk_pairs, num_tokens, num_pairs,
                  num_experts, total_rows, stride_logits, ROUTE: tl.constexpr, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  CHUNK: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """Step 1 (with ROUTE, routing this chunk's tokens first): the chunk's counts, its share of the sentinel."""
    chunk = tl.program_id(0)
    if ROUTE:
        _route_chunk(logits_ptr, weights_ptr, ids_ptr, chunk, chunk_pairs, num_tokens, num_experts, stride_logits,
                     TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)  # fmt: skip
    counts = _count_chunk(ids_ptr, chunk, chunk_pairs, num_pairs, num_experts, BLOCK_E, CHUNK)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    _fill_sentinel(sorted_pairs_ptr, chunk, tl.num_programs(0), total_rows, num_pairs, FILL)


@triton.jit
def _scan_kernel(counts_ptr, cursors_ptr, ends_ptr, num_blocks_ptr, chunks, BLOCK_M: tl.constexpr,
                 BLOCK_E: tl.constexpr, TILE_C: tl.constexpr):  # fmt: skip
    _segments(counts_ptr, cursors_ptr, ends_ptr, num_blocks_ptr, chunks, BLOCK_M, BLOCK_E, TILE_C)


@triton.jit
def _scatter_kernel(ids_ptr, cursors_ptr, ends_ptr, sorted_pairs_ptr, block_experts_ptr, chunk_pairs, num_pairs,
                    num_experts, max_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                    TILE_B: tl.constexpr):  # fmt: skip
    chunk = tl.program_id(0)
    _scatter_chunk(ids_ptr, cursors_ptr, sorted_pairs_ptr, chunk, chunk_pairs, num_pairs, num_experts, BLOCK_E, CHUNK)
    _block_experts(ends_ptr, block_experts_ptr, chunk, tl.num_programs(0), max_blocks, BLOCK_M, BLOCK_E, TILE_B)


@triton.jit
def _one_program_kernel(logits_ptr, weights_ptr, ids_ptr, cursors_ptr, sorted_pairs_ptr, block_experts_ptr,
                        num_blocks_ptr, num_tokens, num_experts, total_rows, max_blocks, stride_logits,
                        ROUTE: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, PAIRS: tl.constexpr,
                        FILL: tl.constexpr, TILE_B: tl.constexpr):  # fmt: skip
    """Routing (with ROUTE) and the whole alignment in one program, for calls of up to MAX_CHUNK pairs.

    The counts, segment ends and block owners stay in registers: the only global round trips after the ids are
    one barrier (the cursors, stored as the segment starts, visible to every thread) and one atomic per pair.
    The multi-program steps would pass them through memory three times (KERNEL_NOTES item 18)."""
    num_pairs = num_tokens * TOP_K
    if ROUTE:
        for t0 in range(0, num_tokens, BLOCK_T):
            route_tokens(logits_ptr, weights_ptr, ids_ptr, t0, num_tokens, num_experts, stride_logits, TOP_K,
                         RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)  # fmt: skip
        tl.debug_barrier()  # the ids this program stored, visible to all of its threads
    pairs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    placed = (ids >= 0) & (ids < num_experts)  # an id outside [0, E) has no segment: it is never placed
    counts = tl.histogram(ids, BLOCK_E, mask=placed)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    used = tl.sum(padded, axis=0)
    tl.store(num_blocks_ptr, used // BLOCK_M)
    tl.store(cursors_ptr + tl.arange(0, BLOCK_E), starts)
    # The sentinel where no pair goes: each segment's padding (under BLOCK_M rows), then every row past the last.
    pad = (starts + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_pairs_ptr + pad, tl.full(pad.shape, 0, tl.int32) + num_pairs, mask=pad < ends[:, None])
    lanes = tl.arange(0, FILL)
    for r0 in range(used, total_rows, FILL):
        tl.store(sorted_pairs_ptr + r0 + lanes, tl.full([FILL], 0, tl.int32) + num_pairs, mask=r0 + lanes < total_rows)
    blocks = tl.arange(0, TILE_B)
    for b0 in range(0, max_blocks, TILE_B):
        first_row = (b0 + blocks) * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + b0 + blocks, tl.where(first_row < used, owner, -1), mask=b0 + blocks < max_blocks)
    tl.debug_barrier()  # every cursor stored before any thread's atomic reads it
    slot = tl.atomic_add(cursors_ptr + ids, 1, mask=placed, sem="relaxed")
    tl.store(sorted_pairs_ptr + slot, pairs, mask=placed)


def routing_token_block(num_experts: int) -> int:
    """Tokens one in-kernel routing step holds inside the alignment: about 4096 logits, up to 64 tokens."""
    return max(1, min(64, 4096 // triton.next_power_of_2(num_experts)))


def _align(ids: torch.Tensor, num_experts: int, block_m: int, routing=None) -> Alignment:
    """Launch the alignment of the [M, k] ids ``ids``; with ``routing`` = (logits [M, E], weights [M, k],
    renormalize), the first step routes the tokens into ``ids`` and ``weights`` first."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    device = ids.device
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    total_rows = max_blocks * block_m
    sorted_pairs = torch.empty(total_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    ids_flat = ids.view(-1)
    logits, weights, renormalize = routing if routing else (ids_flat, ids_flat, False)  # unread without ROUTE
    stride = logits.stride(0) if routing else 0
    route_t = routing_token_block(num_experts)
    route = dict(ROUTE=routing is not None, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e,
                 BLOCK_K=triton.next_power_of_2(top_k))  # fmt: skip
    tile_b = max(16, SCAN_TILE // block_e)  # blocks per [blocks, E] compare tile
    if num_pairs <= MAX_CHUNK:
        scratch = torch.empty(block_e + 1, dtype=torch.int32, device=device)  # cursors [BLOCK_E], num_blocks [1]
        pairs = max(16, triton.next_power_of_2(num_pairs))
        _one_program_kernel[(1,)](
            logits, weights, ids_flat, scratch, sorted_pairs, block_experts, scratch[-1:], num_tokens, num_experts,
            total_rows, max_blocks, stride, BLOCK_T=min(route_t, triton.next_power_of_2(num_tokens)),
            BLOCK_M=block_m, PAIRS=pairs, FILL=1024, TILE_B=tile_b, num_warps=8 if pairs >= 512 else 4, **route,
        )  # fmt: skip
        return Alignment(sorted_pairs, block_experts, scratch[-1:], block_m)
    # A chunk holds whole tokens when the first step routes them (their pairs are contiguous: token * k + j):
    # one routing step's tokens, so routing runs as parallel as the routing kernel's own grid.
    chunk_pairs = route_t * top_k if routing else MAX_CHUNK
    chunk = triton.next_power_of_2(chunk_pairs)
    chunks = triton.cdiv(num_pairs, chunk_pairs)
    # One int32 scratch: per-chunk counts and cursors [chunks, BLOCK_E] each, segment ends [BLOCK_E], num_blocks [1].
    scratch = torch.empty(2 * chunks * block_e + block_e + 1, dtype=torch.int32, device=device)
    counts, cursors = scratch[: chunks * block_e], scratch[chunks * block_e : 2 * chunks * block_e]
    ends, num_blocks = scratch[2 * chunks * block_e : -1], scratch[-1:]
    _count_kernel[(chunks,)](
        logits, weights, ids_flat, counts, sorted_pairs, chunk_pairs, num_tokens, num_pairs, num_experts, total_rows,
        stride, BLOCK_T=route_t, CHUNK=chunk, FILL=1024, num_warps=8 if routing else 4, **route,
    )  # fmt: skip
    tile_c = max(1, min(triton.next_power_of_2(chunks), SCAN_TILE // block_e))
    _scan_kernel[(1,)](
        counts, cursors, ends, num_blocks, chunks, BLOCK_M=block_m, BLOCK_E=block_e, TILE_C=tile_c, num_warps=8
    )  # fmt: skip
    _scatter_kernel[(chunks,)](
        ids_flat, cursors, ends, sorted_pairs, block_experts, chunk_pairs, num_pairs, num_experts, max_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, TILE_B=tile_b, num_warps=4,
    )  # fmt: skip
    return Alignment(sorted_pairs, block_experts, num_blocks, block_m)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the (token, k) pairs of ``topk_ids`` [M, k] by expert into blocks of ``block_m`` rows."""
    return _align(topk_ids.contiguous(), num_experts, block_m)


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """:func:`routing.route` and :func:`align_pairs` in the launches of the alignment alone (one up to
    MAX_CHUNK pairs): the first step routes its chunk's tokens, then counts their pairs.

    Returns ``(topk_weights fp32 [M, k], topk_ids int32 [M, k], alignment)``, the first two as ``route`` gives them.
    """
    router_logits, weights, ids = route_outputs(router_logits, top_k)
    num_experts = router_logits.shape[1]
    if top_k > MAX_CHUNK:
        raise RepackError(f"route_and_align: top_k={top_k} is more than one chunk of {MAX_CHUNK} pairs")
    return weights, ids, _align(ids, num_experts, block_m, routing=(router_logits, weights.view(-1), renormalize))
