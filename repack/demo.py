"""``repack demo OUT``: the whole life of a checkpoint on a tiny built-in example, with no network.

Why it exists: it is README's first command, so it must show on any machine, in well under three minutes,
that every piece works and agrees with an independent reference: write a tiny GPTQ Qwen2-MoE
(``OUT/source``), convert it (``OUT/converted``), verify it bit for bit, run each MoE block on the runtime
against a float32 block computed from the SOURCE GPTQ tensors, run the transformers drop-in (logits
against a float32 transformers model built from the source config with dequantized weights, then greedy
``generate``), preview ``repack push --dry-run`` and print a summary. Any agreement worse than the test
tolerances (or a failed verify) makes the command exit non-zero.

Device: the GPU when ``torch.cuda.is_available()``; otherwise the kernels run in Triton's interpreter,
which must be switched on before the kernel modules are imported (``repack.cli`` imports them to register
``tune``), so the demo re-runs itself as ``python -m repack.demo`` when it finds them compiled without it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, TypeVar

import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.filesize import decimal
from rich.table import Table
from safetensors import safe_open

from repack.display import plain
from repack.formats.errors import RepackError
from repack.formats.gptq import GptqLinear, GptqScheme, dequantize
from repack.preflight import check_demo_folder

BLOCK_TOLERANCE = 5e-3  # relative, runtime MoE block vs float32 source reference (tests/test_moe_block.py)
LOGIT_TOLERANCE = 1e-2  # relative, transformers logits vs float32 reference model (tests/test_hf.py)
ARGMAX_AGREEMENT = 0.95  # share of positions whose argmax matches (tests/test_hf.py)
BLOCK_TOKENS = 64
LOGIT_BATCH, LOGIT_TOKENS = 2, 32
PROMPT_TOKENS, NEW_TOKENS = 6, 8
SEED = 0
DEMO_REPO_ID = "your-org/qwen2moe-tiny-repack"
# The interpreter runs the direct decode kernels (one program per pair and N tile) about 30x slower than the
# aligned tensor-core path, so on the CPU every token count uses the aligned path: one JSON entry per shape.

T = TypeVar("T")


@dataclass
class DemoReport:
    """What the summary table shows: timings per step, sizes, agreements, and which checks failed."""

    device: str
    seconds: dict[str, float] = field(default_factory=dict)
    facts: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def timed(self, step: str, work: Callable[[], T]) -> T:
        start = time.perf_counter()
        result = work()
        self.seconds[step] = time.perf_counter() - start
        return result

    def check(self, what: str, ok: bool, detail: str) -> None:
        self.facts[what] = f"{detail} {'ok' if ok else 'FAIL'}"
        if not ok:
            self.failures.append(f"{what}: {detail}")


# ------------------------------------------------------------------------------------------- device


def interpreter_active() -> bool:
    """True when the runtime's Triton kernels were defined for the interpreter (imports them)."""
    from repack.runtime.kernels.backend import interpreter_active as kernels_interpreted

    return kernels_interpreted()


# ------------------------------------------------------------------------------------ source tensors


def read_source(folder: Path) -> tuple[dict, GptqScheme, dict[str, torch.Tensor]]:
    """(config.json, GPTQ scheme, every tensor) of the single-file source checkpoint the demo writes."""
    config = json.loads((folder / "config.json").read_text())
    quant = config["quantization_config"]
    scheme = GptqScheme(quant["bits"], quant["group_size"], quant["sym"], quant["checkpoint_format"])
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    return config, scheme, tensors


def source_weight(tensors: dict[str, torch.Tensor], module: str, scheme: GptqScheme) -> torch.Tensor:
    """float32 [out, in] weight of the source GPTQ linear ``module``, by the bit-exact GPTQ reader."""
    return dequantize(GptqLinear.from_tensors(tensors, module), scheme, torch.float32)


# ------------------------------------------------------------------------------- block reference


def source_mlp(tensors: dict[str, torch.Tensor], module: str, scheme: GptqScheme, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = (
        source_weight(tensors, f"{module}.{name}", scheme) for name in ("gate_proj", "up_proj", "down_proj")
    )
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def reference_block(
    config: dict, scheme: GptqScheme, tensors: dict[str, torch.Tensor], layer: int, x: torch.Tensor
) -> torch.Tensor:
    """float32 Qwen2-MoE block from the source: softmax top-k router, experts, sigmoid-gated shared expert."""
    block = f"model.layers.{layer}.mlp"
    probs = torch.softmax(x @ tensors[f"{block}.gate.weight"].float().t(), dim=-1)
    weights, experts = torch.topk(probs, config["num_experts_per_tok"], dim=-1)
    if config.get("norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        tokens, slot = torch.nonzero(experts == expert, as_tuple=True)
        expert_out = source_mlp(tensors, f"{block}.experts.{expert}", scheme, x[tokens])
        out.index_add_(0, tokens, weights[tokens, slot, None] * expert_out)
    shared_gate = torch.sigmoid(x @ tensors[f"{block}.shared_expert_gate.weight"].float().t())
    return out + shared_gate * source_mlp(tensors, f"{block}.shared_expert", scheme, x)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float32 (the measure every agreement test uses)."""
    expected = expected.float()
    return float((actual.float().cpu() - expected).abs().max() / expected.abs().max())


# ------------------------------------------------------------------------------- model reference


def reference_state_dict(
    names: list[str], scheme: GptqScheme, tensors: dict[str, torch.Tensor], num_experts: int
) -> dict[str, torch.Tensor]:
    """float32 values for every parameter name of the transformers model, from the source tensors."""
    state = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        if name in tensors:
            state[name] = tensors[name].float()
        elif leaf == "weight" and f"{module}.qweight" in tensors:
            state[name] = source_weight(tensors, module, scheme)
        elif leaf == "gate_up_proj":  # transformers 5 stacks experts: [E, 2 * I, H] = cat(gate, up)
            state[name] = torch.stack(
                [
                    torch.cat([source_weight(tensors, f"{module}.{j}.{p}", scheme) for p in ("gate_proj", "up_proj")])
                    for j in range(num_experts)
                ]
            )
        elif leaf == "down_proj":  # [E, H, I]
            state[name] = torch.stack(
                [source_weight(tensors, f"{module}.{j}.down_proj", scheme) for j in range(num_experts)]
            )
        else:
            raise RepackError(f"demo reference: no source tensor for parameter {name}; the demo model is broken")
    return state


def reference_model(config: dict, scheme: GptqScheme, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The source model in float32 transformers, every GPTQ weight dequantized (a reference, not a runtime)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {key: value for key, value in config.items() if key not in ("quantization_config", "model_type")}
    hf_config = AutoConfig.for_model(config["model_type"], **raw)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    names = list(model.state_dict())
    model.load_state_dict(reference_state_dict(names, scheme, tensors, config["num_experts"]), strict=True)
    return model.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------- steps


def check_block_agreement(converted: Path, source: dict, device: str, report: DemoReport, console: Console) -> None:
    """Every MoE layer's runtime block on random hidden states vs the float32 source reference."""
    from repack.runtime import load

    config, scheme, tensors = source
    ckpt = load(converted, device, torch.float16)
    generator = torch.Generator().manual_seed(SEED)
    errors = []
    for layer in ckpt.moe_layers:
        x = torch.randn(BLOCK_TOKENS, config["hidden_size"], generator=generator).half()
        actual = ckpt.moe_block(layer)(x.to(device))
        error = relative_error(actual, reference_block(config, scheme, tensors, layer, x.float()))
        errors.append(error)
        console.print(f"  layer {layer}: MoE block relative error {error:.2e} ({BLOCK_TOKENS} tokens)")
    worst = max(errors)
    report.check(
        "MoE blocks vs float32 source", worst <= BLOCK_TOLERANCE, f"max rel err {worst:.2e} <= {BLOCK_TOLERANCE:g}"
    )


def check_model_agreement(converted: Path, source: dict, device: str, report: DemoReport, console: Console):
    """transformers logits of the converted model vs the float32 reference model; returns both models."""
    from repack.runtime import load_hf_model

    config, scheme, tensors = source
    model = load_hf_model(converted, device, torch.float16)
    reference = reference_model(config, scheme, tensors)
    generator = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, config["vocab_size"], (LOGIT_BATCH, LOGIT_TOKENS), generator=generator)
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(device), use_cache=False).logits.float().cpu()
        expected = reference(input_ids=input_ids, use_cache=False).logits
    error = relative_error(logits, expected)
    agreement = float((logits.argmax(-1) == expected.argmax(-1)).float().mean())
    console.print(
        f"  logits of {LOGIT_BATCH}x{LOGIT_TOKENS} tokens: max rel err {error:.2e}, argmax match {agreement:.1%}"
    )
    report.check("logits vs float32 model", error <= LOGIT_TOLERANCE, f"max rel err {error:.2e} <= {LOGIT_TOLERANCE:g}")
    report.check("argmax match", agreement >= ARGMAX_AGREEMENT, f"{agreement:.1%} >= {ARGMAX_AGREEMENT:.0%}")
    return model, reference, input_ids


def run_generate(model, reference, input_ids: torch.Tensor, device: str, report: DemoReport, console: Console) -> None:
    """Greedy ``generate`` on the runtime; the tokens are printed next to the float reference's."""
    prompt = input_ids[:1, :PROMPT_TOKENS]
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        tokens = model.generate(prompt.to(device), **options)[0, PROMPT_TOKENS:].tolist()
        expected = reference.generate(prompt, **options)[0, PROMPT_TOKENS:].tolist()
    same = sum(a == b for a, b in zip(tokens, expected, strict=True))
    console.print(f"  prompt {prompt[0].tolist()}")
    console.print(f"  runtime   greedy {tokens}")
    console.print(f"  reference greedy {expected}  (random weights: the tokens mean nothing, the match does)")
    report.facts["greedy generate"] = f"{len(tokens)} tokens, {same}/{len(tokens)} equal to the float32 reference"


def push_preview(converted: Path, report: DemoReport, console: Console) -> None:
    """What ``repack push OUT REPO --dry-run`` prints: verified files, sizes, the model card. No network."""
    from repack.push import print_result, push_checkpoint

    result = push_checkpoint(converted, DEMO_REPO_ID, dry_run=True)
    print_result(result, console)
    report.facts["push --dry-run"] = f"{len(result.plan.files)} files would go to {DEMO_REPO_ID}"


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def summary_table(report: DemoReport) -> Table:
    table = Table(title=f"repack demo ({report.device})")
    table.add_column("what")
    table.add_column("result")
    for what, detail in report.facts.items():
        table.add_row(what, plain(detail))  # holds the folders' paths: text, not markup
    for step, seconds in report.seconds.items():
        table.add_row(f"time: {step}", f"{seconds:.1f} s")
    table.add_row("time: total", f"{sum(report.seconds.values()):.1f} s")
    return table


# ----------------------------------------------------------------------------------------- entry


def prepare_out_dir(out_dir: Path, force: bool) -> None:
    """Refuse a non-empty OUT without --force; with it, remove only what the demo writes."""
    check_demo_folder(out_dir, force)
    if out_dir.is_dir() and any(out_dir.iterdir()):
        for name in ("source", "converted"):
            shutil.rmtree(out_dir / name, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)


def run_demo(
    out_dir: Path, *, force: bool = False, generate: bool = True, console: Console | None = None
) -> DemoReport:
    """Run every step into ``out_dir``; returns the report (``report.failures`` empty when all agreed)."""
    from repack.convert import convert
    from repack.synthetic import write_demo_checkpoint
    from repack.verify import verify

    console = console or Console()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = DemoReport(
        device="GPU: " + torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton interpreter"
    )
    out_dir = Path(out_dir).expanduser().absolute()
    prepare_out_dir(out_dir, force)
    source_dir, converted = out_dir / "source", out_dir / "converted"

    console.rule("1. tiny GPTQ Qwen2-MoE (int4, group 32, act-order)")
    report.timed("write source", lambda: write_demo_checkpoint(source_dir))
    console.print(f"  {source_dir}", markup=False)
    console.rule("2. convert")
    manifest = report.timed("convert", lambda: convert(str(source_dir), converted, quiet=False, console=console))
    converted_bytes = manifest.output_bytes
    report.facts["source size"] = f"{decimal(folder_size(source_dir))} ({source_dir})"
    report.facts["converted size"] = f"{decimal(converted_bytes)} ({converted})"
    console.rule("3. verify bit for bit")
    verified = report.timed("verify", lambda: verify(converted, source=str(source_dir)))
    report.check("verify", True, f"{verified.files_checked} files, {verified.tensors_compared} tensors bit-exact")
    console.print(f"  {converted}: {report.facts['verify']} (a mismatch raises and stops the demo)", markup=False)
    source = read_source(source_dir)
    console.rule(f"4. MoE blocks on the runtime ({device}) vs float32 source")
    report.timed("MoE blocks", lambda: check_block_agreement(converted, source, device, report, console))
    console.rule("5. transformers drop-in: logits, greedy generate")
    model, reference, input_ids = report.timed(
        "logits", lambda: check_model_agreement(converted, source, device, report, console)
    )
    if generate:
        report.timed("generate", lambda: run_generate(model, reference, input_ids, device, report, console))
    console.rule("6. repack push --dry-run")
    report.timed("push --dry-run", lambda: push_preview(converted, report, console))
    console.rule("7. summary")
    console.print(summary_table(report))
    return report


def rerun_with_interpreter(out_dir: Path, force: bool, generate: bool) -> int:
    """The kernels were compiled for a GPU that is not there: run the demo again in a fresh process."""
    command = [sys.executable, "-m", "repack.demo", str(out_dir)]
    command += ["--force"] * force + ["--no-generate"] * (not generate)
    return subprocess.run(command, env=os.environ | {"TRITON_INTERPRET": "1"}, check=False).returncode


def demo_command(
    out_dir: Annotated[Path, typer.Argument(help="Folder for the demo (source/, converted/); must be empty.")],
    force: Annotated[bool, typer.Option("--force", help="Replace the files of an earlier demo in OUT_DIR.")] = False,
    generate: Annotated[
        bool, typer.Option("--generate/--no-generate", help="Run greedy generate (the slowest step on a CPU).")
    ] = True,
) -> None:
    """Write a tiny GPTQ MoE, convert, verify, run it on the runtime and transformers, preview the push."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # defines the kernels for the interpreter if not imported yet
        if not interpreter_active():
            raise typer.Exit(rerun_with_interpreter(out_dir, force, generate))
    try:
        report = run_demo(out_dir, force=force, generate=generate)
    except RepackError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        raise typer.Exit(error.exit_code) from None
    if report.failures:
        print(f"error: demo disagrees with its reference: {'; '.join(report.failures)}", file=sys.stderr)
        raise typer.Exit(1)
    print("demo ok: converted, verified and served; every agreement within the test tolerances")


def main() -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(demo_command)
    app()


if __name__ == "__main__":
    main()
