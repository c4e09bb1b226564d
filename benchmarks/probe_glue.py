"""Probe: the glue around the GEMMs (routing, alignment, top-k sum) and the two top-k sum strategies, on a GPU.

    python benchmarks/probe_glue.py [--out DIR]

For each shape and M, in one process, CUDA-graph medians: route alone; route + align; the top-k sum of [P, H]
rows by torch.sum and by kernels/topk_sum.py; and the whole fused_moe with the top-k sum as per-pair rows
(``reduce="pairs"``, the default) and as fp32 atomics into [M, H] (``reduce="atomic"``). The numbers decide
which top-k sum the default takes (benchmarks/KERNEL_NOTES.md item 17). Random routing, random weights.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from repack.runtime.fused_moe import fused_moe, kernel_path
from repack.runtime.kernel_config import Kernels, get_config
from repack.runtime.kernels import gluon_sm90
from repack.runtime.kernels.align import align_pairs
from repack.runtime.kernels.routing import route
from repack.runtime.kernels.topk_sum import topk_sum
from repack.runtime.tune import random_stack, time_graph

SHAPES = {  # name: experts, top_k, hidden, intermediate
    "qwen3-30b": (128, 8, 2048, 768),
    "qwen2-57b": (64, 8, 3584, 2560),
    "dsv3": (256, 8, 7168, 2048),
}
MS = (16, 64, 256, 1024, 4096)


def probe_cell(name: str, stack, top_k: int, m: int) -> dict:
    """Every timing of one (shape, M)."""
    e, h = stack.num_experts, stack.hidden_size
    x = torch.randn(m, h, device="cuda").half()
    logits = torch.randn(m, e, device="cuda")
    rows = torch.randn(m * top_k, h, device="cuda").half()
    out = torch.empty(m, h, device="cuda", dtype=torch.float16)
    w, ids = route(logits, top_k, True)
    cfg = get_config(stack, m, top_k, torch.float16, torch.device("cuda"))
    atomic_cfg = replace(cfg, reduce="atomic")
    gluon = cfg.gluon or gluon_sm90.heuristic(m * top_k, e)
    block_m = gluon.block_m if kernel_path(x, stack, top_k) is Kernels.GLUON_SM90 else cfg.block_m
    pairs, atomic = fused_moe(x, stack, ids, w), fused_moe(x, stack, ids, w, config=atomic_cfg)
    return dict(
        shape=name,
        M=m,
        route=time_graph(lambda: route(logits, top_k, True), 50),
        route_align=time_graph(lambda: align_pairs(route(logits, top_k, True)[1], e, block_m), 50),
        torch_sum=time_graph(lambda: torch.sum(rows.view(m, top_k, h), dim=1, out=out), 50),
        topk_sum=time_graph(lambda: topk_sum(rows, top_k, out), 50),
        call_pairs=time_graph(lambda: fused_moe(x, stack, ids, w), 20),
        call_atomic=time_graph(lambda: fused_moe(x, stack, ids, w, config=atomic_cfg), 20),
        atomic_vs_pairs_rel=float((atomic.float() - pairs.float()).norm() / pairs.float().norm()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        stack = random_stack(experts, hidden, inter, 1)[0]
        for m in MS:
            rows.append(probe_cell(name, stack, top_k, m))
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()))
        del stack
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe_glue.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
