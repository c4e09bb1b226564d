"""Benchmark candidate kernel configs on the local GPU and write the tuned JSON tables.

``repack tune`` calls :func:`tune`. For every shape (E, H, I, top_k) and token count M it times each
candidate with CUDA-graph replay on random int4 weights (several copies, so L2 never holds them), keeps the
fastest config whose output agrees with the heuristic config's, and writes
``E={E},N={I},device_name={GPU}.json`` (runtime/kernel_config.py reads it).
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch

from repack.errors import RepackError
from repack.runtime.fused_moe import fused_moe
from repack.runtime.kernel_config import config_file_name, device_name, heuristic_config
from repack.runtime.weights import MoeWeights

TUNE_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def candidate_configs(num_tokens: int, top_k: int, num_experts: int) -> list[dict]:
    """The search space: small tiles (and direct mode) for decode, large tiles for prefill."""
    pairs_per_expert = num_tokens * top_k / num_experts
    block_ms = [16] if pairs_per_expert <= 16 else [16, 32, 64] if pairs_per_expert <= 128 else [64, 128]
    configs = []
    for bm, bn, bk, warps, stages in itertools.product(block_ms, (32, 64, 128), (64, 128), (4, 8), (2, 3, 4)):
        if bm * bn >= 128 * 128 and warps == 4:
            continue
        for reduce in ("pairs", "atomic"):
            configs.append(
                dict(
                    BLOCK_M=bm,
                    BLOCK_N=bn,
                    BLOCK_K=bk,
                    GROUP_M=1 if bm == 16 else 8,
                    num_warps=warps,
                    num_stages=stages,
                    REDUCE=reduce,
                )
            )
    if num_tokens * top_k <= 64:
        configs += [dict(c, DIRECT=True) for c in configs if c["BLOCK_M"] == 16]
    return configs


def _random_weights(e: int, h: int, i: int, group: int, copies: int) -> list[MoeWeights]:
    info = torch.iinfo(torch.int32)
    w13 = torch.randint(info.min, info.max, (copies * e, 2 * i, h // 8), dtype=torch.int32, device="cuda")
    w2 = torch.randint(info.min, info.max, (copies * e, h, i // 8), dtype=torch.int32, device="cuda")
    s13 = (torch.rand(copies * e, h // group, 2 * i, device="cuda") * 0.01 + 0.005).half()
    s2 = (torch.rand(copies * e, i // group, h, device="cuda") * 0.01 + 0.005).half()
    sl = lambda c: slice(c * e, (c + 1) * e)  # noqa: E731
    return [MoeWeights(w13[sl(c)], s13[sl(c)], w2[sl(c)], s2[sl(c)], bits=4, group_size=group) for c in range(copies)]


def _time(fn, replays: int = 30) -> float:
    """Median microseconds of a CUDA-graph replay of ``fn``."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def tune_shape(e: int, h: int, i: int, top_k: int, dtype: torch.dtype, token_counts: Iterable[int]) -> dict[int, dict]:
    """Best config per M for one shape on the current GPU."""
    copies = max(2, -(-240 * 2**20 // int(top_k * 1.5 * h * i)))
    weights = _random_weights(e, h, i, 128, min(copies, 16))
    best: dict[int, dict] = {}
    for m in token_counts:
        x = torch.randn(m, h, device="cuda").to(dtype)
        ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(m)]).to(torch.int32)
        w = torch.rand(m, top_k, device="cuda")
        expected = fused_moe(x, weights[0], ids, w, config=heuristic_config(m, top_k, e))
        timings = []
        for cfg in candidate_configs(m, top_k, e):
            out = fused_moe(x, weights[0], ids, w, config=cfg)
            if not torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2):
                continue
            run = lambda cfg=cfg, x=x, ids=ids, w=w: [fused_moe(x, wt, ids, w, config=cfg) for wt in weights]  # noqa: E731
            timings.append((_time(run) / len(weights), cfg))
        best[m] = min(timings, key=lambda t: t[0])[1]
        print(f"E={e} H={h} I={i} top_k={top_k} M={m}: {min(t for t, _ in timings):.1f} us {best[m]}", flush=True)
    return best


def tune(shapes: Iterable[tuple[int, int, int, int]], dtype: torch.dtype, out_dir: str | Path) -> list[Path]:
    """Tune every ``(E, H, I, top_k)`` shape and write one JSON file per shape into ``out_dir``."""
    if not torch.cuda.is_available():
        raise RepackError("repack tune: no CUDA GPU visible; run it on the GPU the configs are for")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for e, h, i, top_k in shapes:
        table = tune_shape(e, h, i, top_k, dtype, TUNE_TOKEN_COUNTS)
        path = out / config_file_name(e, i, device_name("cuda"))
        path.write_text(json.dumps({str(m): cfg for m, cfg in table.items()}, indent=1) + "\n")
        written.append(path)
    return written
