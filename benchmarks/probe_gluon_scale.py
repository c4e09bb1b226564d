"""Probe: where the Gluon kernels apply the group scale, and which token tile the small-M cells want.

    python -m benchmarks.probe_gluon_scale [--models ...] [--ms 4,16,64,256] [--out DIR]

Variants switch module constants of runtime/kernels/gluon_sm90.py, all in one process:

- ``per-weight``: every dequantized pair of weights multiplied by its scale before the MMA (the kernels before
  KERNEL_NOTES.md item 20: LOP3, add, multiply per two weights; bf16: seven instructions);
- ``after``: token tiles of up to 32 sum exact ``q - zero`` times x per K step and scale the step's fp32 sum once
  per accumulator element, after the step's last MMA (bf16 only since KERNEL_NOTES.md item 20, which this probe
  measured for both dtypes: fp16 rows of this variant now run the per-weight kernels).

Each variant times the dispatcher's own pick (``default``: shipped table or heuristic) and fixed Gluon tiles
(``g16`` = 16 tokens x 64 channels, 4 stages; ``g32`` = 32 x 64), fp16 and bf16, every cell of ``--models`` x
``--ms``: routed_moe from router logits, random sym g128 weights rotated past L2, CUDA-graph median, and each
launch's share (benchmarks/launch_profile.py). Every timed (variant, config) is first checked against a float32
reference at min(M, 16) tokens (bench_moe.reference_moe): relative error <= 1e-3 fp16, 5e-3 bf16.
Writes DIR/probe_gluon_scale.json (DIR: $OUT or the working directory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_moe import CASES, L2_BYTES, random_inputs, random_stack, reference_moe, rel_err, rotation
from benchmarks.launch_profile import breakdown, profile_graph
from repack.runtime.fused_moe import kernel_path, routed_moe
from repack.runtime.kernels import gluon_sm90
from repack.runtime.tune import time_graph

VARIANTS = {
    "per-weight": {"SCALE_AFTER_MAX_BLOCK_M": 0},
    "after": {"SCALE_AFTER_MAX_BLOCK_M": 32},
}
TILES = {"g16": [16, 64, 1, 4], "g32": [32, 64, 4, 4]}
LIMITS = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


@contextlib.contextmanager
def switches(values: dict):
    saved = {name: getattr(gluon_sm90, name) for name in values}
    for name, value in values.items():
        setattr(gluon_sm90, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gluon_sm90, name, value)


def gluon_config(tile: list[int]) -> dict:
    """A gluon_sm90 config running ``tile`` (its tl tile is what runs where the Gluon kernels cannot)."""
    return dict(FAMILY="gluon_sm90", BLOCK_M=tile[0], BLOCK_N=64, BLOCK_K=128, GROUP_M=tile[2], num_warps=4,
                num_stages=3, SCALE_ACC=False, GLUON=tile)  # fmt: skip


def time_call(case, stacks, xs, logits, config) -> tuple[float, list[dict]]:
    """(median us of one routed_moe call, its launches) over the rotated ``stacks``."""

    def step(i: int) -> None:
        routed_moe(xs[i], stacks[i], logits, case.top_k, case.renormalize, config=config)

    def run() -> None:
        for i in range(len(stacks)):
            step(i)

    us = statistics.median(time_graph(run, 20) / len(stacks) for _ in range(3))
    return us, profile_graph(step, len(stacks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2-57b,qwen3-30b,mixtral-8x7b,qwen3-235b,dsv3,qwen1.5-moe,dsv2-lite")
    parser.add_argument("--ms", default="4,16,64,256")
    parser.add_argument("--bf16-models", default="qwen2-57b", help="models also timed with bf16 activations")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {list(VARIANTS)}")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no new model after this many seconds")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    variants = args.variants.split(",")
    results = []
    out_path = Path(args.out, "probe_gluon_scale.json")
    for case in (c for c in CASES if c.name in args.models.split(",")):
        if time.time() - T0 > args.budget_s:
            log(f"budget spent: {case.name} and later models not run")
            break
        dtypes = [torch.float16] + ([torch.bfloat16] if case.name in args.bf16_models.split(",") else [])
        per_token = case.top_k * 3 * case.hidden * case.inter / 2
        stacks = random_stack(case.experts, case.hidden, case.inter, rotation(per_token * min(ms)))
        for dtype in dtypes:
            for m in ms:
                x, logits = random_inputs(case, dtype, m, "cuda")
                xs = [x] * len(stacks)
                check_x, check_logits = x[:16], logits[:16]
                top = torch.topk(torch.softmax(check_logits.float(), -1), case.top_k, -1)
                top_w = top.values / top.values.sum(-1, keepdim=True) if case.renormalize else top.values
                ref = reference_moe(case, check_x, stacks[0], top.indices.int(), top_w)
                configs = {"default": None, **{name: gluon_config(tile) for name, tile in TILES.items()}}
                for variant in variants:
                    values = VARIANTS[variant]
                    for name, config in configs.items():
                        with switches(values):
                            path = kernel_path(x, stacks[0], case.top_k, config).value
                            if variant != "per-weight" and "per-weight" in variants and path != "gluon_sm90":
                                continue  # the same kernels as per-weight's row
                            got = routed_moe(check_x, stacks[0], check_logits, case.top_k, case.renormalize,
                                             config=config)  # fmt: skip
                            err = rel_err(got, ref)
                            ok = err <= LIMITS[dtype]

                            us, launches = time_call(case, stacks, xs, logits, config)
                        row = dict(model=case.name, dtype=str(dtype).removeprefix("torch."), M=m, variant=variant,
                                   config=name, path=path, us=us, err=err, ok=ok, launches=launches)  # fmt: skip
                        results.append(row)
                        log(f"{case.name} {row['dtype']} M={m} {variant:15s} {name:8s} {path:13s} {us:8.1f} us "
                            f"err {err:.1e}{'' if ok else ' FAIL'} | {breakdown(launches)}")  # fmt: skip
                        out_path.write_text(json.dumps(results, indent=1))
        del stacks
        torch.cuda.empty_cache()
    log(f"wrote {out_path} ({L2_BYTES >> 20} MB L2 assumed for the rotation)")


if __name__ == "__main__":
    main()
