"""The "mma128" word-order loops side by side: the converter's forward transpose (``transpose_to_mma128``) and
verify's inverse (``transpose_from_mma128``, in panels; ``transpose_from_mma128_strided``, the one-block-at-a-time
loop it replaced, kept for strided arrays), on one expert's qweight of real models.

Each loop runs over ``--copies`` different experts' words in turn (more than the caches hold), best of
``--repeat``; GB/s counts the words once (as the qweight's bytes). Every inverse is checked bit for bit against
the words the forward loop started from. One thread, as in the converter and in verify.

    python benchmarks/bench_word_order.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout
from repack.formats import mma128_kernels  # noqa: E402

# (model, hidden H, moe intermediate I): w13's GPTQ words are [H/8, 2I], w2's [I/8, H]
MODELS = [
    ("Qwen2-57B-A14B", 3584, 2560),
    ("Qwen3-30B-A3B", 2048, 768),
    ("Mixtral-8x7B", 4096, 14336),
    ("DeepSeek-V3", 7168, 2048),
]


def best_gbps(loop, sources: list[np.ndarray], targets: list[np.ndarray], repeat: int) -> float:
    loop(sources[0], targets[0])  # compiled (or loaded from numba's cache) before timing
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for source, target in zip(sources, targets, strict=True):
            loop(source, target)
        best = min(best, time.perf_counter() - start)
    return sum(source.nbytes for source in sources) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=8, help="experts' words per loop (at least 64 MB in all)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(
        "| model | tensor | GPTQ words [R, N] | forward GB/s | inverse GB/s | inverse / forward "
        "| before: strided loop GB/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for model, hidden, inter in MODELS:
        for tensor, (rows, cols) in (("w13", (hidden // 8, 2 * inter)), ("w2", (inter // 8, hidden))):
            copies = max(args.copies, -(-(64 << 20) // (rows * cols * 4)))
            gptq = [rng.integers(0, 2**32, (rows, cols), dtype=np.uint32) for _ in range(copies)]
            mma = [np.empty((cols, rows // 2), np.uint64) for _ in range(copies)]
            back = [np.empty((rows, cols), np.uint32) for _ in range(copies)]
            forward = best_gbps(mma128_kernels.transpose_to_mma128, gptq, mma, args.repeat)
            inverse = best_gbps(mma128_kernels.transpose_from_mma128, mma, back, args.repeat)
            if not all(np.array_equal(b, g) for b, g in zip(back, gptq, strict=True)):
                raise SystemExit(f"{model} {tensor}: the inverse did not give the words back")
            strided = best_gbps(mma128_kernels.transpose_from_mma128_strided, mma, back, args.repeat)
            if not all(np.array_equal(b, g) for b, g in zip(back, gptq, strict=True)):
                raise SystemExit(f"{model} {tensor}: the strided inverse did not give the words back")
            print(
                f"| {model} | {tensor} | [{rows}, {cols}] | {forward:.2f} | {inverse:.2f} | {inverse / forward:.2f}x "
                f"| {strided:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
