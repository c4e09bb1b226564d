"""Benchmark candidate kernel configs on the local GPU and write the tuned JSON tables.

``repack tune`` calls :func:`tune`. For every shape (E, H, I, top_k) and token count M it times each
candidate with CUDA-graph replay on random int4 weights (several copies, so L2 never holds them), keeps the
fastest config whose output agrees with the heuristic config's, and writes
``E={E},N={I},device_name={GPU}.json`` (runtime/kernel_config.py reads it).

Where the Gluon sm_90 kernels run (a Hopper GPU, an mma128 stack), their tiles are candidates too. Every candidate
names its family (runtime/kernel_config.py ``FAMILY``), so the entry a winner becomes runs the kernels that were
timed: a weight-major winner stays on the weight-major kernels where the Gluon ones would run, a Gluon winner
runs its own tile.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from repack.formats.errors import RepackError
from repack.formats.stacks import choose_word_order, words_shape
from repack.runtime.fused_moe import FAMILIES, fused_moe
from repack.runtime.kernel_config import (
    DECODE_FAMILIES,
    Family,
    GluonTile,
    KernelConfig,
    config_file_name,
    device_name,
)
from repack.runtime.kernels import decode_mma, gluon_sm90
from repack.runtime.kernels.family import Call
from repack.runtime.weights import MoeWeights

TUNE_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


DECODE_CONFIGS = [  # CUDA-core decode kernels (runtime/kernels/decode.py): tile, warps, prefetch depth, K slices
    KernelConfig(Family.DECODE, 16, bn, 128, 1, warps, 1, direct=True, prefetch=depth, split_k=split)
    for bn, warps in ((32, 1), (32, 2), (64, 2), (64, 4), (128, 4))
    for depth in (1, 2)
    for split in (1, 2, 4, 8)
]
DECODE_MMA_CONFIGS = [  # the decode on Hopper tensor cores (runtime/kernels/decode_mma.py): channels, warps, K slices
    KernelConfig(Family.DECODE_MMA, 8, bn, 128, 1, warps, 1, direct=True, split_k=split)
    for bn, warps in ((16, 1), (32, 1), (64, 2))
    for split in (1, 2, 4, 8)
]
_TILES = (  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages
    (16, 64, 128, 1, 4, 2),
    (16, 128, 128, 1, 4, 3),
    (32, 64, 128, 4, 4, 3),
    (64, 128, 64, 8, 4, 3),
    (64, 128, 128, 8, 4, 3),
    (64, 256, 128, 8, 8, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 128, 8, 8, 3),
    (128, 256, 128, 8, 8, 2),
)
TENSOR_CORE_CONFIGS = [  # the gptq-order kernels (runtime/kernels/gptq_order.py)
    KernelConfig(Family.GPTQ_ORDER, bm, bn, bk, g, w, st) for bm, bn, bk, g, w, st in _TILES
]
_WEIGHT_MAJOR_TILES = (  # BLOCK_M (tokens), BLOCK_N (w2 rows; w13 channels), GROUP_M, warps, stages
    (16, 64, 1, 4, 3),
    (16, 64, 1, 4, 4),
    (16, 128, 1, 4, 3),
    (32, 64, 4, 4, 3),
    (32, 128, 4, 4, 3),
    (32, 128, 4, 8, 3),
    (64, 64, 8, 4, 3),
    (64, 128, 8, 4, 3),
    (64, 128, 8, 8, 3),
    (128, 64, 8, 4, 2),
    (128, 64, 8, 8, 3),
    (128, 128, 8, 8, 2),
    (128, 128, 8, 8, 3),
)
WEIGHT_MAJOR_CONFIGS = [  # BLOCK_K is fixed at 128 by these kernels (runtime/kernels/weight_major.py)
    KernelConfig(Family.WEIGHT_MAJOR, bm, bn, 128, g, w, st, scale_acc=False, quant_ahead=ahead)
    for bm, bn, g, w, st in _WEIGHT_MAJOR_TILES
    for ahead in (False, True)  # scales a K step ahead: faster on some tiles, a layout conversion on others
]
WEIGHT_MAJOR_DIRECT_CONFIGS = [  # decode: one block per (token, expert) pair, no alignment launch
    KernelConfig(Family.WEIGHT_MAJOR, 16, bn, 128, 1, 4, st, direct=True, scale_acc=False)
    for bn in (32, 64)
    for st in (3, 5)
]
# The Gluon sm_90 tiles searched: every one the Gluon heuristic picks and a few neighbours (each costs a compile of
# about 2 s per kernel, dtype and reduction, so the list stays short).
GLUON_TILES = tuple(
    dict.fromkeys(
        [
            *gluon_sm90.SHIPPED_TILES,
            GluonTile(16, 128, 1),
            GluonTile(32, 64, 4, stages=5),
            GluonTile(32, 128, 4, warps=8),
            GluonTile(64, 64, 8, stages=5),
            GluonTile(128, 128, 8, warps=8, w2_block_n=128),
            # the warp-specialized persistent kernels past 16 tokens (gluon_sm90.MID_PER_SM, WIDE_PER_SM)
            GluonTile(32, 64, 4, per_sm=2),
            GluonTile(64, 64, 8, per_sm=2),
            GluonTile(64, 128, 8, warps=8, per_sm=1),
            GluonTile(128, 128, 8, warps=8, per_sm=1),
        ]
    )
)
GLUON_CONFIGS = [  # each with the weight-major tile of its shape, which runs where the Gluon kernels cannot
    KernelConfig(Family.GLUON_SM90, t.block_m, t.block_n, 128, t.group_m, t.warps, 3, scale_acc=False, gluon=t)
    for t in GLUON_TILES
]


def searches_gluon(weights: MoeWeights, device: torch.device | str) -> bool:
    """Whether the Gluon tiles are candidates: the Gluon sm_90 kernels run on ``device`` and read the stack, and it
    is not act-order (tuned on plain random stacks; an act-order one runs the plain kernels on gathered rows)."""
    call = Call(weights, torch.device(device), torch.float16, 0)
    return gluon_sm90.FAMILY.supports(call) and weights.w13_perm is None


def candidate_configs(
    num_tokens: int, top_k: int, weights: MoeWeights, device: torch.device | str = "cuda"
) -> list[KernelConfig]:
    """The search space for ``weights`` on ``device``; without the Gluon tiles, the one that found the shipped
    H200 tables (benchmarks/RESULTS.md).

    Decode (CUDA-core or weight-major, one block per pair) while pairs are few; tensor-core tiles whose
    BLOCK_M is not far above the rows an expert gets (mma128 stacks run only the weight-major kernels), and the
    Gluon tiles where :func:`searches_gluon`; both top-k reductions where the sum is cheap enough to matter.
    """
    pairs = num_tokens * top_k
    rows_per_expert = pairs / max(1, weights.num_experts)
    configs = DECODE_CONFIGS + WEIGHT_MAJOR_DIRECT_CONFIGS if pairs <= 128 else []
    if pairs <= 128 and decode_mma.FAMILY.supports(Call(weights, torch.device(device), torch.float16, pairs)):
        configs = DECODE_MMA_CONFIGS + configs
    tiles = WEIGHT_MAJOR_CONFIGS if weights.mma_order else TENSOR_CORE_CONFIGS + WEIGHT_MAJOR_CONFIGS
    if searches_gluon(weights, device):
        tiles = tiles + GLUON_CONFIGS
    configs += [c for c in tiles if c.block_m <= max(16, 4 * rows_per_expert)]
    reduces = ("pairs", "atomic") if num_tokens <= 4 else ("pairs",)
    # The decode kernels always sum the top-k in w2: REDUCE does not apply to them.
    decode = [c for c in configs if c.family in DECODE_FAMILIES]
    return decode + [replace(c, reduce=r) for c in configs if c.family not in DECODE_FAMILIES for r in reduces]


def tl_reference(weights: MoeWeights, num_pairs: int, dtype: torch.dtype) -> KernelConfig:
    """The config every candidate's output is checked against: the first tl family's heuristic (fused_moe.FAMILIES
    without the Gluon kernels), the CPU-tested reference."""
    call = Call(weights, weights.w13_qweight.device, dtype, num_pairs)
    return next(c for f in FAMILIES if f.interpreted and (c := f.heuristic(call)) is not None)


def random_stack(
    experts: int, hidden: int, inter: int, copies: int, group: int = 128, word_order: str | None = None
) -> list[MoeWeights]:
    """``copies`` MoeWeights views into one random int4 sym stack (random words, scales ~0.01), on the GPU.

    Timing cycles through the copies so that L2 never holds the weights; benchmarks/bench_moe.py uses it too.
    ``word_order`` (how the kernels read the random words) defaults to the one the converter writes for this shape.
    """
    word_order = word_order or choose_word_order(4, hidden, inter, group)
    total = experts * copies
    info32 = torch.iinfo(torch.int32)
    random_words = lambda rows, words: torch.randint(  # noqa: E731
        info32.min, info32.max, words_shape(word_order, total, rows, words), dtype=torch.int32, device="cuda"
    )
    w13, w2 = random_words(2 * inter, hidden // 8), random_words(hidden, inter // 8)
    s13 = (torch.rand(total, hidden // group, 2 * inter, device="cuda") * 0.01 + 0.005).half()
    s2 = (torch.rand(total, inter // group, hidden, device="cuda") * 0.01 + 0.005).half()
    sl = lambda c: slice(c * experts, (c + 1) * experts)  # noqa: E731
    return [
        MoeWeights(w13[sl(c)], s13[sl(c)], w2[sl(c)], s2[sl(c)], bits=4, group_size=group, word_order=word_order)
        for c in range(copies)
    ]


def time_graph(fn, replays: int) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph (warmed up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def tune_shape(
    e: int, h: int, i: int, top_k: int, dtype: torch.dtype, token_counts: Iterable[int]
) -> dict[int, KernelConfig]:
    """Best config per M for one shape on the current GPU, each checked against the tl kernels running the
    heuristic config (the CPU-tested reference)."""
    copies = max(2, -(-240 * 2**20 // int(top_k * 1.5 * h * i)))
    weights = random_stack(e, h, i, min(copies, 16))
    best: dict[int, KernelConfig] = {}
    for m in token_counts:
        x = torch.randn(m, h, device="cuda").to(dtype)
        ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(m)]).to(torch.int32)
        w = torch.rand(m, top_k, device="cuda")
        expected = fused_moe(x, weights[0], ids, w, config=tl_reference(weights[0], m * top_k, dtype))
        timings = []
        for cfg in candidate_configs(m, top_k, weights[0]):
            out = fused_moe(x, weights[0], ids, w, config=cfg)
            if not torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2):
                continue
            run = lambda cfg=cfg, x=x, ids=ids, w=w: [fused_moe(x, wt, ids, w, config=cfg) for wt in weights]  # noqa: E731
            timings.append((time_graph(run, 30) / len(weights), cfg))
        best[m] = min(timings, key=lambda t: t[0])[1]
        print(
            f"E={e} H={h} I={i} top_k={top_k} M={m}: {min(t for t, _ in timings):.1f} us {best[m].to_dict()}",
            flush=True,
        )
    return best


def tune(shapes: Iterable[tuple[int, int, int, int]], dtype: torch.dtype, out_dir: str | Path) -> list[Path]:
    """Tune every ``(E, H, I, top_k)`` shape and write one JSON file per shape into ``out_dir``."""
    forced = [name for name in (gluon_sm90.GLUON_ENV, gluon_sm90.PORTABLE_ENV) if os.environ.get(name, "") == "1"]
    if forced:
        raise RepackError(
            f"repack tune: ${forced[0]} is set, so candidates would not run the kernels their entries name; unset it"
        )
    if not torch.cuda.is_available():
        raise RepackError("repack tune: no CUDA GPU visible; run it on the GPU the configs are for")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for e, h, i, top_k in shapes:
        table = tune_shape(e, h, i, top_k, dtype, TUNE_TOKEN_COUNTS)
        path = out / config_file_name(e, i, device_name("cuda"))
        path.write_text(json.dumps({str(m): cfg.to_dict() for m, cfg in table.items()}, indent=1) + "\n")
        written.append(path)
    return written
