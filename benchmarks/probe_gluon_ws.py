"""Probe: the warp-specialized persistent Gluon GEMMs (runtime/kernels/gluon_ws_sm90.py) against gluon_sm90's on the
same calls.

    python -m benchmarks.probe_gluon_ws [--models ...] [--ms 4,16,64] [--variants ...] [--out DIR]

For every model x M (fp16 or bf16, random g128 weights rotated past L2; symmetric, or with random zero points
under ``--zeros``): one routing and alignment (blocks of the
16-token tile), then each variant's w13 + w2 on them, checked first against the float32 reference at min(M, 16)
tokens (relative error <= 1e-3) and then timed as a CUDA graph (median), with its launches profiled
(benchmarks/launch_profile.py). Variants: ``base`` = gluon_sm90.launch with the same tile; ``ws-P-S`` = the
warp-specialized kernels with P programs per SM and S ring stages (register cap: 64 per thread for 4 programs of
8 warps' allocation per SM, 128 for 2, 80 for 3); ``-sa`` after it scales each K step's sum in fp16 too
(gluon_sm90.SCALE_AFTER_FP16_PERSISTENT) and ``-rN`` gives the producer warpgroup N registers
(gluon_ws_sm90.PRODUCER_REGS): ``ws-4-4-sa-r32`` is fp16's step sum at 4 programs per SM (KERNEL_NOTES.md item 27).
Writes DIR/probe_gluon_ws.json and prints one line per cell.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from benchmarks.bench_moe import CASES, random_inputs, random_stack, reference_moe, rel_err, rotation
from benchmarks.launch_profile import breakdown, profile_graph
from repack.runtime.kernel_config import Family, GluonTile, KernelConfig
from repack.runtime.kernels import gluon_sm90, gluon_ws_sm90
from repack.runtime.kernels.align import route_and_align
from repack.runtime.tune import time_graph

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def run_variant(variant: str, x, stack, ids, w, rows, inter, target, tile: GluonTile) -> None:
    reduce = gluon_sm90.heuristic_reduce(x.dtype)
    if variant == "base":
        config = KernelConfig(Family.GLUON_SM90, block_m=tile.block_m, block_n=64, block_k=128, group_m=1,
                              num_warps=4, num_stages=3, gluon=tile, reduce=reduce)  # fmt: skip
        gluon_sm90.launch(x, stack, ids, w, rows, inter, target, config)
    else:
        _, per_sm, stages, *options = variant.split("-")
        ws_tile = GluonTile(tile.block_m, tile.block_n, tile.group_m, int(stages), per_sm=int(per_sm))
        step_sum = "sa" in options or gluon_sm90.SCALE_AFTER_FP16_PERSISTENT
        regs = next((int(o[1:]) for o in options if o.startswith("r")), gluon_ws_sm90.PRODUCER_REGS)
        with (
            mock.patch.object(gluon_sm90, "SCALE_AFTER_FP16_PERSISTENT", step_sum),
            mock.patch.object(gluon_ws_sm90, "PRODUCER_REGS", regs),
        ):
            gluon_ws_sm90.launch(x, stack, ids, w, rows, inter, target, ws_tile, reduce)


def measure(case, m: int, stacks: list, variants: list[str], tile: GluonTile, dtype: torch.dtype) -> list[dict]:
    """Every variant on one routing of ``m`` tokens: checked against float32 at min(m, 16) tokens, then timed."""
    x, logits = random_inputs(case, dtype, m, "cuda")
    w, ids, rows = route_and_align(logits, case.top_k, case.renormalize, tile.block_m)
    inter = torch.empty(ids.numel(), case.inter, dtype=x.dtype, device=x.device)
    pairs = gluon_sm90.heuristic_reduce(dtype) == "pairs"
    target = torch.empty(ids.numel() if pairs else m, case.hidden, dtype=x.dtype, device=x.device)
    n = min(m, 16)
    ref = reference_moe(case, x[:n], stacks[0], ids[:n], w[:n])
    rows_out = []

    def calls(variant: str) -> None:  # one call on every weight copy
        for stack in stacks:
            run_variant(variant, x, stack, ids, w, rows, inter, target, tile)

    # The first graph timed in a cell read 10-40 us slow (the H100, 2026-12-06: one variant listed first and third
    # measured 368 and 319 us), so a throwaway timing of the first variant's graph precedes them.
    with contextlib.suppress(Exception):  # a broken variant reports itself below
        time_graph(functools.partial(calls, variants[0]), 5)
    for variant in variants:
        row = dict(
            model=case.name,
            M=m,
            variant=variant,
            dtype=str(dtype).removeprefix("torch."),
            zeros=stacks[0].w13_zeros is not None,
        )

        def step(i: int, variant: str = variant) -> None:
            run_variant(variant, x, stacks[i], ids, w, rows, inter, target, tile)

        try:
            target.fill_(float("nan"))
            step(0)
            torch.cuda.synchronize()
            out = target.view(m, -1, case.hidden).float().sum(1) if pairs else target  # bf16: rows per pair
            row["err"] = rel_err(out[:n], ref)
            row["us"] = time_graph(functools.partial(calls, variant), 20) / len(stacks)
            row["launches"] = profile_graph(step, len(stacks))
            log(f"{case.name:12s} M={m:4d} {variant:8s} {row['us']:8.1f} us err {row['err']:.1e} | "
                f"{breakdown(row['launches'])}")  # fmt: skip
        except Exception as exc:  # one broken variant must not cost the rest of the run
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"{case.name:12s} M={m:4d} {variant:8s} FAILED {row['error']}")
        rows_out.append(row)
    return rows_out


def with_zeros(stack):
    """``stack`` with random zero points (uint8 in [0, 15], one per group and row) on both projections."""
    zeros = lambda scales: torch.randint(0, 16, scales.shape, dtype=torch.uint8, device=scales.device)  # noqa: E731
    return replace(stack, w13_zeros=zeros(stack.w13_scales), w2_zeros=zeros(stack.w2_scales))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2-57b,mixtral-8x7b,qwen3-30b,qwen3-235b,dsv3")
    parser.add_argument("--ms", default="4,16,64")
    parser.add_argument("--variants", default="base,ws-4-4,ws-2-8,ws-3-5")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--zeros", action="store_true", help="asymmetric: random uint8 zero points in [0, 15]")
    parser.add_argument("--budget-s", type=float, default=1e9)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    out_path = Path(args.out, "probe_gluon_ws.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tile = GluonTile(16, 64, 1, 4)
    results = []
    for case in (c for c in CASES if c.name in args.models.split(",")):
        if time.time() - T0 > args.budget_s:
            log(f"budget spent: {case.name} and later models not run")
            break
        ms = [int(m) for m in args.ms.split(",")]
        per_token = case.top_k * 3 * case.hidden * case.inter / 2
        stacks = random_stack(case.experts, case.hidden, case.inter, rotation(per_token * min(ms)))
        if args.zeros:
            stacks = [with_zeros(stack) for stack in stacks]
        for m in ms:
            results += measure(case, m, stacks, args.variants.split(","), tile, getattr(torch, args.dtype))
            out_path.write_text(json.dumps(results, indent=1))
        del stacks
        torch.cuda.empty_cache()
    log(f"wrote {out_path}")


if __name__ == "__main__":
    main()
