"""One GPU, one rank's MoE at its shard shapes against the unsharded MoE (issue 20's single-GPU part).

Qwen3-235B-A22B's MoE shapes (E=128, top-8, H=4096, I=1536; 4-bit, group 128, symmetric, the mma128 word order
the converter writes for them), random GPTQ words and small random scales, on the GPU. For tensor parallelism
(2 ranks: I=768 each) and expert parallelism (2 ranks: 64 experts each plus the zero expert that takes the pairs
routed to the other rank), each rank's tensors are cut from the full stack exactly as the vLLM plugin cuts them
(runtime/integrations/vllm/sharding.py: ``StackShard``), each rank's MoE runs on the same tokens and routing (the
plugin's id map for expert parallelism), and the ranks' outputs must sum to the unsharded ``fused_moe`` within
the tolerance (what vLLM's all-reduce would add). Also timed: the unsharded call and one rank's, per batch size
(CUDA events; the kernel family each takes).

    python3 -m tests.gpu.shard_check [--small] [--budget-s 90]      # --small: tiny shapes (CPU dry run)

Prints one PASS/FAIL row per (layout, M) and writes ``$OUT/shard_check.json`` as each row comes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the CPU dry run: kernels in Triton's interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from repack.formats.stacks import MMA128_ORDER, ROUTED, StackInfo  # noqa: E402
from repack.runtime.fused_moe import fused_moe, kernel_path  # noqa: E402
from repack.runtime.integrations.vllm.sharding import plan_shard  # noqa: E402
from repack.runtime.kernels.routing import route  # noqa: E402
from repack.runtime.weights import MoeWeights  # noqa: E402

QWEN3_235B = {"num_experts": 128, "top_k": 8, "hidden_size": 4096, "intermediate_size": 1536}
SMALL = {"num_experts": 8, "top_k": 2, "hidden_size": 256, "intermediate_size": 256}
BATCHES = (1, 16, 256)
SMALL_BATCHES = (1, 5)
RANKS = 2
TOLERANCE = 1e-2  # relative to the largest |output|: fp16 partial sums rounded once more per rank
START = time.monotonic()


def log(*parts) -> None:
    print(f"[shard-check {time.monotonic() - START:6.1f}s]", *parts, flush=True)


def random_stack(sizes: dict, device: str) -> tuple[StackInfo, dict[str, torch.Tensor]]:
    """A routed stack of random 4-bit words and scales ~ 1/(8 sqrt(K)), so outputs stay well inside fp16."""
    e, h, i = sizes["num_experts"], sizes["hidden_size"], sizes["intermediate_size"]
    info = StackInfo(
        prefix="model.layers.0.mlp.experts",
        kind=ROUTED,
        num_experts=e,
        hidden_size=h,
        intermediate_size=i,
        bits=4,
        group_size=128,
        sym=True,
        checkpoint_format="gptq",
        act_order_w13=False,
        act_order_w2=False,
        has_g_idx=False,
        source_modules=[[f"e{j}.gate_proj", f"e{j}.up_proj", f"e{j}.down_proj"] for j in range(e)],
        word_order=MMA128_ORDER,
    )
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, (shape, dtype) in info.tensor_shapes().items():
        if dtype == "int32":
            tensors[name] = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device, generator=gen)
        else:
            k = h if ".w13_" in name else i
            scale = 1.0 / (8 * k**0.5)
            tensors[name] = (torch.rand(shape, device=device, generator=gen) * scale + scale / 2).half()
    return info, tensors


def time_call(fn, device: str, reps: int) -> float | None:
    """Median microseconds of ``fn()`` over ``reps`` runs on the GPU (CUDA events); None on the CPU."""
    if device != "cuda":
        return None
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return round(sorted(times)[len(times) // 2], 1)


def check(sizes: dict, batches: tuple[int, ...], device: str, budget_s: float, out: Path) -> list[dict]:
    info, tensors = random_stack(sizes, device)
    full = MoeWeights.from_tensors(info, tensors)
    layouts = {
        "tp2": [plan_shard(info, tp=(rank, RANKS)) for rank in range(RANKS)],
        "ep2": [
            plan_shard(
                info,
                experts=list(range(r * info.num_experts // RANKS, (r + 1) * info.num_experts // RANKS)),
                ep_size=RANKS,
            )
            for r in range(RANKS)
        ],  # fmt: skip
    }
    ranks = {
        layout: [(shard, MoeWeights.from_tensors(shard.local, shard.rank_tensors(tensors))) for shard in shards]
        for layout, shards in layouts.items()
    }
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for m in batches:
        x = torch.randn(m, info.hidden_size, device=device, generator=gen).half()
        logits = torch.randn(m, info.num_experts, device=device, generator=gen)
        topk_weights, topk_ids = route(logits, sizes["top_k"], True)
        whole = fused_moe(x, full, topk_ids, topk_weights)
        whole_us = time_call(lambda: fused_moe(x, full, topk_ids, topk_weights), device, 20)  # noqa: B023
        for layout, parts in ranks.items():
            if time.monotonic() - START > budget_s:
                rows.append({"layout": layout, "m": m, "ok": False, "note": "not run: budget spent"})
                continue
            total = torch.zeros_like(whole, dtype=torch.float32)
            rank_us = None
            for index, (shard, weights) in enumerate(parts):
                id_map = shard.id_map(device)
                ids = topk_ids if id_map is None else id_map[topk_ids.long()]
                total += fused_moe(x, weights, ids, topk_weights).float()
                if index == 0:
                    rank_us = time_call(lambda: fused_moe(x, weights, ids, topk_weights), device, 20)  # noqa: B023
            scale = float(whole.float().abs().max())
            relative = float((total - whole.float()).abs().max()) / scale
            row = {
                "layout": layout,
                "m": m,
                "ok": bool(scale > 0 and relative <= TOLERANCE and torch.isfinite(total).all()),
                "relative": relative,
                "max_abs_out": scale,
                "whole_us": whole_us,
                "rank0_us": rank_us,
                "kernels_whole": kernel_path(x, full, sizes["top_k"]).value,
                "kernels_rank0": kernel_path(x, parts[0][1], sizes["top_k"]).value,
                "rank0_shape": {"experts": parts[0][1].num_experts, "I": parts[0][1].intermediate_size},
            }
            rows.append(row)
            log(f"{layout} M={m}: {'PASS' if row['ok'] else 'FAIL'} relative {relative:.1e}, whole {whole_us} us, "
                f"rank 0 {rank_us} us ({row['kernels_rank0']})")  # fmt: skip
            out.write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))
    return rows


def table(sizes: dict, rows: list[dict]) -> str:
    lines = [
        f"shard check: E={sizes['num_experts']}, top-{sizes['top_k']}, H={sizes['hidden_size']}, "
        f"I={sizes['intermediate_size']}, 2 ranks (tolerance {TOLERANCE:.0e} relative)",
        "| layout | M | result | rel. err | whole us | rank 0 us | rank 0 shape | kernels (whole / rank 0) | note |",
        "|---|---:|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        err = f"{r['relative']:.1e}" if "relative" in r else "-"
        lines.append(
            f"| {r['layout']} | {r['m']} | {'PASS' if r['ok'] else 'FAIL'} | {err} | {r.get('whole_us')} | "
            f"{r.get('rank0_us')} | {r.get('rank0_shape', '-')} | {r.get('kernels_whole', '-')} / "
            f"{r.get('kernels_rank0', '-')} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU dry run in Triton's interpreter)")
    parser.add_argument("--budget-s", type=float, default=90.0, help="no new row starts after this many seconds")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="shard-check-"))
    sizes, batches = (SMALL, SMALL_BATCHES) if args.small else (QWEN3_235B, BATCHES)
    rows = check(sizes, batches, device, args.budget_s, out_dir / "shard_check.json")
    print(table(sizes, rows))
    passed = bool(rows) and all(r["ok"] for r in rows)
    print("ALL PASS" if passed else "SOME FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
