"""Config sweep for the fused MoE on a GPU: time candidate configs per token count, print the best.

Run on the H200 (device tool): ``python benchmarks/sweep_moe.py [--cases ...] [--out DIR]``. Writes
``sweep_moe.json`` (every timing) and prints the best config per (case, M); ``runtime/configs/`` JSON files are
made from it (one per device and shape, the format of runtime/kernel_config.py). fp16; one table serves bf16.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.bench_moe import CASES, check_case, log, random_stack, rotation, time_graph

DECODE = [
    dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=w, num_stages=1, DIRECT=True)
    for bn, bk, w in (
        (16, 128, 1),
        (32, 128, 1),
        (32, 128, 2),
        (64, 128, 2),
        (64, 128, 4),
        (32, 64, 1),
        (64, 64, 2),
        (16, 64, 1),
        (128, 128, 4),
    )
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
MMA = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=st, NIBBLE_DOTS=nib)
    for bm, bn, bk, g, w, st in _TILES
    for nib in ((False, True) if bk == 128 else (False,))
]
SMALL = [c for c in MMA if c["BLOCK_M"] <= 32]
PREFETCH2 = [dict(c, PREFETCH=2) for c in DECODE[:5]]
NIBBLE = [c for c in MMA if c["NIBBLE_DOTS"] and c["BLOCK_M"] <= 64]
NIBBLE_BOTH = NIBBLE + [dict(c, SCALE_ACC=False) for c in NIBBLE]
SETS = {
    "all": None,  # SWEEP_M below
    "decode": {m: DECODE[:5] + PREFETCH2 for m in (1, 2, 4)},
    "mid": {m: NIBBLE_BOTH for m in (8, 16, 64, 256)},
}
SWEEP_M = {1: DECODE, 2: DECODE, 4: DECODE + SMALL, 8: DECODE + SMALL, 16: DECODE[:4] + SMALL, 64: MMA[:9],
           256: MMA, 1024: MMA[4:], 4096: MMA[7:]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ms", default=",".join(map(str, SWEEP_M)), help="token counts to sweep")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument("--set", default="all", choices=sorted(SETS), help="which config set (and token counts)")
    args = parser.parse_args()
    from repack.runtime.fused_moe import fused_moe

    results = []
    for case in (c for c in CASES if c.name in args.cases.split(",")):
        expert_bytes = 3 * case.hidden * case.inter / 2
        stacks = random_stack(case.experts, case.hidden, case.inter, rotation(expert_bytes * case.top_k))
        for dtype in (torch.float16, torch.bfloat16):
            log(f"check {case.name} {dtype}: {check_case(case, dtype, stacks[0]):.2e} (heuristic)")
            for cfg in (MMA[5], DECODE[2], PREFETCH2[1], dict(MMA[5], SCALE_ACC=False)):
                log(f"check {case.name} {dtype} {cfg}: {check_case(case, dtype, stacks[0], dict(cfg)):.2e}")
        sweep = SETS[args.set] or SWEEP_M
        ms = sorted(sweep) if args.set != "all" else map(int, args.ms.split(","))
        for m, configs in ((m, sweep[m]) for m in ms):
            x = torch.randn(m, case.hidden, device="cuda", dtype=torch.float16)
            ids = torch.stack([torch.randperm(case.experts, device="cuda")[: case.top_k] for _ in range(m)]).int()
            w = torch.rand(m, case.top_k, device="cuda")
            out = torch.empty_like(x)
            timings = []
            for cfg in configs:
                for reduce in ("pairs", "atomic") if m <= 4 else ("pairs",):
                    c = dict(cfg, REDUCE=reduce)

                    def run(c=c, x=x, ids=ids, w=w, out=out, stacks=stacks):
                        for s in stacks:
                            fused_moe(x, s, ids, w, config=c, out=out)

                    try:
                        t = time_graph(run, 20) / len(stacks)
                    except Exception as exc:  # noqa: BLE001 - a config that fails is reported, not fatal
                        log(f"  {case.name} M={m} {c} failed: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    timings.append((t, c))
                    results.append(dict(case=case.name, M=m, us=t, config=c))
            timings.sort(key=lambda p: p[0])
            for t, c in timings[:3]:
                log(f"  {case.name:12s} M={m:5d} {t:9.1f} us  {c}")
            Path(args.out, f"sweep_moe{args.tag}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
