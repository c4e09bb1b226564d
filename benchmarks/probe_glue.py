"""Probe: the glue around the GEMMs (routing, alignment, preparation, top-k sum), launch by launch, on a GPU.

    python -m benchmarks.probe_glue [--cases qwen3-30b,...] [--ms 1,16,...] [--budget-s 150] [--out DIR]

For each case (benchmarks/bench_moe.py ``CASES``) and M, in one process, the whole routed layer from router
logits in each variant of the glue (issue 17; benchmarks/KERNEL_NOTES.md items 17 and 18):

- ``route+fused``: ``route()`` then ``fused_moe`` (routing as a launch of its own, the per-pair top-k sum);
- ``routed``: ``routed_moe``: routing inside the call's first launch (the one-program alignment up to 1024
  pairs, the count step past that, the decode's preparation at decode), the per-pair top-k sum;
- ``routed+atomic``: the same with fp32 atomics into [M, H] (cleared by w13 on the Gluon path) and a cast;
- ``routed+out``: the same with fp16 atomics straight into the output (cleared by w13): no launch for the sum;
- act-order cases (``-actorder``): ``route+fused`` gathers each pair's row once (kernels/act_order.py) for the
  plain kernels, ``actorder-in-loop`` gathers the columns inside the K loop (the path before).

Every variant of every cell is checked against a float32 reference on its first tokens (the output poisoned with
NaN first), timed as a CUDA graph over weight copies rotated past L2 (median), and profiled launch by launch
(benchmarks/launch_profile.py): "glue" is every launch that is not one of the two GEMMs. Compilation runs first in
parallel worker processes (one call of every variant), so the timed process reads Triton's cache. Results go to
``DIR/probe_glue.json`` after every cell and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.bench_moe import CASES, L2_BYTES, Case, copy_bandwidth, dequantize_experts, random_inputs, rel_err
from benchmarks.launch_profile import profile_graph

VARIANTS = ("route+fused", "routed", "routed+atomic", "routed+out")
REDUCE = {"routed+atomic": "atomic", "routed+out": "out"}
ACT_ORDER = "-actorder"  # a case name with this suffix: the shape's stack with a random act-order permutation
IN_LOOP = "actorder-in-loop"  # act-order columns gathered inside the GEMM's K loop (gluon_sm90.ACT_ORDER_GATHER off)
DEFAULT_CASES = ("qwen3-30b", "qwen2-57b-actorder", "qwen1.5-moe", "dsv2-lite", "qwen3-235b")
DEFAULT_MS = (1, 16, 64, 256, 1024, 4096)
CHECK_TOKENS = 32  # tokens of each call checked against the float32 reference
GEMMS = ("w13", "w2")  # launch names that hold one of these are the GEMMs; everything else is glue


def case_by_name(name: str) -> Case:
    return next(replace(c, name=name) for c in CASES if c.name == name.removesuffix(ACT_ORDER))


def make_copies(case: Case, copies: int) -> list:
    """``copies`` random stacks of the case's shape (benchmarks/bench_moe.py's weights), act-order ones sharing one
    random permutation per expert."""
    from repack.runtime.tune import random_stack

    stacks = random_stack(case.experts, case.hidden, case.inter, copies)
    if not case.name.endswith(ACT_ORDER):
        return stacks
    perm = torch.stack([torch.randperm(case.hidden, device="cuda") for _ in range(case.experts)]).to(torch.int32)
    return [replace(stack, w13_perm=perm) for stack in stacks]


def variant_config(variant: str, stack, m: int, case: Case, dtype, device: str = "cuda"):
    """The config a variant passes: None (the runtime's own choice) or its top-k sum over the heuristic tile."""
    from repack.runtime.fused_moe import get_config, kernel_path
    from repack.runtime.kernel_config import Family
    from repack.runtime.kernels import gluon_sm90

    if variant not in REDUCE:
        return None
    x = torch.empty(m, case.hidden, dtype=dtype, device=device)
    cfg = get_config(stack, m, case.top_k, dtype, torch.device(device))
    if kernel_path(x, stack, case.top_k, cfg) is Family.GLUON_SM90 and cfg.gluon is None:
        cfg = replace(cfg, gluon=gluon_sm90.heuristic_tile(m * case.top_k, case.experts))
    return replace(cfg, reduce=REDUCE[variant])


@contextlib.contextmanager
def variant_switches(variant: str):
    """The module switch a variant flips for the duration of its call (read while the call is planned)."""
    from repack.runtime.kernels import gluon_sm90

    gluon_sm90.ACT_ORDER_GATHER = variant != IN_LOOP
    try:
        yield
    finally:
        gluon_sm90.ACT_ORDER_GATHER = True


def step_fn(variant: str, case: Case, x, logits, stack, out, config):
    """One call of ``variant`` writing ``out``."""
    from repack.runtime.fused_moe import fused_moe, routed_moe
    from repack.runtime.kernels.routing import route

    with variant_switches(variant):
        if variant in ("route+fused", IN_LOOP):
            w, ids = route(logits, case.top_k, case.renormalize)
            return fused_moe(x, stack, ids, w, out=out, config=config)
        return routed_moe(x, stack, logits, case.top_k, case.renormalize, out=out, config=config)


def cells(cases: list[str], ms: list[int]) -> list[tuple[str, int, str]]:
    """(case, M, variant) in measuring order; the top-k sum variants from 16 tokens up (below, the decode kernels
    run, which sum in their w2 whatever the config says); act-order cases take their two paths."""

    def wanted(c: str, m: int, v: str) -> bool:
        if c.endswith(ACT_ORDER):  # the two act-order paths past decode
            return v in ("route+fused", IN_LOOP) and m in (16, 256, 1024)
        return (v not in REDUCE or m >= 16) and v != IN_LOOP

    return [(c, m, v) for c in cases for m in ms for v in VARIANTS + (IN_LOOP,) if wanted(c, m, v)]


def warm(jobs: list[tuple[str, int, str]]) -> int:
    """Worker process: one call of every job (compiles into Triton's on-disk cache); the jobs it ran."""
    done, stacks = 0, {}
    for name, m, variant in jobs:
        case = case_by_name(name)
        if name not in stacks:
            stacks = {name: make_copies(case, 1)[0]}
        x, logits = random_inputs(case, torch.float16, m, "cuda")
        out = torch.empty(m, case.hidden, dtype=torch.float16, device="cuda")
        step_fn(variant, case, x, logits, stacks[name], out, variant_config(variant, stacks[name], m, case, x.dtype))
        done += 1
    torch.cuda.synchronize()
    return done


def reference(case: Case, x, ids, w, w13f, w2f, perm=None) -> torch.Tensor:
    """float32 [n, H] for the first n tokens: sum_j w * W2[e] (silu(W1[e] x) * W3[e] x) on dequantized experts
    (w13's inputs in the expert's act-order ``perm``, where given)."""
    ref = torch.zeros(x.shape[0], case.hidden, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13f[e] @ (x[t] if perm is None else x[t][perm[e].long()]).float()
            ref[t] += w[t, j] * (w2f[e] @ (torch.nn.functional.silu(h[: case.inter]) * h[case.inter :]))
    return ref


def measure(case: Case, m: int, variant: str, copies: list, w13f, w2f) -> dict:
    from repack.runtime.fused_moe import kernel_path
    from repack.runtime.kernels.routing import route
    from repack.runtime.tune import time_graph

    dtype = torch.float16
    x, logits = random_inputs(case, dtype, m, "cuda")
    config = variant_config(variant, copies[0], m, case, dtype)
    out = torch.full((m, case.hidden), float("nan"), dtype=dtype, device="cuda")
    step_fn(variant, case, x, logits, copies[0], out, config)
    n = min(m, CHECK_TOKENS)
    w, ids = route(logits[:n], case.top_k, case.renormalize)
    err = rel_err(out[:n], reference(case, x[:n], ids, w, w13f, w2f, copies[0].w13_perm))

    def step(i: int):
        step_fn(variant, case, x, logits, copies[i], out, config)

    def replay():
        for i in range(len(copies)):
            step(i)

    call = time_graph(replay, 50 if m <= 256 else 20) / len(copies)
    with variant_switches(variant):
        kernels = str(kernel_path(x, copies[0], case.top_k, config))
    launches = profile_graph(step, len(copies))
    gemm = sum(r["us"] for r in launches if any(g in r["name"] for g in GEMMS))
    busy = sum(r["us"] for r in launches)
    return dict(
        case=case.name,
        M=m,
        variant=variant,
        kernels=kernels,
        call_us=call,
        glue_us=busy - gemm,
        glue_pct=100 * (busy - gemm) / call,
        err=err,
        launches=launches,
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        "| case | M | variant | kernels | call us | glue us | glue % | err | launches (us per call) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        launches = "; ".join(f"{x['name']} {x['us']:.1f}" for x in r["launches"])
        lines.append(
            f"| {r['case']} | {r['M']} | {r['variant']} | {r['kernels']} | {r['call_us']:.1f} | {r['glue_us']:.1f} "
            f"| {r['glue_pct']:.1f} | {r['err']:.1e} | {launches} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    parser.add_argument("--budget-s", type=float, default=150.0, help="no new cell starts after this many seconds")
    parser.add_argument("--workers", type=int, default=12, help="compile warm-up processes (0: none)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    start = time.time()
    todo = cells(args.cases.split(","), [int(m) for m in args.ms.split(",")])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.workers:
        shares = [todo[i :: args.workers] for i in range(args.workers)]
        try:
            with mp.get_context("spawn").Pool(args.workers) as pool:
                warmed = sum(pool.map(warm, [s for s in shares if s]))
            print(f"warm-up: {warmed} calls compiled in {time.time() - start:.0f} s", flush=True)
        except Exception as exc:  # the timed process then compiles what it needs itself
            print(f"warm-up failed ({type(exc).__name__}: {exc}); compiling in the timed process", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, bandwidth_gbs=copy_bandwidth() / 1e9)
    rows: list[dict] = []
    for name in dict.fromkeys(c for c, _, _ in todo):
        if time.time() - start > args.budget_s:
            break
        case = case_by_name(name)
        per_copy = 3 * case.hidden * case.inter * case.experts / 2
        copies = make_copies(case, max(2, min(8, int(4 * L2_BYTES // per_copy) + 1)))
        w13f, w2f = dequantize_experts(copies[0], list(range(case.experts)), torch.float32)
        for _, m, variant in (cell for cell in todo if cell[0] == name):
            if time.time() - start > args.budget_s:
                break
            try:
                r = measure(case, m, variant, copies, w13f, w2f)
            except Exception as exc:  # one broken variant must not cost the rest of the run
                print(f"{name:12s} M={m:5d} {variant:14s} FAILED {type(exc).__name__}: {exc}", flush=True)
                continue
            rows.append(r)
            print(
                f"{name:12s} M={m:5d} {variant:14s} {r['kernels']:22s} call {r['call_us']:8.1f} glue "
                f"{r['glue_us']:6.1f} ({r['glue_pct']:4.1f}%) err {r['err']:.1e}",
                flush=True,
            )
            (out_dir / "probe_glue.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
        del copies, w13f, w2f
        torch.cuda.empty_cache()
    (out_dir / "probe_glue.md").write_text(markdown(rows) + "\n")
    print(f"{len(rows)} of {len(todo)} cells in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
