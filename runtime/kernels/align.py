"""Token-to-expert block alignment on the GPU: O(pairs + E) work over many programs, no host synchronisation.

The tensor-core families work on blocks of BLOCK_M rows that all use one expert. This module sorts the
(token, k) pairs by expert and pads every expert's segment to a multiple of BLOCK_M with a sentinel pair
(``M * k``, masked by the GEMMs). Sizes are upper bounds known on the host (``max_blocks``), the real
block count stays in device memory (``num_blocks``), so the whole step is CUDA-graph capturable.

Why not one program for everything: a single program walking every pair with a one-hot [chunk, E] cumsum (the
first version of this module) took 69% of a Qwen3-30B call at M=4096 (benchmarks/KERNEL_NOTES.md item 17). Past
one program's pairs the work is cut into chunks, one program each, O(pairs + E) in all:

1. ``_count_kernel`` (grid: chunks): given router logits, it routes its chunk's tokens first (one routing step:
   no launch of its own for the routing, while the chunks' counts fit the scatter's one tile; past that the
   routing kernel's grid routes, and a chunk is MAX_CHUNK pairs); then the chunk's pairs per expert
   (``tl.histogram``) and this program's share of the output filled with the sentinel;
2. ``_scatter_kernel`` (grid: chunks): the cursor of every (chunk, expert), where that chunk's pairs of that
   expert begin (the expert's padded segment start, a scan over E, plus its pairs in the chunks before: each
   program scans the [chunks, E] counts itself while they fit one tile, else ``_scan_kernel`` does it once in a
   launch between the two); then every pair takes the next slot of its cursor with one atomic (contended only
   inside its chunk), and the pair that lands on a block's first row writes that block's expert.

The order of the pairs inside a segment is the order the atomics land in: not fixed on a GPU, the pair order
in Triton's interpreter (and everywhere where the last count program places, below). No result depends on it:
every GEMM row is its pair's own dot products, and the top-k sum reads the rows back by pair index.

Up to LAST_COUNT_PLACES_MAX_PAIRS pairs in all, the count programs take a ticket when done
(one atomic each) and the last to take one places every pair: no scatter launch. It sorts the ids by (expert, pair)
in registers and puts each pair at its sorted position plus the padding before its expert's segment, so no cursor
round trip either, and the order inside a segment is the pair order. The ticket is one counter per device that the
last program sets back to zero.

Up to MAX_CHUNK pairs one program (``_one_program_kernel``) does it all with the counts and segment starts in
registers: one barrier and one atomic per pair after the ids are known; given router logits it routes the tokens
first, all of them in one step, for calls of up to ONE_PROGRAM_TOKENS tokens and ONE_PROGRAM_LOGITS logits (16
tokens at 128 experts: one launch in all; measured on the H200 in benchmarks/KERNEL_NOTES.md item 19).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from repack.runtime.kernels.common import await_previous_kernel, dependent_launches
from repack.runtime.kernels.routing import (
    route_into,
    route_outputs,
    route_tokens,
    route_warps,
    rows_aligned,
    token_block,
)

MAX_CHUNK = 1024  # pairs one program places (the one-program path), and an unrouted chunk's pairs
SCAN_TILE = 8192  # elements of one [chunks, E] tile of counts: a scatter program scans them itself up to this
# The one program routes when the call has at most this many tokens and logits (four warps). Measured on the H200
# (benchmarks/KERNEL_NOTES.md item 19): 64 tokens at 128 experts on 16 warps took 11.5 us where the count and
# scatter launches took 6.6, and Mixtral's 256 tokens of 8 experts 8.2 us in the one program.
ONE_PROGRAM_TOKENS = 64
ONE_PROGRAM_LOGITS = 2048
SCAN_IN_SCATTER = True  # the scatter programs scan the counts themselves where they fit one tile (no scan launch)
# Routed count programs take half a routing step of tokens while that makes at most this many chunks: twice the
# programs, each half as long on the critical path, and the scatter still scans a small tile (H200, KERNEL_NOTES.md
# item 22: Qwen3-30B M = 64 count 3.4 -> 2.7 us, M = 256 3.5 -> 2.7; at 128 chunks the scan cost more than it saved).
HALF_STEP_MAX_CHUNKS = 32
# The last count program places every pair (no scatter launch) up to this many pairs, whatever the expert count: its
# sort of the (expert, pair) keys grows with the pairs. H100, glue alone (KERNEL_NOTES.md item 29): DeepSeek-V3 M = 16
# (128 pairs) 5.5 against 6.5 us with the scatter launch; at 256-1024 pairs it lost everywhere (Qwen1.5-MoE M = 64
# 6.5 against 6.4, M = 256 12.2 against 6.6; Qwen2-57B M = 64 6.4 against 5.7; 512 pairs of 128-256 experts 6.9-7.2
# against 6.4-6.7). Cells of up to 128 pairs elsewhere take the one-program path before this one.
LAST_COUNT_PLACES_MAX_PAIRS = 128


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
def _chunk_ids(ids_ptr, first_pair, end_pair, PAIRS: tl.constexpr):
    """(pair indices [PAIRS] from ``first_pair``, their expert ids, -1 from ``end_pair`` on)."""
    pairs = first_pair + tl.arange(0, PAIRS)
    return pairs, tl.load(ids_ptr + pairs, mask=pairs < end_pair, other=-1)


@triton.jit
def _cursors(counts_ptr, chunk, chunks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, TILE_C: tl.constexpr):
    """(the first slot of chunk ``chunk``'s pairs of every expert, the rows used) from the [chunks <= TILE_C, E]
    counts."""
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, TILE_C)[:, None]
    tile = tl.load(counts_ptr + rows * BLOCK_E + experts[None, :], mask=rows < chunks, other=0)
    starts, used = _segment_starts(tl.sum(tile, axis=0), BLOCK_M)
    return starts + tl.sum(tl.where(rows < chunk, tile, 0), axis=0), used


@triton.jit
def _fill(ptr, start, end, value, FILL: tl.constexpr):
    """``ptr[start:end] = value``."""
    lanes = tl.arange(0, FILL)
    for r0 in range(start, end, FILL):
        tl.store(ptr + r0 + lanes, tl.full([FILL], 0, tl.int32) + value, mask=r0 + lanes < end)


@triton.jit
def _counts(ids, placed, BLOCK_E: tl.constexpr):
    """Pairs per expert of ``ids`` (any shape) where ``placed``."""
    return tl.histogram(tl.reshape(ids, [ids.numel]), BLOCK_E, mask=tl.reshape(placed, [placed.numel]))


@triton.jit
def _segment_starts(totals, BLOCK_M: tl.constexpr):
    """(every expert's first row, the rows used): segments of ``totals`` pairs padded to whole blocks."""
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, tl.sum(padded, axis=0)


@triton.jit
def _place(pairs, ids, placed, cursors_ptr, sorted_pairs_ptr, block_experts_ptr, BLOCK_M: tl.constexpr):
    """Every placed pair takes the next slot of its expert's cursor; the one on a block's first row writes the
    block's expert. Each used block's first row holds a pair (segments start on block boundaries and are padded
    at their end), so this writes every used block's owner once and no [blocks, E] search is needed."""
    slot = tl.atomic_add(cursors_ptr + ids, 1, mask=placed, sem="relaxed")
    tl.store(sorted_pairs_ptr + slot, pairs, mask=placed)
    tl.store(block_experts_ptr + slot // BLOCK_M, ids, mask=placed & (slot % BLOCK_M == 0))


@triton.jit
def _place_in_order(ids_ptr, num_pairs, num_experts, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr, max_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, ALL_PAIRS: tl.constexpr,
                    FILL: tl.constexpr):  # fmt: skip
    """Every pair placed by this one program from the ids alone, in pair order inside each expert and without an
    atomic: the ids sorted by (expert, pair), and the pair at sorted position j lands at j plus the padding of the
    segments before its expert's. Reads the ids past L1 (``.cg``): other programs stored them."""
    pairs = tl.arange(0, ALL_PAIRS)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1, cache_modifier=".cg")
    placed = (ids >= 0) & (ids < num_experts)  # an id outside [0, E) has no segment: it is never placed
    totals = _counts(ids, placed, BLOCK_E)
    starts, used = _segment_starts(totals, BLOCK_M)
    padding_before = starts - (tl.cumsum(totals, axis=0) - totals)
    keys = tl.sort(tl.where(placed, ids, BLOCK_E) * ALL_PAIRS + pairs)  # the unplaced last
    experts = keys // ALL_PAIRS
    real = experts < BLOCK_E
    slots = pairs + tl.gather(padding_before, tl.minimum(experts, BLOCK_E - 1), 0)
    tl.store(sorted_pairs_ptr + slots, keys % ALL_PAIRS, mask=real)
    tl.store(block_experts_ptr + slots // BLOCK_M, experts, mask=real & (slots % BLOCK_M == 0))
    tl.store(num_blocks_ptr, used // BLOCK_M)
    _fill(block_experts_ptr, used // BLOCK_M, max_blocks, -1, FILL)


@triton.jit
def _count_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, sorted_pairs_ptr, num_tokens, num_experts,
                  total_rows, stride_logits, ticket_ptr, block_experts_ptr, num_blocks_ptr, max_blocks,
                  ROUTE: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr, FILL: tl.constexpr,
                  PLACE: tl.constexpr, BLOCK_M: tl.constexpr, ALL_PAIRS: tl.constexpr,
                  DEPENDENT: tl.constexpr = False):  # fmt: skip
    """Step 1: with ROUTE, this chunk's BLOCK_T tokens routed (CHUNK = BLOCK_T * TOP_K pairs); the chunk's pairs
    per expert (ids outside [0, E) are not counted); its share of the sentinel. With PLACE, then a ticket: the
    program that takes the last one places every pair (:func:`_place_in_order`), and no counts are stored."""
    await_previous_kernel(DEPENDENT)
    chunk = tl.program_id(0)
    chunks = tl.num_programs(0)
    num_pairs = num_tokens * TOP_K
    if ROUTE:
        _, ids, placed = route_tokens(logits_ptr, weights_ptr, ids_ptr, chunk * BLOCK_T, num_tokens, num_experts,
                                      stride_logits, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E)  # fmt: skip
    else:
        _, ids = _chunk_ids(ids_ptr, chunk * CHUNK, tl.minimum(num_pairs, (chunk + 1) * CHUNK), PAIRS)
        placed = (ids >= 0) & (ids < num_experts)
    if not PLACE:  # the placing program counts every pair itself
        tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), _counts(ids, placed, BLOCK_E))
    span = tl.cdiv(tl.cdiv(total_rows, chunks), FILL) * FILL
    _fill(sorted_pairs_ptr, chunk * span, tl.minimum(total_rows, (chunk + 1) * span), num_pairs, FILL)
    if PLACE:
        tl.debug_barrier()  # every thread's ids and sentinel stored before the ticket releases them
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == chunks - 1:
            tl.store(ticket_ptr, 0)  # every program has taken its ticket: ready for the next call
            _place_in_order(ids_ptr, num_pairs, num_experts, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
                            max_blocks, BLOCK_M, BLOCK_E, ALL_PAIRS, FILL)  # fmt: skip


@triton.jit
def _scan_kernel(counts_ptr, cursors_ptr, block_experts_ptr, num_blocks_ptr, chunks, max_blocks,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, TILE_C: tl.constexpr, FILL: tl.constexpr,
                 DEPENDENT: tl.constexpr = False):  # fmt: skip
    """Step 1.5, where the [chunks, E] counts exceed one tile: ``cursors[c, e]``, the first slot of chunk c's
    pairs of expert e (segment start + pairs of e in the chunks before c); the block count; -1 for the expert of
    every block past it."""
    await_previous_kernel(DEPENDENT)
    experts = tl.arange(0, BLOCK_E)
    rows = tl.arange(0, TILE_C)
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, chunks, TILE_C):
        in_range = (c0 + rows)[:, None] < chunks
        tile = tl.load(counts_ptr + (c0 + rows)[:, None] * BLOCK_E + experts[None, :], mask=in_range, other=0)
        totals += tl.sum(tile, axis=0)
    running, used = _segment_starts(totals, BLOCK_M)
    for c0 in range(0, chunks, TILE_C):
        offs = (c0 + rows)[:, None] * BLOCK_E + experts[None, :]
        in_range = (c0 + rows)[:, None] < chunks
        tile = tl.load(counts_ptr + offs, mask=in_range, other=0)
        tl.store(cursors_ptr + offs, running[None, :] + tl.cumsum(tile, axis=0) - tile, mask=in_range)
        running += tl.sum(tile, axis=0)
    tl.store(num_blocks_ptr, used // BLOCK_M)
    _fill(block_experts_ptr, used // BLOCK_M, max_blocks, -1, FILL)


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, cursors_ptr, sorted_pairs_ptr, block_experts_ptr, num_blocks_ptr,
                    num_pairs, num_experts, max_blocks, chunks, SCAN: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PAIRS: tl.constexpr, TILE_C: tl.constexpr,
                    FILL: tl.constexpr, DEPENDENT: tl.constexpr = False):  # fmt: skip
    """Step 2: with SCAN, this chunk's cursors from the [chunks (<= TILE_C), E] counts (and, in program 0, the
    block count and the -1 owners past it); then every pair of the chunk placed (:func:`_place`)."""
    await_previous_kernel(DEPENDENT)
    chunk = tl.program_id(0)
    cursors_ptr += chunk * BLOCK_E
    if SCAN:
        starts, used = _cursors(counts_ptr, chunk, chunks, BLOCK_M, BLOCK_E, TILE_C)
        tl.store(cursors_ptr + tl.arange(0, BLOCK_E), starts)
        if chunk == 0:
            tl.store(num_blocks_ptr, used // BLOCK_M)
            _fill(block_experts_ptr, used // BLOCK_M, max_blocks, -1, FILL)
        tl.debug_barrier()  # the cursors stored before any thread's atomic reads them
    pairs, ids = _chunk_ids(ids_ptr, chunk * CHUNK, tl.minimum(num_pairs, (chunk + 1) * CHUNK), PAIRS)
    placed = (ids >= 0) & (ids < num_experts)  # an id outside [0, E) has no segment: it is never placed
    _place(pairs, ids, placed, cursors_ptr, sorted_pairs_ptr, block_experts_ptr, BLOCK_M)


@triton.jit
def _one_program_kernel(logits_ptr, weights_ptr, ids_ptr, cursors_ptr, sorted_pairs_ptr, block_experts_ptr,
                        num_blocks_ptr, num_tokens, num_experts, total_rows, max_blocks, stride_logits,
                        ROUTE: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, PAIRS: tl.constexpr,
                        FILL: tl.constexpr, DEPENDENT: tl.constexpr = False):  # fmt: skip
    """Routing (with ROUTE: all BLOCK_T tokens in one step) and the whole alignment in one program, for calls of
    up to MAX_CHUNK pairs.

    The counts and segment starts stay in registers: the only global round trips after the ids are one barrier
    (the cursors, stored as the segment starts, and the sentinel fill, visible to every thread) and one atomic
    per pair."""
    await_previous_kernel(DEPENDENT)
    num_pairs = num_tokens * TOP_K
    if ROUTE:
        pairs, ids, placed = route_tokens(logits_ptr, weights_ptr, ids_ptr, 0, num_tokens, num_experts,
                                          stride_logits, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E)  # fmt: skip
    else:
        pairs, ids = _chunk_ids(ids_ptr, 0, num_pairs, PAIRS)
        placed = (ids >= 0) & (ids < num_experts)  # an id outside [0, E) has no segment: it is never placed
    starts, used = _segment_starts(_counts(ids, placed, BLOCK_E), BLOCK_M)
    tl.store(num_blocks_ptr, used // BLOCK_M)
    tl.store(cursors_ptr + tl.arange(0, BLOCK_E), starts)
    _fill(sorted_pairs_ptr, 0, total_rows, num_pairs, FILL)  # the pairs overwrite their rows after the barrier
    _fill(block_experts_ptr, used // BLOCK_M, max_blocks, -1, FILL)
    tl.debug_barrier()  # every cursor and sentinel stored before any thread's atomic or pair store
    _place(pairs, ids, placed, cursors_ptr, sorted_pairs_ptr, block_experts_ptr, BLOCK_M)


def one_program_tokens(num_experts: int, top_k: int) -> int:
    """The most tokens the one program routes and aligns (ONE_PROGRAM_TOKENS, ONE_PROGRAM_LOGITS, MAX_CHUNK)."""
    return min(ONE_PROGRAM_TOKENS, ONE_PROGRAM_LOGITS // triton.next_power_of_2(num_experts), MAX_CHUNK // top_k)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _ticket(device: torch.device) -> torch.Tensor:
    """The count programs' ticket counter of ``device`` (int32, zero between calls). One per device: MoE calls on a
    device run one after another, as vLLM, transformers and the benchmarks make them (a graph replays on one
    stream). Made by the device's first such call: vLLM, the tests and the benchmarks run one before capturing."""
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _TICKETS[device]


def _align(ids: torch.Tensor, num_experts: int, block_m: int, routing=None) -> Alignment:
    """Launch the alignment of the [M, k] ids ``ids``; with ``routing`` = (logits [M, E], weights [M, k],
    renormalize), the first launch routes the tokens into ``ids`` and ``weights`` first."""
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
    stride_logits = logits.stride(0) if routing else 0
    aligned = rows_aligned(logits) if routing else True
    route = dict(ROUTE=routing is not None, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e)
    dependent = dependent_launches(device)
    if num_pairs <= MAX_CHUNK and (routing is None or num_tokens <= one_program_tokens(num_experts, top_k)):
        block_t = triton.next_power_of_2(num_tokens)
        # Warps: routing.route_warps; without routing 8 from 512 pairs on (measured faster there).
        warps = route_warps(block_t * block_e, aligned) if routing else (8 if num_pairs >= 512 else 4)
        scratch = torch.empty(block_e + 1, dtype=torch.int32, device=device)  # cursors [BLOCK_E], num_blocks [1]
        _one_program_kernel[(1,)](
            logits, weights, ids_flat, scratch, sorted_pairs, block_experts, scratch[-1:], num_tokens, num_experts,
            total_rows, max_blocks, stride_logits, BLOCK_T=block_t, BLOCK_M=block_m,
            PAIRS=max(16, triton.next_power_of_2(num_pairs)), FILL=1024, num_warps=warps, **route, **dependent,
        )  # fmt: skip
        return Alignment(sorted_pairs, block_experts, scratch[-1:], block_m)
    if routing is not None and triton.cdiv(num_tokens, token_block(num_experts)) * block_e > SCAN_TILE:
        # More routing steps than the scatter programs scan in one tile: the routing kernel's grid, then chunks of
        # MAX_CHUNK pairs (one routing step per chunk made the scan launch 12-32 us at M=4096: KERNEL_NOTES 19).
        route_into(logits, weights, ids_flat, top_k, renormalize)
        routing, route["ROUTE"] = None, False
    if routing is not None:
        block_t = token_block(num_experts)  # one routing step per chunk, or half of one (HALF_STEP_MAX_CHUNKS)
        if block_t > 1 and triton.cdiv(num_tokens, block_t // 2) <= HALF_STEP_MAX_CHUNKS:
            block_t //= 2
        chunk_pairs, chunks = block_t * top_k, triton.cdiv(num_tokens, block_t)
    else:
        block_t, chunk_pairs, chunks = 1, MAX_CHUNK, triton.cdiv(num_pairs, MAX_CHUNK)
    # One int32 scratch: per-chunk counts and cursors [chunks, BLOCK_E] each, num_blocks [1].
    scratch = torch.empty(2 * chunks * block_e + 1, dtype=torch.int32, device=device)
    counts, cursors, num_blocks = scratch[: chunks * block_e], scratch[chunks * block_e : -1], scratch[-1:]
    sizes = dict(BLOCK_E=block_e, CHUNK=chunk_pairs, PAIRS=triton.next_power_of_2(chunk_pairs), FILL=1024)
    scan_here = SCAN_IN_SCATTER and chunks * block_e <= SCAN_TILE
    tile_c = (
        triton.next_power_of_2(chunks)
        if scan_here
        else max(1, min(triton.next_power_of_2(chunks), SCAN_TILE // block_e))
    )
    place = scan_here and num_pairs <= min(LAST_COUNT_PLACES_MAX_PAIRS, MAX_CHUNK)
    _count_kernel[(chunks,)](
        logits, weights, ids_flat, counts, sorted_pairs, num_tokens, num_experts, total_rows, stride_logits,
        _ticket(device) if place else num_blocks, block_experts, num_blocks, max_blocks, BLOCK_T=block_t,
        PLACE=place, BLOCK_M=block_m, ALL_PAIRS=max(16, triton.next_power_of_2(num_pairs)),
        num_warps=route_warps(block_t * block_e, aligned) if route["ROUTE"] else 4, **dict(route, **sizes),
        **dependent,
    )  # fmt: skip
    if place:
        return Alignment(sorted_pairs, block_experts, num_blocks, block_m)
    if not scan_here:
        # Four warps: eight measured 1.9x slower at 32 chunks (5.5 against 2.9 us, KERNEL_NOTES item 18).
        _scan_kernel[(1,)](
            counts, cursors, block_experts, num_blocks, chunks, max_blocks, BLOCK_M=block_m, BLOCK_E=block_e,
            TILE_C=tile_c, FILL=1024, **dependent,
        )  # fmt: skip
    _scatter_kernel[(chunks,)](
        ids_flat, counts, cursors, sorted_pairs, block_experts, num_blocks, num_pairs, num_experts, max_blocks,
        chunks, SCAN=scan_here, BLOCK_M=block_m, TILE_C=tile_c, **sizes, **dependent,
    )  # fmt: skip
    return Alignment(sorted_pairs, block_experts, num_blocks, block_m)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sort the (token, k) pairs of ``topk_ids`` [M, k] by expert into blocks of ``block_m`` rows."""
    return _align(topk_ids.contiguous(), num_experts, block_m)


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """:func:`routing.route` then :func:`align_pairs`, the routing inside the alignment's first launch.

    Returns ``(topk_weights fp32 [M, k], topk_ids int32 [M, k], alignment)``, the first two as ``route`` gives them.
    """
    router_logits, weights, ids = route_outputs(router_logits, top_k)
    return (
        weights,
        ids,
        _align(ids, router_logits.shape[1], block_m, routing=(router_logits, weights.view(-1), renormalize)),
    )
