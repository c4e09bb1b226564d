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
owners in registers: one barrier and one atomic per pair after the ids are loaded. Given router logits
(``route_and_align``) and at most one routing step of tokens (routing.token_block, 16 at up to 256 experts), that
program routes them first: no launch of its own for the routing. More tokens are routed by the routing kernel:
one program routing them serially, or count programs routing their own chunks, measured slower than the
routing kernel's own grid (benchmarks/KERNEL_NOTES.md item 18).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from repack.runtime.kernels.routing import route, route_outputs, route_tokens, token_block

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
def _chunk_ids(ids_ptr, chunk, num_pairs, CHUNK: tl.constexpr):
    """(pair indices [CHUNK], their expert ids, -1 past the pairs) of chunk ``chunk``."""
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    return pairs, tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)


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
def _block_owners(ends, block_experts_ptr, first_block, end_block, BLOCK_M: tl.constexpr, TILE_B: tl.constexpr):
    """Blocks ``first_block .. end_block``: each one's expert, the number of segments (``ends`` [BLOCK_E]) that end
    at or before its first row, -1 past the last segment."""
    total = tl.max(ends, axis=0)
    lanes = tl.arange(0, TILE_B)
    for b0 in range(first_block, end_block, TILE_B):
        blocks = b0 + lanes
        first_row = blocks * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(first_row < total, owner, -1), mask=blocks < end_block)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_pairs_ptr, num_pairs, num_experts, total_rows, BLOCK_E: tl.constexpr,
                  CHUNK: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """Step 1: the chunk's pairs per expert (ids outside [0, E) are not counted), its share of the sentinel."""
    chunk = tl.program_id(0)
    _, ids = _chunk_ids(ids_ptr, chunk, num_pairs, CHUNK)
    counts = tl.histogram(ids, BLOCK_E, mask=(ids >= 0) & (ids < num_experts))
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    _fill_sentinel(sorted_pairs_ptr, chunk, tl.num_programs(0), total_rows, num_pairs, FILL)


@triton.jit
def _scan_kernel(counts_ptr, cursors_ptr, ends_ptr, num_blocks_ptr, chunks, BLOCK_M: tl.constexpr,
                 BLOCK_E: tl.constexpr, TILE_C: tl.constexpr):  # fmt: skip
    _segments(counts_ptr, cursors_ptr, ends_ptr, num_blocks_ptr, chunks, BLOCK_M, BLOCK_E, TILE_C)


@triton.jit
def _scatter_kernel(ids_ptr, cursors_ptr, ends_ptr, sorted_pairs_ptr, block_experts_ptr, num_pairs, num_experts,
                    max_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                    TILE_B: tl.constexpr):  # fmt: skip
    """Step 3: every pair of the chunk takes the next slot of its (chunk, expert) cursor (one atomic), and the
    program writes the expert of its share of the blocks."""
    chunk = tl.program_id(0)
    pairs, ids = _chunk_ids(ids_ptr, chunk, num_pairs, CHUNK)
    placed = (ids >= 0) & (ids < num_experts)  # an id outside [0, E) has no segment: it is never placed
    slot = tl.atomic_add(cursors_ptr + chunk * BLOCK_E + ids, 1, mask=placed, sem="relaxed")
    tl.store(sorted_pairs_ptr + slot, pairs, mask=placed)
    span = tl.cdiv(tl.cdiv(max_blocks, tl.num_programs(0)), TILE_B) * TILE_B
    ends = tl.load(ends_ptr + tl.arange(0, BLOCK_E))
    _block_owners(ends, block_experts_ptr, chunk * span, tl.minimum(max_blocks, (chunk + 1) * span), BLOCK_M, TILE_B)


@triton.jit
def _one_program_kernel(logits_ptr, weights_ptr, ids_ptr, cursors_ptr, sorted_pairs_ptr, block_experts_ptr,
                        num_blocks_ptr, num_tokens, num_experts, total_rows, max_blocks, stride_logits,
                        ROUTE: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, PAIRS: tl.constexpr, FILL: tl.constexpr,
                        TILE_B: tl.constexpr):  # fmt: skip
    """Routing (with ROUTE: the BLOCK_T tokens of one routing step at most) and the whole alignment in one
    program, for calls of up to MAX_CHUNK pairs.

    The counts, segment ends and block owners stay in registers: the only global round trips after the ids are
    one barrier (the cursors, stored as the segment starts, visible to every thread) and one atomic per pair,
    where the three steps pass them through memory three times."""
    num_pairs = num_tokens * TOP_K
    if ROUTE:
        route_tokens(logits_ptr, weights_ptr, ids_ptr, 0, num_tokens, num_experts, stride_logits, TOP_K, RENORMALIZE,
                     BLOCK_T, BLOCK_E)  # fmt: skip
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
    _block_owners(ends, block_experts_ptr, 0, max_blocks, BLOCK_M, TILE_B)
    tl.debug_barrier()  # every cursor stored before any thread's atomic reads it
    slot = tl.atomic_add(cursors_ptr + ids, 1, mask=placed, sem="relaxed")
    tl.store(sorted_pairs_ptr + slot, pairs, mask=placed)


def _align(ids: torch.Tensor, num_experts: int, block_m: int, routing=None) -> Alignment:
    """Launch the alignment of the [M, k] ids ``ids``; with ``routing`` = (logits [M, E], weights [M, k],
    renormalize), the one program routes the tokens into ``ids`` and ``weights`` first (at most one routing step
    of tokens: :func:`route_and_align` decides)."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    device = ids.device
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    total_rows = max_blocks * block_m
    sorted_pairs = torch.empty(total_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    ids_flat = ids.view(-1)
    tile_b = max(16, SCAN_TILE // block_e)  # blocks per [blocks, E] compare tile
    if num_pairs <= MAX_CHUNK:
        logits, weights, renormalize = routing if routing else (ids_flat, ids_flat, False)  # unread without ROUTE
        scratch = torch.empty(block_e + 1, dtype=torch.int32, device=device)  # cursors [BLOCK_E], num_blocks [1]
        pairs = max(16, triton.next_power_of_2(num_pairs))
        _one_program_kernel[(1,)](
            logits, weights, ids_flat, scratch, sorted_pairs, block_experts, scratch[-1:], num_tokens, num_experts,
            total_rows, max_blocks, logits.stride(0) if routing else 0, ROUTE=routing is not None, TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_T=token_block(num_experts), BLOCK_M=block_m, BLOCK_E=block_e,
            PAIRS=pairs, FILL=1024, TILE_B=tile_b, num_warps=8 if pairs >= 512 else 4,
        )  # fmt: skip
        return Alignment(sorted_pairs, block_experts, scratch[-1:], block_m)
    if routing is not None:
        raise ValueError(f"align: routing inside the alignment takes at most {MAX_CHUNK} pairs, not {num_pairs}")
    chunks = triton.cdiv(num_pairs, MAX_CHUNK)
    # One int32 scratch: per-chunk counts and cursors [chunks, BLOCK_E] each, segment ends [BLOCK_E], num_blocks [1].
    scratch = torch.empty(2 * chunks * block_e + block_e + 1, dtype=torch.int32, device=device)
    counts, cursors = scratch[: chunks * block_e], scratch[chunks * block_e : 2 * chunks * block_e]
    ends, num_blocks = scratch[2 * chunks * block_e : -1], scratch[-1:]
    sizes = dict(BLOCK_E=block_e, CHUNK=MAX_CHUNK)
    _count_kernel[(chunks,)](ids_flat, counts, sorted_pairs, num_pairs, num_experts, total_rows, FILL=1024, **sizes)
    tile_c = max(1, min(triton.next_power_of_2(chunks), SCAN_TILE // block_e))
    # Four warps: eight measured 1.9x slower at 32 chunks (5.5 against 2.9 us, KERNEL_NOTES item 18).
    _scan_kernel[(1,)](counts, cursors, ends, num_blocks, chunks, BLOCK_M=block_m, BLOCK_E=block_e, TILE_C=tile_c)
    _scatter_kernel[(chunks,)](
        ids_flat, cursors, ends, sorted_pairs, block_experts, num_pairs, num_experts, max_blocks, BLOCK_M=block_m,
        TILE_B=tile_b, **sizes,
    )  # fmt: skip
    return Alignment(sorted_pairs, block_experts, num_blocks, block_m)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the (token, k) pairs of ``topk_ids`` [M, k] by expert into blocks of ``block_m`` rows."""
    return _align(topk_ids.contiguous(), num_experts, block_m)


def routes_in_alignment(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether :func:`route_and_align` routes inside the alignment's one program: at most one routing step of
    tokens (routing.token_block) and one program's pairs. Routing more tokens there measured slower than the
    routing kernel's grid (KERNEL_NOTES item 18)."""
    return num_tokens <= token_block(num_experts) and num_tokens * top_k <= MAX_CHUNK


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """:func:`routing.route` then :func:`align_pairs`, in one launch where :func:`routes_in_alignment`.

    Returns ``(topk_weights fp32 [M, k], topk_ids int32 [M, k], alignment)``, the first two as ``route`` gives them.
    """
    router_logits, weights, ids = route_outputs(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    if not routes_in_alignment(num_tokens, top_k, num_experts):
        weights, ids = route(router_logits, top_k, renormalize)
        return weights, ids, align_pairs(ids, num_experts, block_m)
    return weights, ids, _align(ids, num_experts, block_m, routing=(router_logits, weights.view(-1), renormalize))
