"""Probe: the routed alignment alone (``route_and_align``: router logits in, sorted blocks out), launch by launch.

    python -m benchmarks.probe_align --anchor benchmarks/results/anchor_v3.json [--variants ...] [--out DIR]

The cells are the anchor run's tensor-core cells (model, M and the BLOCK_M its project call used, read from the
anchor's results), so each time here is the glue of a call measured beside Marlin. Variants switch
kernels/align.py's choices (module constants), all in one process:

- ``default``: as shipped;
- ``one-program-64``: the one program routes up to 64 tokens (``ONE_PROGRAM_LOGITS`` = 8192, up to 16 warps);
- ``scan-launch``: the scan of the per-chunk counts in a launch of its own (``SCAN_IN_SCATTER`` off);
- ``scatter-launch``: the pairs placed by scatter programs, never by the last count program (the form before
  KERNEL_NOTES item 28); ``count-places``: by the last count program up to MAX_CHUNK pairs;
- ``half-step``: count programs of half a routing step's tokens (twice the programs, half the logits each);
- ``half-step-places``: those count programs, the last placing every pair (DeepSeek-V3 M = 16: 8 programs of 2 tokens);
- ``full-step``: count programs of a whole routing step (``HALF_STEP_MAX_CHUNKS`` 0, the form before
  KERNEL_NOTES item 22);
- ``warps-x2``, ``warps-x4``: routing programs on 256 / 128 logits per warp; ``warps-before``: 512 everywhere (the
  form before item 22); ``one-program-64-x2``, ``half-step-x2``: those two on 256 a warp.

Every variant of every cell is checked first (the ids against torch's softmax top-k, ties allowed; the weights
within 1e-5; every pair in one block of its own expert, the block count exact), then timed as a CUDA graph of
``CALLS`` calls (median of replays) and profiled launch by launch (benchmarks/launch_profile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.launch_profile import capture, profile_graph


def _half_step(num_experts: int) -> int:
    from repack.runtime.kernels.routing import token_block

    return max(1, token_block(num_experts) // 2)


VARIANTS = {
    "default": {},
    "one-program-64": {"ONE_PROGRAM_LOGITS": 8192},  # the one program routing up to 64 tokens on up to 16 warps
    "scan-launch": {"SCAN_IN_SCATTER": False},
    "scatter-launch": {"LAST_COUNT_PLACES_MAX_PAIRS": 0},
    "count-places": {"LAST_COUNT_PLACES_MAX_PAIRS": 1 << 20},
    "half-step": {"token_block": _half_step},  # count programs of half a routing step's tokens (then halved again)
    "half-step-places": {"token_block": _half_step, "LAST_COUNT_PLACES_MAX_PAIRS": 1 << 20},  # and the placing tail
    "full-step": {"HALF_STEP_MAX_CHUNKS": 0},  # count programs of a whole routing step's tokens (before item 22)
    # Routing programs on more warps (routing.ROUTE_LOGITS_PER_WARP: 512 logits a warp by default)
    "warps-x2": {"routing.ROUTE_LOGITS_PER_WARP": 256},
    "warps-x4": {"routing.ROUTE_LOGITS_PER_WARP": 128},
    "one-program-64-x2": {"ONE_PROGRAM_LOGITS": 8192, "routing.ROUTE_LOGITS_PER_WARP": 256},
    "half-step-x2": {"token_block": _half_step, "routing.ROUTE_LOGITS_PER_WARP": 256},
    "warps-before": {"routing.ROUTE_LOGITS_PER_WARP": 512, "routing.UNALIGNED_LOGITS_PER_WARP": 512},
}
CALLS = 20  # calls per graph: the launches of one call are microseconds, a replay's own cost is amortised
REPLAYS = 50


@contextlib.contextmanager
def switches(values: dict):
    """Module constants switched for one variant: ``NAME`` in kernels/align.py, ``routing.NAME`` in routing.py."""
    from repack.runtime.kernels import align, routing

    with contextlib.ExitStack() as patches:
        for name, value in values.items():
            module, attr = (routing, name.split(".", 1)[1]) if name.startswith("routing.") else (align, name)
            patches.enter_context(mock.patch.object(module, attr, value))
        yield


def anchor_cells(path: Path) -> list[dict]:
    """(model, M, E, top_k, renormalize, block_m) of every fp16 tensor-core cell of the anchor run."""
    cells = []
    for row in json.loads(path.read_text())["rows"]:
        project = row["variants"].get("project", {})
        match = re.search(r"block_m=(\d+)", project.get("config", {}).get("repr", ""))
        if row["dtype"] != "float16" or row["tag"] != "main" or "DECODE" in project["config"]["repr"] or not match:
            continue
        keys = ("key", "M", "E", "top_k", "renormalize")
        cells.append({**{k: row[k] for k in keys}, "block_m": int(match.group(1))})
    return cells


def check(logits: torch.Tensor, top_k: int, renormalize: bool, weights, ids, alignment) -> str | None:
    """What is wrong with one routed alignment, or None."""
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    ids, weights = ids.cpu().long(), weights.cpu()
    chosen = probs.gather(1, ids)
    if not bool((chosen.min(1).values >= probs.scatter(1, ids, -1.0).max(1).values).all()):
        return "ids are not the top-k"
    expected = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    if not torch.allclose(weights, expected, rtol=1e-5, atol=1e-6):
        return "weights differ"
    block_m, flat = alignment.block_m, ids.flatten()
    counts = torch.bincount(flat, minlength=logits.shape[1])
    num_blocks = int(alignment.num_blocks.cpu())
    if num_blocks != int(((counts + block_m - 1) // block_m).sum()):
        return f"num_blocks {num_blocks}"
    rows = alignment.sorted_pairs.cpu().long().view(-1, block_m)[:num_blocks]
    owners = alignment.block_experts.cpu().long()
    real = rows < flat.numel()
    if not torch.equal(torch.sort(rows[real]).values, torch.arange(flat.numel())):
        return "pairs not placed exactly once"
    if not bool((flat[rows[real]] == owners[:num_blocks, None].expand_as(rows)[real]).all()):
        return "a pair in another expert's block"
    if not bool((owners[num_blocks:] == -1).all()):
        return "owners past the end"
    return None


def measure(cell: dict, variant: str) -> dict:
    from repack.runtime.kernels.align import route_and_align

    gen = torch.Generator(device="cuda").manual_seed(cell["M"] * cell["E"])
    logits = torch.randn(cell["M"], cell["E"], generator=gen, device="cuda").to(torch.float16)
    args = (logits, cell["top_k"], cell["renormalize"], cell["block_m"])
    with switches(VARIANTS[variant]):
        problem = check(logits, cell["top_k"], cell["renormalize"], *route_and_align(*args))
        graph = capture(lambda i: route_and_align(*args), CALLS)
        times = []
        for _ in range(REPLAYS):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1000 / CALLS)
        launches = profile_graph(lambda i: route_and_align(*args), CALLS)
    return dict(cell, variant=variant, us=sorted(times)[len(times) // 2], launches=launches, problem=problem)


def warm(jobs: list[tuple[dict, str]]) -> int:
    """Compile what the jobs launch (one call each) in a worker process: the timed process reads Triton's cache."""
    from repack.runtime.kernels.align import route_and_align

    for cell, variant in jobs:
        logits = torch.randn(cell["M"], cell["E"], device="cuda").to(torch.float16)
        with switches(VARIANTS[variant]):
            route_and_align(logits, cell["top_k"], cell["renormalize"], cell["block_m"])
    torch.cuda.synchronize()
    return len(jobs)


def markdown(rows: list[dict]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["| model | M | BLOCK_M | " + " | ".join(variants) + " |", "|---|---|---|" + "---|" * len(variants)]
    by_cell: dict[tuple, dict] = {}
    for r in rows:
        by_cell.setdefault((r["key"], r["M"], r["block_m"]), {})[r["variant"]] = r
    for (key, m, block_m), found in by_cell.items():
        cells = []
        for v in variants:
            r = found.get(v)
            parts = "; ".join(f"{x['name']} {x['us']:.1f}" for x in r["launches"]) if r else ""
            cells.append(f"{r['us']:.1f} ({parts}){' FAIL ' + r['problem'] if r and r['problem'] else ''}" if r else "")
        lines.append(f"| {key} | {m} | {block_m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchor", type=Path, default=Path(__file__).parent / "results" / "anchor_v3.json")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--models", default="", help="only these anchor keys (comma-separated), and --ms these M")
    parser.add_argument("--ms", default="")
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cells, variants = anchor_cells(args.anchor), args.variants.split(",")
    cells = [c for c in cells if not args.models or c["key"] in args.models.split(",")]
    cells = [c for c in cells if not args.ms or str(c["M"]) in args.ms.split(",")]
    jobs = [(cell, v) for cell in cells for v in variants]
    with mp.get_context("spawn").Pool(12) as pool:
        print(f"warm-up: {sum(pool.map(warm, [jobs[i::12] for i in range(12)]))} calls", flush=True)
    rows: list[dict] = []
    for cell in cells:
        for variant in variants:
            if time.time() - start > args.budget_s:
                break
            try:
                r = measure(cell, variant)
            except Exception as exc:  # one broken variant must not cost the rest of the run
                print(
                    f"{cell['key']:12s} M={cell['M']:5d} {variant:12s} FAILED {type(exc).__name__}: {exc}", flush=True
                )
                continue
            rows.append(r)
            parts = ", ".join(f"{x['name']} {x['us']:.1f}" for x in r["launches"])
            print(f"{cell['key']:12s} M={cell['M']:5d} bm={cell['block_m']:3d} {variant:12s} {r['us']:6.1f} us "
                  f"[{parts}]{' FAIL ' + r['problem'] if r['problem'] else ''}", flush=True)  # fmt: skip
            (out / "probe_align.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows)))
    (out / "probe_align.md").write_text(markdown(rows) + "\n")
    print(f"{len(rows)} rows in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
