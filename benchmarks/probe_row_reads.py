"""Probe: how fast does an H200 stream int4 weights read the way the decode kernels read them?

The decode kernels (runtime/kernels/decode.py, runtime/kernels/weight_major.py DIRECT) give each program BLOCK_N rows of
an output-major [rows, K/8] int32 stack and walk K in steps of 16 words: every step reads 64 bytes from each of
BLOCK_N rows that lie H/2 bytes apart. Both kernels stall near 1.2 TB/s at M=1. This probe times that access
pattern alone (XOR of the words, nothing else) against reads whose per-step tile is contiguous (a tiled layout)
and against a device copy, to tell a memory-pattern limit from an arithmetic one.

``python benchmarks/probe_row_reads.py`` on the GPU; prints GB/s per variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.runtime.tune import time_graph


@triton.jit
def _rows_kernel(w_ptr, out_ptr, k_words, BLOCK_N: tl.constexpr, STEP: tl.constexpr, TILED: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, STEP)
    if TILED:  # [row tiles, K steps, BLOCK_N, STEP]: each step's tile is one contiguous run
        ptrs = w_ptr + pid.to(tl.int64) * BLOCK_N * k_words + offs_n[:, None] * STEP + offs_w[None, :]
        advance = BLOCK_N * STEP
    else:  # [rows, K/8]: BLOCK_N runs of STEP words, k_words apart
        ptrs = w_ptr + (pid * BLOCK_N + offs_n[:, None]).to(tl.int64) * k_words + offs_w[None, :]
        advance = STEP
    acc = tl.zeros((BLOCK_N, STEP), dtype=tl.int32)
    for _ in range(0, k_words, STEP):
        acc ^= tl.load(ptrs)
        ptrs += advance
    tl.store(out_ptr + pid * BLOCK_N + offs_n, tl.sum(acc, axis=1))


def main() -> None:
    rows, k_words = 8 * 2 * 2560, 3584 // 8  # Qwen2-57B w13 of the 8 experts one token uses: 73 MB
    copies = 4  # cycle through copies so L2 (50 MB) never holds the words
    words = [
        torch.randint(-(2**31), 2**31 - 1, (rows, k_words), dtype=torch.int32, device="cuda") for _ in range(copies)
    ]
    out = torch.empty(rows, dtype=torch.int32, device="cuda")
    nbytes = rows * k_words * 4
    dst = torch.empty_like(words[0])
    t = time_graph(lambda: [dst.copy_(w) for w in words], 20) / copies
    print(f"copy (read + write)            {2 * nbytes / t / 1e3:7.0f} GB/s", flush=True)
    for tiled in (False, True):
        for block_n, step, warps in ((32, 16, 1), (64, 16, 1), (64, 16, 2), (64, 16, 4), (64, 32, 2), (64, 32, 4),
                                     (64, 64, 4), (128, 16, 4), (128, 32, 4), (256, 16, 8)):  # fmt: skip
            grid = (rows // block_n,)

            def run(block_n=block_n, step=step, warps=warps, tiled=tiled, grid=grid):
                for w in words:
                    _rows_kernel[grid](w, out, k_words, BLOCK_N=block_n, STEP=step, TILED=tiled, num_warps=warps)

            t = time_graph(run, 20) / copies
            kind = "tiled" if tiled else "rows "
            print(
                f"{kind} BLOCK_N={block_n:3d} step={4 * step:3d} B warps={warps} {nbytes / t / 1e3:7.0f} GB/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
