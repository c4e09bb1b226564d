"""Check and time the fused W4A16 MoE on a GPU: routed experts alone and the whole block with the shared expert.

    python benchmarks/bench_moe.py [--quick] [--out DIR]

For each case (Qwen2-57B-A14B, Qwen1.5-MoE-A2.7B), dtype (fp16, bf16) and token count M it prints and
writes (``DIR/bench_moe.json`` and ``DIR/bench_moe.md``, DIR defaults to $OUT or benchmarks/):
ours (routed: router logits -> route + align + fused_moe -> output), ours with the shared expert as extra
always-on chunks (second fused_moe call), the bytes floor (touched int4 weights + scales + activations
over the device copy bandwidth measured in this run), a cuBLAS fp16 baseline (per-expert torch matmuls
on dequantized weights, graph-captured, routing precomputed), and the anchors of ../shared/docs/anchors.md.
Every timing is a CUDA-graph replay over several weight copies (so L2, 60 MB on H200, never holds the
weights), median of many replays. Needs only torch + triton and the repo on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from repack.formats.repack_v1 import from_word_order
from repack.runtime.tune import random_stack, time_graph

L2_BYTES = 60 * 2**20
M_ALL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
M_QUICK = (1, 4, 16, 64, 256, 1024, 4096)
CHECK_M = (1, 16, 300)

# ../shared/docs/anchors.md (H200, fp16, int4 g128 sym, routed experts only), microseconds.
ANCHORS = {
    "qwen2-57b": {
        "marlin": {1: 67.6, 4: 148.6, 16: 262.1, 64: 345.9, 256: 645.5, 1024: 2008.6, 4096: 6823.6},
        "fp16_triton": {1: 118.8, 4: 373.1, 16: 710.8, 64: 827.2, 256: 878.4, 1024: 1233.6, 4096: 4015.4},
    },
    "qwen1.5-moe": {
        "marlin": {1: 39.6, 4: 53.6, 16: 82.3, 64: 119.3, 256: 176.1, 1024: 480.1, 4096: 1273.3},
        "fp16_triton": {1: 35.4, 4: 88.4, 16: 171.1, 64: 265.6, 256: 284.1, 1024: 345.0, 4096: 912.9},
    },
}


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    shared_chunks: int
    renormalize: bool = False


CASES = (Case("qwen2-57b", 64, 8, 3584, 2560, 8), Case("qwen1.5-moe", 60, 4, 2048, 1408, 4))


def log(msg: str) -> None:
    print(msg, flush=True)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write) of a 1 GiB D2D copy, median of 20."""
    src = torch.empty(2**29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 2 / statistics.median(times)


def dequantize_experts(weights, experts: list[int], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Our layout -> (w13 [n, 2I, H], w2 [n, H, I]) in ``dtype`` for the listed experts (sym, no act-order)."""

    def one(qweight, scales):
        qweight = from_word_order(qweight, weights.word_order)  # plain GPTQ order: field s of word r is 8r + s
        shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
        q = (qweight[..., None] >> shifts) & 0xF  # [n, N, K/8, 8]
        q = q.reshape(*qweight.shape[:-1], -1).to(torch.float32) - 8
        s = scales.to(torch.float32).repeat_interleave(128, dim=1).transpose(1, 2)  # [n, N, K]
        return (q * s).to(dtype)

    idx = torch.tensor(experts, device=weights.w13_qweight.device)
    return one(weights.w13_qweight[idx], weights.w13_scales[idx]), one(weights.w2_qweight[idx], weights.w2_scales[idx])


def rotation(bytes_per_call: float, limit: int = 16) -> int:
    """Weight copies to cycle through so the bytes touched per replay exceed 4x L2."""
    return max(2, min(limit, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1))))


def check_case(case: Case, dtype, stack, config: dict | None = None) -> float:
    """Worst relative error of route+fused_moe vs a float32 reference over CHECK_M (random weights)."""
    from repack.runtime.fused_moe import fused_moe
    from repack.runtime.routing import route

    worst = 0.0
    for m in CHECK_M:
        x = torch.randn(m, case.hidden, device="cuda").to(dtype)
        logits = torch.randn(m, case.experts, device="cuda")
        w, ids = route(logits, case.top_k, case.renormalize)
        out = torch.full((m, case.hidden), float("nan"), dtype=dtype, device="cuda")
        fused_moe(x, stack, ids, w, out=out, config=config)
        used = sorted(set(ids.flatten().tolist()))
        w13, w2 = dequantize_experts(stack, used, torch.float32)
        pos = {e: i for i, e in enumerate(used)}
        ref = torch.zeros(m, case.hidden, device="cuda")
        xf = x.float()
        for t in range(m):
            for j in range(case.top_k):
                e = pos[int(ids[t, j])]
                h = w13[e] @ xf[t]
                act = torch.nn.functional.silu(h[: case.inter]) * h[case.inter :]
                ref[t] += w[t, j] * (w2[e] @ act)
        worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
        if not torch.isfinite(out).all():
            worst = float("inf")
    return worst


def bench_case(case: Case, dtype, ms, bandwidth: float) -> list[dict]:
    """Check once, then time every M of one (case, dtype)."""
    expert_bytes = 3 * case.hidden * case.inter / 2 + 3 * case.hidden * case.inter / 128 * 2
    copies = rotation(expert_bytes * min(case.top_k, case.experts))
    stacks = random_stack(case.experts, case.hidden, case.inter, copies)
    shared = random_stack(case.shared_chunks, case.hidden, case.inter, copies)
    err = check_case(case, dtype, stacks[0])
    log(f"  check {case.name} {dtype}: max rel err {err:.2e} over M={CHECK_M}, {copies} weight copies")
    fp16_weights = [dequantize_all(s, case.experts, dtype) for s in stacks[:2]]
    rows = [bench_m(case, dtype, m, stacks, shared, fp16_weights, bandwidth) for m in ms]
    for row in rows:
        row["check_rel_err"] = err
    torch.cuda.empty_cache()
    return rows


def dequantize_all(stack, experts: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert of ``stack`` as fp16/bf16 (for the cuBLAS baseline), 8 experts at a time."""
    parts = [dequantize_experts(stack, list(range(e, min(e + 8, experts))), dtype) for e in range(0, experts, 8)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def bench_m(case: Case, dtype, m: int, stacks, shared, fp16_weights, bandwidth: float) -> dict:
    """Time routed experts, the whole block and the cuBLAS baseline at one token count."""
    from repack.runtime.fused_moe import fused_moe
    from repack.runtime.routing import route

    x = torch.randn(m, case.hidden, device="cuda").to(dtype)
    logits = torch.randn(m, case.experts, device="cuda")
    gate_vec = torch.randn(case.hidden, 1, device="cuda").to(dtype) * 0.05
    shared_ids = torch.arange(case.shared_chunks, dtype=torch.int32, device="cuda").expand(m, -1).contiguous()
    routed_out, shared_out = (torch.empty(m, case.hidden, dtype=dtype, device="cuda") for _ in range(2))

    def routed():
        for s in stacks:
            w, ids = route(logits, case.top_k, case.renormalize)
            fused_moe(x, s, ids, w, out=routed_out)

    def block():
        for s, sh in zip(stacks, shared, strict=True):
            w, ids = route(logits, case.top_k, case.renormalize)
            fused_moe(x, s, ids, w, out=routed_out)
            g = torch.sigmoid((x @ gate_vec).float()).expand(m, case.shared_chunks)
            fused_moe(x, sh, shared_ids, g, out=shared_out)
            routed_out.add_(shared_out)

    ids_host = torch.topk(torch.softmax(logits, -1), case.top_k).indices.cpu()
    touched = sorted(set(ids_host.flatten().tolist()))
    token_lists = [(ids_host == e).any(-1).nonzero().flatten().to("cuda") for e in touched]
    route_ws = [torch.rand(len(t), 1, device="cuda", dtype=dtype) for t in token_lists]

    def cublas():
        for w13_f, w2_f in fp16_weights:
            shared_out.zero_()
            for e, tok, rw in zip(touched, token_lists, route_ws, strict=True):
                h = x[tok] @ w13_f[e].T
                act = torch.nn.functional.silu(h[:, : case.inter]) * h[:, case.inter :]
                shared_out.index_add_(0, tok, (act @ w2_f[e].T) * rw)

    replays = 50 if m <= 256 else 20
    t_routed = time_graph(routed, replays) / len(stacks)
    t_block = time_graph(block, replays) / len(stacks)
    t_cublas = time_graph(cublas, replays) / len(fp16_weights)
    expert_bytes = 3 * case.hidden * case.inter / 2 + 3 * case.hidden * case.inter / 128 * 2
    floor_bytes = len(touched) * expert_bytes + 2 * m * case.hidden * 2 + m * case.experts * 4
    floor = floor_bytes / bandwidth * 1e6
    anchors = {k: v.get(m) for k, v in ANCHORS[case.name].items()}
    row = dict(
        case=case.name,
        dtype=str(dtype).removeprefix("torch."),
        M=m,
        ours_us=t_routed,
        block_us=t_block,
        floor_us=floor,
        cublas_fp16_us=t_cublas,
        ours_over_floor=t_routed / floor,
        marlin_us=anchors["marlin"],
        fp16_triton_us=anchors["fp16_triton"],
        touched=len(touched),
    )
    marlin = f"{anchors['marlin']:.1f}" if anchors["marlin"] else "-"
    log(
        f"  {case.name:12s} {row['dtype']:8s} M={m:5d} ours {t_routed:9.1f} block {t_block:9.1f} "
        f"floor {floor:8.1f} ({t_routed / floor:4.2f}x) cublas {t_cublas:9.1f} marlin {marlin}"
    )
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# bench_moe ({meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']})",
        "",
        f"Command: `{meta['command']}`; copy bandwidth {meta['copy_bw_GBs']:.0f} GB/s. Microseconds.",
        "",
        "| case | dtype | M | ours | block+shared | floor | ours/floor | cuBLAS fp16 | Marlin | ours/Marlin "
        "| fp16 Triton | ours/fp16T |",
        "|" + "---|" * 12,
    ]
    fmt = lambda a: f"{a:.1f}" if a else "-"  # noqa: E731
    for r in rows:
        ratio = f"{r['ours_us'] / r['marlin_us']:.2f}" if r["marlin_us"] else "-"
        ratio_t = f"{r['ours_us'] / r['fp16_triton_us']:.2f}" if r["fp16_triton_us"] else "-"
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['M']} | {r['ours_us']:.1f} | {r['block_us']:.1f} | "
            f"{r['floor_us']:.1f} | {r['ours_over_floor']:.2f} | {r['cublas_fp16_us']:.1f} | "
            f"{fmt(r['marlin_us'])} | {ratio} | {fmt(r['fp16_triton_us'])} | "
            f"{ratio_t} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"M in {M_QUICK} only")
    parser.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).parent)))
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    args = parser.parse_args(argv)
    import triton

    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    meta = dict(
        date=datetime.date.today().isoformat(),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command="python benchmarks/bench_moe.py " + " ".join(argv or sys.argv[1:]),
        copy_bw_GBs=bandwidth / 1e9,
    )
    log(f"{meta['gpu']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    for case in (c for c in CASES if c.name in args.cases.split(",")):
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            rows += bench_case(case, dtype, M_QUICK if args.quick else M_ALL, bandwidth)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_moe.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "bench_moe.md").write_text(markdown(rows, meta))
    log(markdown(rows, meta))


if __name__ == "__main__":
    main()
