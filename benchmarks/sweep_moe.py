"""Config sweep for the fused MoE on a GPU: time candidate configs per token count, print the best.

Run on the H200 (device tool): ``python benchmarks/sweep_moe.py [--cases ...] [--out DIR]``. Writes
``sweep_moe.json`` (every timing) and prints the best config per (case, M); ``runtime/configs/`` JSON files are
made from it (one per device and shape, the format of runtime/kernel_config.py). fp16; one table serves bf16.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.bench_moe import CASES, check_case, log, random_stack, rotation, time_graph
from repack.runtime.kernel_config import Family, device_name, load_configs
from repack.runtime.tune import DECODE_CONFIGS, TENSOR_CORE_CONFIGS, WEIGHT_MAJOR_CONFIGS, candidate_configs

# One search space for the sweep and for `repack tune` (runtime/tune.py).
DECODE = DECODE_CONFIGS
MMA = TENSOR_CORE_CONFIGS
WEIGHT_MAJOR = WEIGHT_MAJOR_CONFIGS
SWEEP_M = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ms", default=",".join(map(str, SWEEP_M)), help="token counts to sweep")
    parser.add_argument("--tag", default="", help="suffix of the JSON file name")
    parser.add_argument(
        "--only-weight-major",
        action="store_true",
        help="time only the weight-major configs, plus the shipped config of each M as the baseline",
    )
    parser.add_argument(
        "--only-family",
        choices=[f.value for f in Family],
        help="time only this family's configs, plus the shipped config of each M as the baseline",
    )
    parser.add_argument(
        "--only-shipped",
        action="store_true",
        help="time only the shipped config of each M (the nearest M's where none): an A/B of two code versions",
    )
    parser.add_argument("--no-checks", action="store_true", help="skip the correctness checks before the timings")
    args = parser.parse_args()
    from repack.runtime.fused_moe import fused_moe

    results = []
    for case in (c for c in CASES if c.name in args.cases.split(",")):
        expert_bytes = 3 * case.hidden * case.inter / 2
        stacks = random_stack(case.experts, case.hidden, case.inter, rotation(expert_bytes * case.top_k))
        for dtype in () if args.no_checks else (torch.float16, torch.bfloat16):
            log(f"check {case.name} {dtype}: {check_case(case, dtype, stacks[0]):.2e} (heuristic)")
            for cfg in (
                MMA[5],
                DECODE[2],
                DECODE[3],
                replace(MMA[5], scale_acc=False),
                WEIGHT_MAJOR[6],
                WEIGHT_MAJOR[7],
            ):
                log(f"check {case.name} {dtype} {cfg.to_dict()}: {check_case(case, dtype, stacks[0], cfg):.2e}")
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, case.hidden, device="cuda", dtype=torch.float16)
            ids = torch.stack([torch.randperm(case.experts, device="cuda")[: case.top_k] for _ in range(m)]).int()
            w = torch.rand(m, case.top_k, device="cuda")
            out = torch.empty_like(x)
            timings = []
            candidates = candidate_configs(m, case.top_k, stacks[0])
            only = Family.WEIGHT_MAJOR if args.only_weight_major else args.only_family and Family(args.only_family)
            if only or args.only_shipped:
                shipped = load_configs(case.experts, case.inter, device_name("cuda")) or {}
                nearest = [shipped[min(shipped, key=lambda k: abs(k - m))]] if shipped else []
                family = [] if args.only_shipped else [c for c in candidates if c.family is only]
                candidates = nearest + family
            for c in candidates:

                def run(c=c, x=x, ids=ids, w=w, out=out, stacks=stacks):
                    for s in stacks:
                        fused_moe(x, s, ids, w, config=c, out=out)

                try:
                    t = time_graph(run, 20) / len(stacks)
                except Exception as exc:  # noqa: BLE001 - a config that fails is reported, not fatal
                    log(f"  {case.name} M={m} {c.to_dict()} failed: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                timings.append((t, c))
                results.append(dict(case=case.name, M=m, us=t, config=c.to_dict()))
            timings.sort(key=lambda p: p[0])
            for t, c in timings[:3]:
                log(f"  {case.name:12s} M={m:5d} {t:9.1f} us  {c.to_dict()}")
            Path(args.out, f"sweep_moe{args.tag}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
