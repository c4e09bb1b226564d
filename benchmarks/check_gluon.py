"""Check the Gluon sm_90 kernels against a float32 reference, then time them against the portable tl kernels.

    python benchmarks/check_gluon.py [--out DIR] [--skip-timing]

One GPU call (H100/H200). Part 1 checks every shipped Gluon config, the Gluon heuristic
($REPACK_GLUON_KERNELS=1) and the dispatcher's own choice (tuned table or heuristic, on shapes with no table) on
small random GPTQ stacks: fp16 and bf16, sym and asym, act-order, groups 32 / 64 / 128 / -1 (32 and 64 are
gptq-order stacks, which fused_moe runs on the tl kernels: checked too, and the path each case took is
recorded). Outputs are poisoned with NaN first; the limit is a relative error of 1e-3 (fp16) / 5e-3 (bf16)
against the float32 reference of the exactly dequantized weights. Part 2 times every shipped Gluon config, the
Gluon heuristic, the dispatcher's pick and the tl path on the routed layers of real model shapes (random sym
g128 weights, rotated past L2, CUDA-graph medians), next to the HBM floor. Marlin runs in the same device call
through ../shared/bench-marlin (benchmarks/RESULTS.md has the command).
Writes DIR/check_gluon.json (DIR: $OUT or benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from repack.formats.gptq import GptqScheme, dequantize
from repack.formats.sources.gptq import canonical_from_gptq
from repack.formats.stacks import ROUTED, pack_stack, stack_info
from repack.runtime.fused_moe import fused_moe, kernel_path
from repack.runtime.kernel_config import GluonTile
from repack.runtime.kernels import gluon_sm90
from repack.runtime.kernels.gluon_sm90 import GLUON_ENV, PORTABLE_ENV
from repack.runtime.kernels.routing import route
from repack.runtime.tune import random_stack, time_graph
from repack.runtime.weights import MoeWeights
from repack.synthetic_linear import quantize_linear

LIMITS = {torch.float16: 1e-3, torch.bfloat16: 5e-3}
L2_BYTES = 60 * 2**20
T0 = time.time()

# (name, scheme, act_order): the word order is what the converter writes for each (mma128 for g128 and -1).
SCHEMES = [
    ("sym-g128", GptqScheme(4, 128, True, "gptq"), False),
    ("asym-g128", GptqScheme(4, 128, False, "gptq"), False),
    ("sym-g-1", GptqScheme(4, -1, True, "gptq"), False),
    ("asym-g128-actorder", GptqScheme(4, 128, False, "gptq"), True),
    ("sym-g128-actorder", GptqScheme(4, 128, True, "gptq"), True),
    ("sym-g64", GptqScheme(4, 64, True, "gptq"), False),
    ("asym-g32-actorder", GptqScheme(4, 32, False, "gptq"), True),
]
# Routed shapes (E, top_k, H, I): the model list.
MODELS = {
    "qwen3-30b": (128, 8, 2048, 768),
    "qwen2-57b": (64, 8, 3584, 2560),
    "qwen1.5-moe": (60, 4, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "dsv2-lite": (64, 6, 2048, 1408),
    "qwen3-235b": (128, 8, 4096, 1536),
}


# Timed besides the dispatcher's pick: every shipped config and a few ring depths.
SWEEP = (
    *gluon_sm90.SHIPPED_TILES,
    GluonTile(16, 64, 1, 6),
    GluonTile(16, 128, 1, 3),
    GluonTile(64, 64, 8, 3),
)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def make_stack(experts: int, hidden: int, inter: int, scheme: GptqScheme, act_order: bool, seed: int):
    """(MoeWeights on the GPU, float32 dequantized (w13 [E, 2I, H], w2 [E, H, I]))."""
    sources, names = [], []
    for j in range(experts):
        gen = torch.Generator().manual_seed(seed + j)
        mats = [torch.randn(r, c, generator=gen) * 0.05 for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
        order_gen = seed + 7 * j  # gate and up share their act-order g_idx
        lin = [
            quantize_linear(w, scheme, act_order=act_order, generator=torch.Generator().manual_seed(order_gen + s))
            for w, s in zip(mats, (0, 0, 1), strict=True)
        ]
        sources.append(tuple(lin))
        names.append((f"e{j}.gate_proj", f"e{j}.up_proj", f"e{j}.down_proj"))
    info = stack_info("mlp.experts", ROUTED, names, sources, scheme, hidden=hidden, inter=inter)
    weights = MoeWeights.from_tensors(
        info, pack_stack(info, [tuple(canonical_from_gptq(lin, scheme) for lin in expert) for expert in sources])
    )
    weights = MoeWeights(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(weights).items()})
    w13 = torch.stack([torch.cat([dequantize(g, scheme), dequantize(u, scheme)]) for g, u, _ in sources]).cuda()
    w2 = torch.stack([dequantize(d, scheme) for _, _, d in sources]).cuda()
    return weights, (w13.float(), w2.float())


def reference(x, ids, w, w13, w2) -> torch.Tensor:
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    xf = x.float()
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = xf[tok] @ w13[e].t()
        a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (a @ w2[e].t()) * w[tok, slot][:, None])
    return out


def check_one(weights, ref_w, dtype, m: int, top_k: int, config: dict | None, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, weights.hidden_size, generator=gen, device="cuda").to(dtype)
    logits = torch.randn(m, weights.num_experts, generator=gen, device="cuda")
    w, ids = route(logits, top_k, True)
    out = torch.full_like(x, float("nan"))
    path = kernel_path(x, weights, top_k, config).value
    fused_moe(x, weights, ids, w, config=config, out=out)
    ref = reference(x, ids.long(), w.float(), *ref_w)
    finite = bool(torch.isfinite(out).all())
    err = float((out.float() - ref).norm() / ref.norm()) if finite else float("inf")
    return dict(path=path, rel_err=err, ok=finite and err <= LIMITS[dtype])


def part_checks(results: list) -> bool:
    all_ok = True
    # Small shapes: H and I multiples of 128 (mma128), I not a multiple of every BLOCK_N (masked channels).
    shapes = [(8, 3, 512, 384), (6, 2, 384, 640)]
    every = [dict(GLUON=c.to_list()) for c in gluon_sm90.SHIPPED_TILES]
    for name, scheme, act_order in SCHEMES:
        for s, (e, top_k, h, i) in enumerate(shapes):
            weights, ref_w = make_stack(e, h, i, scheme, act_order, seed=100 * s + len(name))
            for dtype in (torch.float16, torch.bfloat16):
                # Every shipped config on two variants (compiles cost ~1 s each); the dispatcher's choice on all.
                full = s == 0 and (name, dtype) in (("sym-g128", torch.float16), ("asym-g128-actorder", torch.bfloat16))
                for config in [None, GLUON_ENV, *(every if full else every[1:2])]:
                    for m in (3, 37, 300):
                        cfg = dict(config, **_tl_keys()) if isinstance(config, dict) else None
                        rec = dict(scheme=name, shape=[e, top_k, h, i], dtype=str(dtype)[6:], m=m, config=config)
                        try:
                            with _env(config if isinstance(config, str) else None):
                                rec.update(check_one(weights, ref_w, dtype, m, top_k, cfg, seed=m))
                        except Exception as exc:  # noqa: BLE001 - recorded, the rest still runs
                            rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
                        all_ok &= rec["ok"]
                        results.append(rec)
                        if not rec["ok"]:
                            log(f"FAIL {rec}")
            log(f"checked {name} {e}x{h}x{i}: {sum(r['ok'] for r in results)}/{len(results)} ok so far")
    return all_ok


def _tl_keys() -> dict:
    """What a tensor-core config needs besides GLUON (the tl path reads these where Gluon cannot run)."""
    return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=3, WEIGHT_MAJOR=True)


def copy_bandwidth() -> float:
    src = torch.empty(2**30 // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 2 / (us * 1e-6)


def _layer(xs, stacks, ids, w, cfg: dict | None, env: str | None):
    """One call over every weight copy (graph-captured as one replay), with ``env`` (a variable) set to "1"."""

    def step() -> None:
        with _env(env):
            for x, stack in zip(xs, stacks, strict=True):
                fused_moe(x, stack, ids, w, config=cfg)

    return step


@contextlib.contextmanager
def _env(name: str | None):
    if name:
        os.environ[name] = "1"
    try:
        yield
    finally:
        if name:
            os.environ.pop(name, None)


def part_timing(results: list, ms: list[int], models: list[str]) -> None:
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for key in models:
        e, top_k, h, i = MODELS[key]
        expert_bytes = 3 * h * i // 2 + 3 * h * i // 128 * 2
        copies = max(2, min(16, -(-4 * L2_BYTES // (top_k * expert_bytes))))
        stacks = random_stack(e, h, i, copies)
        for m in ms:
            gen = torch.Generator(device="cuda").manual_seed(m)
            xs = [torch.randn(m, h, generator=gen, device="cuda").half() for _ in range(copies)]
            logits = torch.randn(m, e, generator=gen, device="cuda")
            w, ids = route(logits, top_k, True)
            touched = int(ids.unique().numel())
            floor = (touched * expert_bytes + 2 * m * h * 2) / bandwidth * 1e6
            row = dict(model=key, m=m, floor_us=floor, times={})
            variants = {"dispatch": None, "tl": PORTABLE_ENV, "gluon-heuristic": GLUON_ENV}
            variants.update({f"gluon{c.block_m}x{c.block_n}s{c.stages}": c for c in SWEEP})
            for name, variant in variants.items():
                cfg = None
                if isinstance(variant, GluonTile):
                    if m * top_k <= 32:
                        continue
                    cfg = dict(_tl_keys(), GLUON=variant.to_list())

                step = _layer(xs, stacks, ids, w, cfg, None if isinstance(variant, GluonTile) else variant)
                try:
                    row["times"][name] = time_graph(step, 20) / copies
                except Exception as exc:  # noqa: BLE001
                    row["times"][name] = f"{type(exc).__name__}: {exc}"[:300]
            row["dispatch_path"] = kernel_path(xs[0], stacks[0], top_k).value
            results.append(row)
            best = min((v, k) for k, v in row["times"].items() if isinstance(v, float))
            log(f"{key} M={m}: floor {floor:.1f} us, " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} ERR" for k, v in row["times"].items()
            ) + f"; best {best[1]}")  # fmt: skip
        del stacks
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--ms", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--models", default="qwen3-30b,qwen2-57b,qwen1.5-moe")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
    log(f"{meta}")
    checks: list = []
    ok = part_checks(checks)
    log(f"checks: {sum(r['ok'] for r in checks)}/{len(checks)} ok")
    timing: list = []
    (out / "check_gluon.json").write_text(json.dumps(dict(meta=meta, checks=checks), indent=1))
    if not args.skip_timing:
        part_timing(timing, [int(m) for m in args.ms.split(",")], args.models.split(","))
    (out / "check_gluon.json").write_text(json.dumps(dict(meta=meta, checks=checks, timing=timing), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
