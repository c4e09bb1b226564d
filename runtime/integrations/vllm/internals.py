"""The few attributes of vLLM's internal layer objects the plugin reads or writes, in one place.

vLLM 0.32 has no public way for a quantization method to (1) read the routing settings its experts layer was
built with, or (2) hand the runner a shared-expert output it computed itself (the joined launch, moe.py). Each
such access goes through :func:`vllm_attribute`, so a vLLM that renamed one fails with the plugin's version-range
line (:func:`~repack.runtime.integrations.vllm.unsupported_vllm`) instead of an AttributeError deep inside, or
worse, a silently different default.

What is touched (vLLM 0.32):

- ``RoutedExperts.moe_config``, ``.routed_scaling_factor``, ``.e_score_correction_bias``: public attributes of
  the experts layer (config.py, moe.py).
- ``SharedExperts._layer`` (the model's shared-expert module, for Qwen2-MoE's ``expert_gate``),
  ``SharedExperts._output`` and ``SharedExperts._output_idx`` (the slot the runner reads the shared term from):
  private; vLLM's own modular kernels fill that slot by running ``_layer``, which the plugin must not do (the
  stacked shared expert's linears have no weights of their own).
- ``torch.ops._C.cpu_gemm_wna16``: the op vLLM's CPU GPTQ linear kernel calls (:func:`vllm_cpu_gptq_kernel_loaded`).
"""

from __future__ import annotations

import torch

from repack.runtime.integrations.vllm import installed_vllm_version, unsupported_vllm

CPU_GPTQ_OP = "cpu_gemm_wna16"  # what vLLM's CPUWNA16LinearKernel runs; only the AVX-512 build of _C registers it


def vllm_attribute(owner: object, name: str):
    """``owner.name`` of a vLLM object; missing means an untested vLLM: the version-range RepackError."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise unsupported_vllm(installed_vllm_version(), f"{type(owner).__name__} has no '{name}'") from None


def shared_expert_module(shared_experts) -> torch.nn.Module:
    """The model's shared-expert module that vLLM's ``SharedExperts`` wraps."""
    return vllm_attribute(shared_experts, "_layer")


def hand_shared_output(shared_experts, value: torch.Tensor) -> None:
    """Put ``value`` where vLLM's runner reads the shared-expert term it adds to the experts' output."""
    slots = vllm_attribute(shared_experts, "_output")
    slots[vllm_attribute(shared_experts, "_output_idx")] = value


def vllm_cpu_gptq_kernel_loaded() -> bool:
    """Whether vLLM's GPTQ linear can run on this host: off the CPU, yes (vLLM's own kernel choice decides there);
    on the CPU build, only where its op library has ``cpu_gemm_wna16``.

    vllm-cpu loads ``_C`` (built for AVX-512) or, on a CPU without AVX-512, ``_C_AVX2``, which lacks that op; its
    ``AutoGPTQLinearMethod`` still picks ``CPUWNA16LinearKernel`` there and the first forward fails. The op library
    is loaded with vLLM's CPU platform (``vllm._custom_ops``), before any model is built."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    import vllm._custom_ops  # noqa: F401  (loads the op library this host's CPU build uses)

    return hasattr(torch.ops._C, CPU_GPTQ_OP)
