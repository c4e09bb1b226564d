"""Where the microseconds of one call go: torch.profiler over the CUDA-graph replay, one row per launch.

    rows = profile_graph(step, copies=R)   # step(i) runs call i on weight copy i; per-call microseconds

Every table in benchmarks/RESULTS.md carries this breakdown next to the call's total (issue: a whole session of
kernel work once missed that 69% of a call was one single-program kernel). Graph replay keeps the launch gaps
of a served layer; the profiler (CUPTI) still sees each kernel node of the graph. The call's own total comes
from event timing without the profiler; the sum of the rows is GPU busy time, so total minus that sum is the
gaps between launches.

With dependent launches (KERNEL_NOTES.md item 33) a launch starts while the one before still runs and waits for it
inside: the rows' spans overlap and their sum exceeds the call. Each row therefore also carries ``exposed_us``, the
part of its spans no launch that started earlier still covers: what the call would lose without that launch's
tail. Over a call the exposed times add up to its busy time, so they say which launch the call waits on.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch


def short_name(kernel: str) -> str:
    """A readable launch name: Triton/Gluon kernels keep theirs; C++ templates lose their arguments
    (``void at::native::reduce_kernel<512, 1, ...>(...)`` -> ``at::native::reduce_kernel``)."""
    name = re.split(r"[<(]", kernel.removeprefix("void "), maxsplit=1)[0].strip()
    return name or kernel


def capture(step, copies: int) -> torch.cuda.CUDAGraph:
    """One graph of step(0) ... step(copies - 1), warmed up once on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            step(i)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def profile_graph(step, copies: int, replays: int = 10) -> list[dict]:
    """Per-call device microseconds and launch count of every kernel (memset, memcpy) in ``step``, largest
    first, as ``[{"name", "us", "launches"}]``."""
    graph = capture(step, copies)
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    calls = replays * copies
    spans = [
        (short_name(event.name), event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]
    del graph
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, start, end in spans:
        totals[name] += end - start
        counts[name] += 1
    exposed = exposed_times(spans)
    rows = [
        dict(name=n, us=totals[n] / calls, launches=counts[n] / calls, exposed_us=exposed[n] / calls) for n in totals
    ]
    return sorted(rows, key=lambda r: -r["us"])


def exposed_times(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per name, the summed part of its ``(name, start, end)`` spans that no span started earlier covers (ties in
    start: the longer first). Dependent launches overlap their predecessor; this is the time each adds."""
    exposed: dict[str, float] = defaultdict(float)
    covered = float("-inf")
    for name, start, end in sorted(spans, key=lambda span: (span[1], -span[2])):
        exposed[name] += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return exposed


def breakdown(rows: list[dict], width: int = 4) -> str:
    """``name us`` of the ``width`` largest launches, for one log line."""
    return ", ".join(f"{r['name']} {r['us']:.1f}" for r in rows[:width])
