"""A target for Nsight Compute: one shape's routed MoE call, run eagerly a few times on random int4 weights.

    ncu --clock-control none --kernel-name regex:_w13_ws_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 -m benchmarks.ncu_call --case mixtral-8x7b --m 16

Each call reads its own copy of the weights (benchmarks/bench_moe.py's rotation past L2), so a profiled launch reads
its experts from DRAM whether or not ncu flushes the caches; ``--launch-skip`` past the first calls skips Triton's
compile and autotuning launches. Where the kernel's time goes (stall reasons, DRAM throughput) is what the per-launch
tables cannot say: KERNEL_NOTES.md item 28.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_moe import CASES, rotation
from benchmarks.launch_profile import capture, profile_graph
from repack.runtime.fused_moe import routed_moe
from repack.runtime.tune import random_stack


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="mixtral-8x7b", choices=[c.name for c in CASES])
    parser.add_argument("--m", type=int, default=16, help="tokens of the call")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--graph-s", type=float, default=0.0, help="then replay a CUDA graph of the calls this long")
    args = parser.parse_args(argv)
    case = next(c for c in CASES if c.name == args.case)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    stacks = random_stack(
        case.experts, case.hidden, case.inter, rotation(case.experts * 3 * case.hidden * case.inter / 2)
    )
    x = torch.randn(args.m, case.hidden, device="cuda").to(dtype)
    logits = torch.randn(args.m, case.experts, device="cuda").to(torch.float16)
    for call in range(args.calls):
        routed_moe(x, stacks[call % len(stacks)], logits, case.top_k, case.renormalize)
    torch.cuda.synchronize()
    print(f"{args.case} M={args.m} {args.dtype}: {args.calls} calls over {len(stacks)} copies", flush=True)
    if args.graph_s:
        replay(lambda i: routed_moe(x, stacks[i], logits, case.top_k, case.renormalize), len(stacks), args.graph_s)


def replay(step, copies: int, seconds: float) -> None:
    """The same calls as a CUDA graph replayed for ``seconds``: per call, the first and the last 10% of the replays
    (a clock that drops under sustained load shows as a difference), each launch's time in the replay, then single
    replays after an idle pause (what ncu sees)."""
    graph = capture(step, copies)
    times, started = [], time.monotonic()
    while time.monotonic() - started < seconds:
        times.append(_replay_us(graph) / copies)
    tenth = max(1, len(times) // 10)
    print(f"graph: {len(times)} replays, us per call: first {statistics.median(times[:tenth]):.1f}, "
          f"last {statistics.median(times[-tenth:]):.1f}", flush=True)  # fmt: skip
    for launch in profile_graph(step, copies):
        print(f"  {launch['name']}: {launch['us']:.1f} us x {launch['launches']}", flush=True)
    isolated = [_replay_us(graph, idle_s=0.02) / copies for _ in range(20)]
    print(f"replays after 20 ms idle: us per call {statistics.median(isolated):.1f}", flush=True)


def _replay_us(graph: torch.cuda.CUDAGraph, idle_s: float = 0.0) -> float:
    """Microseconds of one replay (CUDA events), after ``idle_s`` of an idle GPU."""
    time.sleep(idle_s)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3


if __name__ == "__main__":
    main()
