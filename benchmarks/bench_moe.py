"""Check and time the fused W4A16 MoE on a GPU: routed experts alone and the whole block with the shared expert.

    python -m benchmarks.bench_moe [--quick] [--profile] [--cases qwen3-30b,...] [--out DIR]

For each case (the seven shapes of ``CASES``), dtype (fp16, bf16) and token count M it prints and writes
(``DIR/bench_moe.json`` and ``DIR/bench_moe.md``, DIR defaults to $OUT or benchmarks/):
ours (routed: router logits -> route + align + fused_moe -> output); with ``--profile``, where that call's
time goes, launch by launch (benchmarks/launch_profile.py); for cases with a shared expert, the whole block
with it as C always-on chunks in both of MoeBlock's shared modes, "joined" (one fused_moe call over the E + C
experts) and "separate" (a second fused_moe call), as MoeBlock.apply_experts runs them after routing; the
bytes floor (touched int4 weights + scales + activations over the device copy bandwidth measured in this run)
and a cuBLAS fp16 baseline (per-expert torch matmuls on dequantized weights, graph-captured, routing
precomputed). Marlin and vLLM's Triton kernels are measured in the same process by ../shared/bench-marlin
(benchmarks/RESULTS.md has the command), never copied in here. Each weight copy is one [E + C] allocation per
tensor whose first E experts are the routed stack and last C the shared chunks, both views, as the loader
yields a joined layer.
Both modes are checked against a float32 reference first. Every timing is a CUDA-graph replay over several
weight copies (so L2, 60 MB on H200, never holds the weights), median of many replays. Needs only torch +
triton and the repo on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.launch_profile import breakdown, profile_graph
from repack.formats.stacks import from_word_order
from repack.runtime.kernel_config import KernelConfig
from repack.runtime.moe_block import JOINED, SEPARATE, MoeBlock
from repack.runtime.routers import SOFTMAX_TOPK, RouterSpec
from repack.runtime.tune import random_stack, time_graph
from repack.runtime.weights import TENSOR_FIELDS, MoeWeights

TIMED_MODES = (JOINED, SEPARATE)  # the block's two shared-expert strategies, timed side by side
L2_BYTES = 60 * 2**20
M_ALL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
M_QUICK = (1, 4, 16, 64, 256, 1024, 4096)
CHECK_M = (1, 16, 300)


@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    shared_chunks: int
    renormalize: bool = False


# The shapes of benchmarks/RESULTS.md; shared experts as chunks of I (DeepSeek-V3's routing is approximated by a
# renormalised softmax top-k: the kernels only see ids and weights).
CASES = (
    Case("qwen2-57b", 64, 8, 3584, 2560, 8),
    Case("qwen1.5-moe", 60, 4, 2048, 1408, 4),
    Case("qwen3-30b", 128, 8, 2048, 768, 0, renormalize=True),
    Case("mixtral-8x7b", 8, 2, 4096, 14336, 0, renormalize=True),
    Case("dsv2-lite", 64, 6, 2048, 1408, 2),
    Case("qwen3-235b", 128, 8, 4096, 1536, 0, renormalize=True),
    Case("dsv3", 256, 8, 7168, 2048, 1, renormalize=True),
)
DEFAULT_CASES = ("qwen2-57b", "qwen1.5-moe")  # the shapes with shipped H200 tables


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
    """Our layout -> (w13 [n, 2I, H], w2 [n, H, I]) in ``dtype`` for the listed experts (g128, no act-order; zero
    points where the stack has them, else 8)."""

    def one(qweight, scales, zeros):
        # plain GPTQ order (field s of word r is 8r + s); formats/word_order.py permutes on the CPU
        qweight = from_word_order(qweight.cpu(), weights.word_order).to(qweight.device)
        shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
        q = (qweight[..., None] >> shifts) & 0xF  # [n, N, K/8, 8]
        q = q.reshape(*qweight.shape[:-1], -1).to(torch.float32)
        per_k = lambda t: t.to(torch.float32).repeat_interleave(128, dim=1).transpose(1, 2)  # noqa: E731  [n, N, K]
        return ((q - (8 if zeros is None else per_k(zeros))) * per_k(scales)).to(dtype)

    idx = torch.tensor(experts, device=weights.w13_qweight.device)
    pick = lambda t: None if t is None else t[idx]  # noqa: E731
    return (
        one(weights.w13_qweight[idx], weights.w13_scales[idx], pick(weights.w13_zeros)),
        one(weights.w2_qweight[idx], weights.w2_scales[idx], pick(weights.w2_zeros)),
    )


def rotation(bytes_per_call: float, limit: int = 16) -> int:
    """Weight copies to cycle through so the bytes touched per replay exceed 4x L2."""
    return max(2, min(limit, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1))))


def reference_moe(case: Case, x: torch.Tensor, stack, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 [m, H]: the sum over j of w[t, j] * (expert ids[t, j] of ``stack``)(x[t]), dequantized weights."""
    used = sorted(set(ids.flatten().tolist()))
    w13, w2 = dequantize_experts(stack, used, torch.float32)
    pos = {e: i for i, e in enumerate(used)}
    ref = torch.zeros(x.shape[0], case.hidden, device=x.device)
    xf = x.float()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = pos[int(ids[t, j])]
            h = w13[e] @ xf[t]
            act = torch.nn.functional.silu(h[: case.inter]) * h[case.inter :]
            ref[t] += w[t, j] * (w2[e] @ act)
    return ref


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; inf when ``out`` holds a NaN or an infinity."""
    return float((out.float() - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")


def random_inputs(case: Case, dtype, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations [m, H], router logits [m, E])."""
    return torch.randn(m, case.hidden, device=device).to(dtype), torch.randn(m, case.experts, device=device)


def check_case(case: Case, dtype, stack, config: KernelConfig | dict | None = None) -> float:
    """Worst relative error of route+fused_moe vs a float32 reference over CHECK_M (random weights)."""
    from repack.runtime.fused_moe import fused_moe
    from repack.runtime.kernels.routing import route

    worst = 0.0
    for m in CHECK_M:
        x, logits = random_inputs(case, dtype, m, "cuda")
        w, ids = route(logits, case.top_k, case.renormalize)
        out = torch.full((m, case.hidden), float("nan"), dtype=dtype, device="cuda")
        fused_moe(x, stack, ids, w, out=out, config=config)
        worst = max(worst, rel_err(out, reference_moe(case, x, stack, ids, w)))
    return worst


def check_block(case: Case, dtype, blocks: dict[str, MoeBlock], ms=CHECK_M) -> dict[str, float]:
    """Worst relative error of each mode's block (after routing) vs a float32 reference of routed experts plus
    gated shared chunks, built without MoeBlock's own id and weight construction."""
    from repack.runtime.kernels.routing import route

    joined = blocks[JOINED]
    device = joined.routed.w13_qweight.device
    worst = dict.fromkeys(blocks, 0.0)
    for m in ms:
        x, logits = random_inputs(case, dtype, m, device)
        w, ids = route(logits, case.top_k, case.renormalize)
        gate = torch.sigmoid(x.float() @ joined.shared_gate_weight.float().t()).expand(m, case.shared_chunks)
        chunks = torch.arange(case.shared_chunks, device=device).expand(m, -1)
        ref = reference_moe(case, x, joined.routed, ids, w) + reference_moe(case, x, joined.shared, chunks, gate)
        for mode, block in blocks.items():
            worst[mode] = max(worst[mode], rel_err(block.apply_experts(x, w, ids), ref))
    return worst


def expert_range(stack: MoeWeights, start: int, stop: int | None) -> MoeWeights:
    """Experts ``start:stop`` of ``stack`` as views."""
    views = {kind: getattr(stack, kind)[start:stop] for kind in TENSOR_FIELDS if getattr(stack, kind) is not None}
    return replace(stack, **views)


def make_blocks(case: Case, stack: MoeWeights, gate_weight: torch.Tensor) -> dict[str, MoeBlock]:
    """One MoeBlock per shared mode over one [E + C] allocation: routed experts first, the shared chunks last."""
    routed, shared = expert_range(stack, 0, case.experts), expert_range(stack, case.experts, None)
    router = torch.zeros(case.experts, case.hidden, dtype=torch.float16, device=gate_weight.device)  # unused
    spec = RouterSpec(SOFTMAX_TOPK, case.top_k, case.renormalize)
    blocks = {
        mode: MoeBlock(routed, router, spec, shared=shared, shared_gate_weight=gate_weight, shared_mode=mode)
        for mode in TIMED_MODES
    }
    if blocks[JOINED].joined is None or blocks[SEPARATE].joined is not None:
        raise RuntimeError("bench_moe: views of one allocation must join, and the separate mode must not")
    return blocks


@dataclass
class Copy:
    """One weight copy: the routed stack and, for a case with a shared expert, a MoeBlock per shared mode."""

    routed: MoeWeights
    blocks: dict[str, MoeBlock]


def make_copy(case: Case, stack: MoeWeights, gate_weight: torch.Tensor) -> Copy:
    if not case.shared_chunks:
        return Copy(stack, {})
    blocks = make_blocks(case, stack, gate_weight)
    return Copy(blocks[JOINED].routed, blocks)


def bench_case(case: Case, dtype, ms, bandwidth: float, profile: bool = False) -> list[dict]:
    """Check once, then time every M of one (case, dtype)."""
    expert_bytes = 3 * case.hidden * case.inter / 2 + 3 * case.hidden * case.inter / 128 * 2
    copies = rotation(expert_bytes * min(case.top_k, case.experts))
    gate_weight = (torch.randn(1, case.hidden, device="cuda") * 0.05).half()
    stacks = random_stack(case.experts + case.shared_chunks, case.hidden, case.inter, copies)
    weights = [make_copy(case, stack, gate_weight) for stack in stacks]
    err = check_case(case, dtype, weights[0].routed)
    block_err = check_block(case, dtype, weights[0].blocks) if case.shared_chunks else {}
    blocks_line = ", ".join(f"{e:.2e} block {mode}" for mode, e in block_err.items())
    log(f"  check {case.name} {dtype}: max rel err {err:.2e} routed {blocks_line} over M={CHECK_M}, {copies} copies")
    fp16_weights = [dequantize_all(w.routed, case.experts, dtype) for w in weights[:2]]
    rows = [bench_m(case, dtype, m, weights, fp16_weights, bandwidth, profile) for m in ms]
    for row in rows:
        row.update(check_rel_err=err, **{f"check_block_{mode}_rel_err": e for mode, e in block_err.items()})
    torch.cuda.empty_cache()
    return rows


def dequantize_all(stack, experts: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert of ``stack`` as fp16/bf16 (for the cuBLAS baseline), 8 experts at a time."""
    parts = [dequantize_experts(stack, list(range(e, min(e + 8, experts))), dtype) for e in range(0, experts, 8)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def bench_m(case: Case, dtype, m: int, weights: list[Copy], fp16_weights, bandwidth: float, profile: bool) -> dict:
    """Time routed experts (and profile them), the whole block in each shared mode and the cuBLAS baseline at one
    token count."""
    from repack.runtime.fused_moe import fused_moe, kernel_path
    from repack.runtime.kernels.routing import route

    x, logits = random_inputs(case, dtype, m, "cuda")
    routed_out, cublas_out = (torch.empty(m, case.hidden, dtype=dtype, device="cuda") for _ in range(2))

    def routed_step(i: int):
        w, ids = route(logits, case.top_k, case.renormalize)
        fused_moe(x, weights[i].routed, ids, w, out=routed_out)

    def routed():
        for i in range(len(weights)):
            routed_step(i)

    def block(mode: str):
        def run():
            for copy in weights:
                w, ids = route(logits, case.top_k, case.renormalize)
                copy.blocks[mode].apply_experts(x, w, ids)

        return run

    ids_host = torch.topk(torch.softmax(logits, -1), case.top_k).indices.cpu()
    touched = sorted(set(ids_host.flatten().tolist()))
    token_lists = [(ids_host == e).any(-1).nonzero().flatten().to("cuda") for e in touched]
    route_ws = [torch.rand(len(t), 1, device="cuda", dtype=dtype) for t in token_lists]

    def cublas():
        for w13_f, w2_f in fp16_weights:
            cublas_out.zero_()
            for e, tok, rw in zip(touched, token_lists, route_ws, strict=True):
                h = x[tok] @ w13_f[e].T
                act = torch.nn.functional.silu(h[:, : case.inter]) * h[:, case.inter :]
                cublas_out.index_add_(0, tok, (act @ w2_f[e].T) * rw)

    replays = 50 if m <= 256 else 20
    t_routed = time_graph(routed, replays) / len(weights)
    modes = TIMED_MODES if case.shared_chunks else ()
    t_block = {mode: time_graph(block(mode), replays) / len(weights) for mode in modes}
    t_cublas = time_graph(cublas, replays) / len(fp16_weights)
    launches = profile_graph(routed_step, len(weights)) if profile else []
    expert_bytes = 3 * case.hidden * case.inter / 2 + 3 * case.hidden * case.inter / 128 * 2
    floor_bytes = len(touched) * expert_bytes + 2 * m * case.hidden * 2 + m * case.experts * 4
    floor = floor_bytes / bandwidth * 1e6
    row = dict(
        case=case.name,
        dtype=str(dtype).removeprefix("torch."),
        M=m,
        kernels=kernel_path(x, weights[0].routed, case.top_k).value,
        ours_us=t_routed,
        **{f"block_{mode}_us": t for mode, t in t_block.items()},
        floor_us=floor,
        cublas_fp16_us=t_cublas,
        ours_over_floor=t_routed / floor,
        touched=len(touched),
        launches=launches,
    )
    blocks_line = " ".join(f"block {mode} {t:9.1f}" for mode, t in t_block.items())
    log(
        f"  {case.name:12s} {row['dtype']:8s} M={m:5d} ours {t_routed:9.1f} {blocks_line} floor {floor:8.1f} "
        f"({t_routed / floor:4.2f}x) cublas {t_cublas:9.1f}" + (f" | {breakdown(launches)}" if launches else "")
    )
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    """The report: one line per (case, dtype, M), with the launch breakdown when profiled."""
    lines = [
        f"# bench_moe ({meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']})",
        "",
        f"Command: `{meta['command']}`; copy bandwidth {meta['copy_bw_GBs']:.0f} GB/s. Microseconds per call; "
        "launches: device time per call of each kernel (torch.profiler over the graph replay).",
        "",
        "| case | dtype | M | kernels | ours | block joined | block separate | floor | ours/floor | cuBLAS fp16 "
        "| launches |",
        "|" + "---|" * 11,
    ]
    fmt = lambda a: f"{a:.1f}" if a is not None else "-"  # noqa: E731
    for r in rows:
        launches = "; ".join(f"{x['name']} {x['us']:.1f}" for x in r.get("launches", [])) or "-"
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['M']} | {r.get('kernels', '-')} | {r['ours_us']:.1f} | "
            f"{fmt(r.get('block_joined_us'))} | {fmt(r.get('block_separate_us'))} | {r['floor_us']:.1f} | "
            f"{r['ours_over_floor']:.2f} | {r['cublas_fp16_us']:.1f} | {launches} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"M in {M_QUICK} only")
    parser.add_argument("--profile", action="store_true", help="add the per-launch breakdown of every call")
    parser.add_argument("--out", default=os.environ.get("OUT", str(Path(__file__).parent)))
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"any of {[c.name for c in CASES]}")
    args = parser.parse_args(argv)
    import triton

    unknown = set(args.cases.split(",")) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; choose from {[c.name for c in CASES]}")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    meta = dict(
        date=datetime.date.today().isoformat(),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        command="python -m benchmarks.bench_moe " + " ".join(argv or sys.argv[1:]),
        copy_bw_GBs=bandwidth / 1e9,
    )
    log(f"{meta['gpu']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    for case in (c for c in CASES if c.name in args.cases.split(",")):
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            rows += bench_case(case, dtype, M_QUICK if args.quick else M_ALL, bandwidth, args.profile)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_moe.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / "bench_moe.md").write_text(markdown(rows, meta))
    log(markdown(rows, meta))


if __name__ == "__main__":
    main()
