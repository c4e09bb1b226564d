"""Who takes which work in a persistent kernel: each program's list of (tile, K steps) items.

A persistent grid of ``programs`` walks ``num_tiles`` output tiles of ``num_steps`` K steps each. Three ways to deal
them, a constexpr of the kernel (runtime/kernels/gluon_ws_sm90.py's producer and consumers call the same helpers,
so both partitions walk the same list):

- :data:`WHOLE_TILES`: round-robin, tile ``pid``, ``pid + programs``, ... whole. Programs running at the same time
  hold neighbouring tiles (grouped by ``common.tile_ids``: the same expert's weights and blocks, hot in L2), but the
  last partial wave leaves SMs idle, and with fewer tiles than programs most programs have nothing to do.
- :data:`STREAM_K`: the flattened (tile, step) work cut into one equal range per program, so a range begins and ends
  mid-tile and its partial sum is added as is (the kernel must add, not store). No idle tail, but at any moment the
  programs hold tiles a whole share apart: on the H100 the 128-token w2 lost 5-19% at M = 4096 this way against one
  program per tile (benchmarks/KERNEL_NOTES.md item 45; whether L2 locality or the split tiles' extra adds cost
  more, the next run says).
- :data:`WAVES_THEN_STREAM_K`: the classic hybrid of the stream-K paper (Osama et al., 2023): every full wave but the
  last dealt round-robin whole, then the last full wave and the partial one cut into equal ranges (one to two tiles
  a program, so no program adds more than two partial sums). Where there are fewer tiles than two waves it is
  stream-K; where the tiles fill whole waves, round-robin.

Scalar ``triton.jit`` helpers, so Gluon kernels call them (as they do ``common.tile_ids``) and the interpreter runs
them on the CPU (tests/runtime/test_schedule.py checks every (tile, step) is taken exactly once).
"""

from __future__ import annotations

import triton
import triton.language as tl

# The ways, as the kernels' SPLIT constexpr (constexprs: jit code reads no other globals; ``int()`` on the host).
WHOLE_TILES = tl.constexpr(0)
STREAM_K = tl.constexpr(1)
WAVES_THEN_STREAM_K = tl.constexpr(2)


@triton.jit
def work_share(pid, programs, num_tiles, num_steps, SPLIT: tl.constexpr, MIN_STEPS: tl.constexpr):
    """(first, stop, stride, whole, start, end): program ``pid`` of ``programs`` walks its items as ``for i in
    range(first, stop, stride)`` and :func:`work_item` names each: the tiles ``pid``, ``pid + programs``, ...
    below ``whole`` whole, then the flattened (tile, step) range ``[start, end)`` of the tiles from ``whole`` on. A
    split range takes at least MIN_STEPS steps (each piece ends in an epilogue). Whole tiles loop over the tiles
    themselves (``i`` is the tile: the round-robin loop as it was, no scalar more live in it)."""
    if SPLIT == WHOLE_TILES:
        return pid, num_tiles, programs, num_tiles, 0, num_tiles * num_steps
    if SPLIT == STREAM_K:
        whole = num_tiles * 0
    else:
        waves = num_tiles // programs
        split_waves = (num_tiles % programs != 0).to(tl.int32)  # the last full wave goes with a partial one
        whole = tl.maximum(waves - split_waves, 0) * programs
    total = num_tiles * num_steps
    share = tl.maximum(tl.cdiv(total - whole * num_steps, programs), MIN_STEPS)
    start = tl.minimum(whole * num_steps + pid * share, total)
    end = tl.minimum(start + share, total)
    whole_items = tl.cdiv(tl.maximum(whole - pid, 0), programs)
    split_items = tl.cdiv(end, num_steps) - start // num_steps  # 0 where the range is empty (start == end)
    return 0, whole_items + split_items, 1, whole, start, end


@triton.jit
def work_item(i, pid, programs, whole, start, end, num_steps, SPLIT: tl.constexpr):
    """(tile, first step, end step) of item ``i`` of program ``pid``'s list (:func:`work_share`'s values)."""
    if SPLIT != WAVES_THEN_STREAM_K:  # whole tiles: the tile is the item, its steps as stream-K's of [0, all)
        t = i if SPLIT == WHOLE_TILES else start // num_steps + i
        # Whole tiles' steps computed, not the constant [0, num_steps): that let LLVM carry the producer's addresses
        # as 64-bit induction variables (8 bytes spilled, a w13 at 3 programs an SM).
        return t, tl.maximum(start - t * num_steps, 0), tl.minimum(end - t * num_steps, num_steps)
    whole_items = tl.cdiv(tl.maximum(whole - pid, 0), programs)
    split = (i >= whole_items).to(tl.int32)
    t = (1 - split) * (pid + i * programs) + split * (start // num_steps + i - whole_items)
    step0 = split * tl.maximum(start - t * num_steps, 0)
    step1 = (1 - split) * num_steps + split * tl.minimum(end - t * num_steps, num_steps)
    return t, step0, step1
