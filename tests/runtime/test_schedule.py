"""The persistent kernels' work lists (runtime/kernels/schedule.py), run in the Triton interpreter: every (tile, K
step) taken exactly once in each way of dealing, whole tiles where the way says so, and the split ranges as even
and as few pieces as it promises."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from repack.runtime.kernels import schedule


@triton.jit
def _items_kernel(out_ptr, num_tiles, num_steps, CAP: tl.constexpr, SPLIT: tl.constexpr, MIN_STEPS: tl.constexpr):
    """out[pid, j] = (tile, step0, step1) of item j of program pid; (-1, 0, 0) past its items."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    first, stop, stride, whole, start, end = schedule.work_share(pid, programs, num_tiles, num_steps, SPLIT, MIN_STEPS)
    j = 0
    for i in range(first, stop, stride):
        t, step0, step1 = schedule.work_item(i, pid, programs, whole, start, end, num_steps, SPLIT)
        row = out_ptr + (pid * CAP + j) * 3
        j += 1  # noqa: SIM113 (a jit loop has no enumerate)
        tl.store(row, t)
        tl.store(row + 1, step0)
        tl.store(row + 2, step1)


@functools.cache
def work_lists(programs: int, tiles: int, steps: int, split: int, min_steps: int = 4) -> tuple[tuple[tuple, ...], ...]:
    """Each program's (tile, step0, step1) items, as the kernels walk them (once per case: the interpreter is slow)."""
    cap = tiles + 3
    out = torch.full((programs, cap, 3), -1, dtype=torch.int32)
    out[..., 1:] = 0
    _items_kernel[(programs,)](out, tiles, steps, CAP=cap, SPLIT=int(split), MIN_STEPS=min_steps)
    return tuple(tuple(tuple(item) for item in rows.tolist() if item[0] >= 0) for rows in out)


def coverage(lists: tuple[tuple[tuple, ...], ...], tiles: int, steps: int) -> np.ndarray:
    """How many times each (tile, step) is taken."""
    seen = np.zeros((max(tiles, 1), steps), dtype=np.int64)
    for items in lists:
        for t, step0, step1 in items:
            assert 0 <= t < tiles and 0 <= step0 < step1 <= steps, (t, step0, step1)
            seen[t, step0:step1] += 1
    return seen[:tiles]


CASES = [  # programs, tiles, steps: fewer tiles than programs, whole waves, partial waves, one step a tile
    (8, 0, 6),
    (8, 3, 6),
    (8, 8, 6),
    (8, 13, 6),
    (8, 16, 12),
    (8, 37, 6),
    (132, 768, 6),
    (132, 1130, 12),
    (528, 300, 112),
    (7, 50, 1),
    (5, 23, 9),
]


@pytest.mark.parametrize("split", [schedule.WHOLE_TILES, schedule.STREAM_K, schedule.WAVES_THEN_STREAM_K])
@pytest.mark.parametrize("programs,tiles,steps", CASES)
def test_every_step_taken_once(programs, tiles, steps, split):
    lists = work_lists(programs, tiles, steps, split)
    assert (coverage(lists, tiles, steps) == 1).all()


@pytest.mark.parametrize("programs,tiles,steps", CASES)
def test_whole_tiles_round_robin(programs, tiles, steps):
    for pid, items in enumerate(work_lists(programs, tiles, steps, schedule.WHOLE_TILES)):
        assert list(items) == [(t, 0, steps) for t in range(pid, tiles, programs)]


@pytest.mark.parametrize("programs,tiles,steps", CASES)
def test_stream_k_ranges_are_even(programs, tiles, steps):
    min_steps = 4
    share = max(-(-tiles * steps // programs), min_steps)
    for items in work_lists(programs, tiles, steps, schedule.STREAM_K, min_steps):
        assert sum(s1 - s0 for _, s0, s1 in items) <= share
        assert [t for t, _, _ in items] == list(range(items[0][0], items[0][0] + len(items))) if items else True


@pytest.mark.parametrize("programs,tiles,steps", CASES)
def test_waves_then_stream_k(programs, tiles, steps):
    """Every full wave but the last whole and round-robin; the rest split into ranges of one to two tiles, so a
    program adds at most two partial sums; no program takes more than its even share of all the steps (rounded up):
    the call ends when the average program does."""
    lists = work_lists(programs, tiles, steps, schedule.WAVES_THEN_STREAM_K, 1)
    waves, partial = divmod(tiles, programs)
    whole = tiles if not partial else max(waves - 1, 0) * programs
    for pid, items in enumerate(lists):
        whole_items = [item for item in items if item[0] < whole]
        assert whole_items == [(t, 0, steps) for t in range(pid, whole, programs)]
        split_items = items[len(whole_items) :]
        assert all(t >= whole for t, _, _ in split_items)
        if tiles >= programs and partial:  # the split part is one to two tiles a program
            split_steps = sum(s1 - s0 for _, s0, s1 in split_items)
            assert split_steps <= 2 * steps
            assert sum(1 for _, s0, s1 in split_items if s1 - s0 < steps) <= 2
    loads = [sum(s1 - s0 for _, s0, s1 in items) for items in lists]
    assert max(loads) <= -(-tiles * steps // programs)


def test_waves_then_stream_k_splits_only_the_tail():
    """H100, 128-token w2 at M = 4096 (Qwen3-235B: about 1130 tiles of 12 steps on 132 programs): 7 whole waves dealt
    round-robin, 206 tiles split."""
    lists = work_lists(132, 1130, 12, schedule.WAVES_THEN_STREAM_K)
    split = {t for items in lists for t, s0, s1 in items if s1 - s0 < 12}
    assert min(split) >= 7 * 132 and len(split) <= 132
