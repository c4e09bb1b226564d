"""Probe: does where the weights lie in memory move our call's time? One process, one shape and M, one routing.

    python -m benchmarks.probe_placement --case mixtral-8x7b --m 16 [--harness]

On the H100 the anchor harness read our Mixtral M=16 call at 279 us where benchmarks/ncu_call.py's graph of the same
call read 243 (and ncu 241 for its two launches), while Qwen3-235B M=16 read the other way, 293 against 309; Marlin
read the same in ncu and in the harness (KERNEL_NOTES.md item 28). Candidates: the physical placement of the weight
stack (DRAM channels and TLB reach differ per allocation), or something in the harness's process. Here the same
call is timed (CUDA graph over two copies, median of 1 s of replays, launches profiled) on stacks allocated after
spacers of different sizes, each twice (a second timing shows what a re-measurement alone moves) and once with the
same words as version 2's "mma128" rows (every TMA box 64 runs of 64 bytes, where the "mma128_tiles" the converter
writes make it one contiguous run: formats/SPEC.md section 3); with ``--harness``, then again
after the anchor harness's setup (vLLM's libraries loaded) and on its own weight build (``build_main_weights``,
fp32 reference included), timed by our timer and by the harness's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.anchor_run import row_major_stacks
from benchmarks.bench_moe import CASES
from benchmarks.launch_profile import capture, profile_graph
from repack.runtime.fused_moe import routed_moe
from repack.runtime.tune import random_stack

SPACERS_MIB = (0, 2, 64, 1000, 3)  # bytes allocated (and kept) before each stack
COPIES = 2


def time_call(step, label: str, seconds: float = 1.0) -> float:
    """Median microseconds per call of ``step`` over ``COPIES`` copies, as one graph replayed ``seconds``."""
    graph = capture(step, COPIES)
    times, started = [], time.monotonic()
    while time.monotonic() - started < seconds:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / COPIES)
    us = statistics.median(times)
    launches = ", ".join(f"{r['name']} {r['us']:.1f}" for r in profile_graph(step, COPIES)[:3])
    print(f"{label:<40} {us:7.1f} us per call | {launches}", flush=True)
    return us


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="mixtral-8x7b", choices=[c.name for c in CASES])
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--harness", action="store_true", help="then inside the anchor harness (.bench-marlin)")
    args = parser.parse_args(argv)
    case = next(c for c in CASES if c.name == args.case)
    torch.manual_seed(0)
    x = [torch.randn(args.m, case.hidden, device="cuda").half() for _ in range(COPIES)]
    logits = torch.randn(args.m, case.experts, device="cuda").half()
    kept = []
    for spacer in SPACERS_MIB:
        kept.append(torch.empty(spacer << 20, dtype=torch.uint8, device="cuda"))
        stacks = random_stack(case.experts, case.hidden, case.inter, COPIES)
        kept.append(stacks)

        def step(i, stacks=stacks):
            return routed_moe(x[i], stacks[i], logits, case.top_k, case.renormalize)

        def as_rows(i, rows=row_major_stacks(stacks)):
            return routed_moe(x[i], rows[i], logits, case.top_k, case.renormalize)

        time_call(step, f"stack after {spacer} MiB")
        time_call(step, f"stack after {spacer} MiB, again")
        time_call(as_rows, f"stack after {spacer} MiB, as mma128 rows")
    if args.harness:
        harness_stages(case, args.m, x, logits, kept[1])


def harness_stages(case, m: int, x, logits, first_stacks) -> None:
    """The first stack again after the harness's setup; then the harness's own weights by both timers."""
    from benchmarks.anchor_run import adapt, load_harness

    harness = load_harness()
    adapt(harness)
    harness.setup(False)

    def ours(i):
        return routed_moe(x[i], first_stacks[i], logits, case.top_k, case.renormalize)

    time_call(ours, "first stack, harness set up")
    model = next(mm for mm in harness.MODELS if mm.key == case.name)
    weights = harness.build_main_weights(model, torch.float16, "cuda", False, ["project"], False)
    stacks = weights["project"]

    def theirs(i):
        return routed_moe(x[i], stacks[i % len(stacks)], logits, case.top_k, case.renormalize)

    time_call(theirs, f"harness weights ({len(stacks)} copies)")
    record = harness.time_graph(theirs, COPIES)
    print(f"{'harness weights, harness timer':<40} {record['us']:7.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
