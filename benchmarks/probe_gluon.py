"""One routed-layer call on the Gluon sm_90 kernels, for a profiler to look at (benchmarks/KERNEL_NOTES.md item 15).

    ncu --kernel-name regex:_w13_kernel --launch-skip 1 --launch-count 1 --section WarpStateStats \
        python benchmarks/probe_gluon.py --model qwen3-30b --m 4096 --tile 64,64,8,4

Runs the layer twice (the first call compiles) with random sym g128 weights of the model's shape.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.check_gluon import MODELS
from repack.runtime.fused_moe import fused_moe
from repack.runtime.kernels.routing import route
from repack.runtime.tune import random_stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b", choices=sorted(MODELS))
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--tile", default="64,64,8,4", help="GLUON entry: block_m,block_n,group_m,stages")
    args = ap.parse_args()
    e, top_k, h, i = MODELS[args.model]
    stack = random_stack(e, h, i, 1)[0]
    x = torch.randn(args.m, h, device="cuda").half()
    w, ids = route(torch.randn(args.m, e, device="cuda"), top_k, True)
    cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, WEIGHT_MAJOR=True)
    cfg["GLUON"] = [int(v) for v in args.tile.split(",")]
    for _ in range(2):
        fused_moe(x, stack, ids, w, config=dict(cfg))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
