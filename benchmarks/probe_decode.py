"""Probe: where does decode time go? Per-kernel times of the fused MoE at a few tokens, for each config.

The routed-experts time at M=1 (benchmarks/RESULTS.md) is a sum of launches: routing, w13, w2, the top-k sum
(or the memset and cast of the atomic path). This times each config twice on the GPU: the whole ``fused_moe``
under CUDA-graph replay (what a serving stack sees), and every kernel of it from the PyTorch profiler
(device time per launch, gaps excluded), so a change to one kernel can be judged by its own time against the
bytes it streams. Weights cycle through copies so that L2 never holds them.

``python benchmarks/probe_decode.py --out $OUT`` on the GPU; ``--ncu`` runs each kernel a few times only (for
Nsight Compute). Writes ``probe_decode.json`` and prints one line per (case, M, config).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections import defaultdict
from pathlib import Path

import torch

from repack.runtime.fused_moe import fused_moe, get_config
from repack.runtime.tune import DECODE_CONFIGS, random_stack, time_graph

CASES = {  # name: (experts, hidden, intermediate, top_k)
    "qwen2-57b": (64, 3584, 2560, 8),
    "qwen1.5-moe": (60, 2048, 1408, 4),
}


def decode_configs() -> list[dict]:
    """CUDA-core decode configs over tile and warps, prefetch depth and K slices (the tuner's list)."""
    return list(DECODE_CONFIGS)


def routing(m: int, experts: int, top_k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per copy: distinct random experts per token, random normalised weights."""
    out = []
    for _ in range(copies):
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(m)]).to(torch.int32)
        w = torch.rand(m, top_k, device="cuda")
        out.append((ids, (w / w.sum(1, keepdim=True)).contiguous()))
    return out


def kernel_times(fn, runs: int) -> dict[str, float]:
    """Mean device microseconds per call of each kernel ``fn`` launches (PyTorch profiler, CUPTI)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:40]] += event.device_time / runs
    return dict(totals)


def run_copies(x, stacks, routes, out, cfg) -> None:
    """One fused MoE per weight copy (the timed unit, divided by the copies)."""
    for c, weights in enumerate(stacks):
        fused_moe(x[c], weights, routes[c][0], routes[c][1], config=cfg, out=out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ms", default="1,4")
    parser.add_argument("--ncu", action="store_true", help="one call per config, for Nsight Compute")
    args = parser.parse_args()
    results = []
    for name, (experts, hidden, inter, top_k) in CASES.items():
        copies = 4
        stacks = random_stack(experts, hidden, inter, copies)
        per_expert = hidden * inter * 3 // 2 + 3 * hidden * inter // 128 * 2  # int4 words + fp16 scales
        for m in (int(v) for v in args.ms.split(",")):
            x = [torch.randn(m, hidden, device="cuda", dtype=torch.float16) * 0.5 for _ in range(copies)]
            routes = routing(m, experts, top_k, copies)
            touched = sum(len(set(r[0].flatten().tolist())) for r in routes) / copies
            out = torch.empty(m, hidden, device="cuda", dtype=torch.float16)
            reference = fused_moe(x[0], stacks[0], routes[0][0], routes[0][1], config=decode_configs()[0])
            table = get_config(stacks[0], m, top_k, torch.float16, torch.device("cuda"))
            configs = [table.to_dict(), *decode_configs()]
            if args.ncu:  # the table's config, the plain decode kernel and its 4-slice split
                configs = [table, configs[1], configs[3]]
            for cfg in configs:
                if args.ncu:
                    fused_moe(x[0], stacks[0], routes[0][0], routes[0][1], config=cfg, out=out)
                    continue
                got = fused_moe(x[0], stacks[0], routes[0][0], routes[0][1], config=cfg, out=out).float()
                err = ((got - reference.float()).norm() / reference.float().norm()).item()

                run = functools.partial(run_copies, x, stacks, routes, out, cfg)
                graph_us = time_graph(run, 20) / copies
                kernels = {k: v / copies for k, v in kernel_times(run, 5).items()}
                floor_bytes = touched * per_expert
                row = dict(case=name, m=m, config=cfg, graph_us=graph_us, kernels_us=kernels, err=err,
                           tb_s=floor_bytes / graph_us / 1e6)  # fmt: skip
                results.append(row)
                tag = ",".join(f"{k}={v}" for k, v in cfg.items() if k not in ("BLOCK_M", "GROUP_M", "BLOCK_K"))
                parts = " ".join(f"{k[:22]}={v:.1f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]))
                print(
                    f"{name} M={m} {graph_us:7.1f} us {row['tb_s']:.2f} TB/s err={err:.1e} [{tag}] {parts}", flush=True
                )
    if not args.ncu:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_decode.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
