"""Everything of vLLM the plugin relies on, per tested version, and the few internal attributes it touches.

vLLM has no public way for a quantization method to (1) read the routing settings its experts layer was built
with, or (2) hand the runner a shared-expert output it computed itself (the joined launch, moe.py). Each such
access goes through :func:`vllm_attribute`, so a vLLM that renamed one fails with the plugin's version line
(:func:`~repack.runtime.integrations.vllm.unsupported_vllm`) instead of an AttributeError deep inside, or worse, a
silently different default.

What is touched (vLLM 0.26 and 0.32 alike, read in both sources):

- ``RoutedExperts.moe_config``, ``.routed_scaling_factor``, ``.e_score_correction_bias``: public attributes of
  the experts layer (config.py, moe.py).
- ``SharedExperts._layer`` (the model's shared-expert module, for Qwen2-MoE's ``expert_gate``),
  ``SharedExperts._output`` and ``SharedExperts._output_idx`` (the slot the runner reads the shared term from):
  private; vLLM's own modular kernels fill that slot by running ``_layer``, which the plugin must not do (the
  stacked shared expert's linears have no weights of their own).
- ``torch.ops._C.cpu_gemm_wna16``: the op vLLM's CPU GPTQ linear kernel calls (:func:`vllm_cpu_gptq_kernel_loaded`).
- Where vLLM takes a quantization config's renames of checkpoint tensors (the stacks reach their parameters
  through them, moe.py): 0.32's ``AutoWeightsLoader`` calls ``get_checkpoint_weight_mapper``; 0.26 has no such
  hook, and the one mapper its loader takes from the config at that very place is ``get_cache_scale_mapper``
  (:func:`vllm_takes_checkpoint_weight_mapper`).

:data:`VLLM_API` lists every name per tested version; :func:`missing_vllm_api` resolves them against the vLLM
installed (tests/vllm on 0.32, tests/gpu/vllm_agreement.py's preflight on 0.26), and tests/runtime builds stand-in
vLLM modules from each version's list and imports the plugin against them.
"""

from __future__ import annotations

import torch

from repack.runtime.integrations.vllm import installed_vllm_version, unsupported_vllm

CPU_GPTQ_OP = "cpu_gemm_wna16"  # what vLLM's CPUWNA16LinearKernel runs; only the AVX-512 build of _C registers it
CHECKPOINT_MAPPER_HOOK = "get_checkpoint_weight_mapper"

# "module" is a module; "module:Name" a module attribute; "module:Class.name" a class attribute or method, or an
# attribute every instance gets in the class's ``__init__`` (read from its source).
_FUSED_MOE = "vllm.model_executor.layers.fused_moe"
_QUANTIZATION = "vllm.model_executor.layers.quantization"
_BASE_CONFIG = f"{_QUANTIZATION}.base_config:QuantizationConfig"
_METHOD_BASE = f"{_FUSED_MOE}:FusedMoEMethodBase"
_COMMON_API = (
    "vllm",
    "vllm:__version__",
    f"{_QUANTIZATION}:register_quantization_config",
    f"{_BASE_CONFIG}",
    f"{_BASE_CONFIG}.get_cache_scale_mapper",
    f"{_BASE_CONFIG}.maybe_update_config",
    f"{_BASE_CONFIG}.get_quant_method",
    f"{_BASE_CONFIG}.packed_modules_mapping",
    f"{_QUANTIZATION}.base_config:QuantizeMethodBase",
    f"{_QUANTIZATION}.auto_gptq:AutoGPTQConfig",
    f"{_QUANTIZATION}.auto_gptq:AutoGPTQConfig.from_config",
    f"{_QUANTIZATION}.auto_gptq:AutoGPTQLinearMethod",
    f"{_FUSED_MOE}:RoutedExperts",
    f"{_FUSED_MOE}:RoutedExperts.moe_config",
    f"{_FUSED_MOE}:RoutedExperts.routed_scaling_factor",
    f"{_FUSED_MOE}:RoutedExperts.e_score_correction_bias",
    f"{_FUSED_MOE}:SharedExperts._layer",
    f"{_FUSED_MOE}:SharedExperts._output",
    f"{_FUSED_MOE}:SharedExperts._output_idx",
    f"{_FUSED_MOE}:FusedMoEConfig",
    f"{_METHOD_BASE}",
    f"{_METHOD_BASE}.create_weights",
    f"{_METHOD_BASE}.process_weights_after_loading",
    f"{_METHOD_BASE}.get_fused_moe_quant_config",
    f"{_METHOD_BASE}.apply",
    f"{_METHOD_BASE}.apply_monolithic",
    f"{_METHOD_BASE}.is_monolithic",
    f"{_METHOD_BASE}.mk_can_overlap_shared_experts",
    "vllm.model_executor.layers.linear:LinearBase",
    "vllm.model_executor.layers.linear:LinearMethodBase",
    "vllm.model_executor.layers.linear:UnquantizedLinearMethod",
    "vllm.model_executor.layers.linear:register_weight_loader_v2_supported_method",
    "vllm.model_executor.parameter:GroupQuantScaleParameter",
    "vllm.model_executor.parameter:PackedvLLMParameter",
    "vllm.model_executor.models.utils:WeightsMapper",
    "vllm.transformers_utils.config:get_safetensors_params_metadata",
    "vllm.config:get_current_vllm_config",
    "vllm.platforms:current_platform",
    "vllm._custom_ops",
)
VLLM_API: dict[tuple[int, int], tuple[str, ...]] = {
    (0, 26): _COMMON_API,
    (0, 32): (*_COMMON_API, f"{_BASE_CONFIG}.{CHECKPOINT_MAPPER_HOOK}"),
}


def missing_vllm_api(version: tuple[int, int]) -> list[str]:
    """The names of ``VLLM_API[version]`` the installed vLLM lacks (empty: all resolve)."""
    return [name for name in VLLM_API[version] if not _resolves(name)]


def _resolves(name: str) -> bool:
    import importlib
    import inspect

    module_name, _, path = name.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return False
    if not path:
        return True
    head, _, attribute = path.partition(".")
    owner = getattr(owner, head, None)
    if owner is None or not attribute or hasattr(owner, attribute):
        return owner is not None
    try:  # an attribute each instance gets in __init__
        source = inspect.getsource(owner.__init__)
    except (OSError, TypeError):
        return False
    return f"self.{attribute} =" in source or f"self.{attribute}:" in source


def vllm_takes_checkpoint_weight_mapper() -> bool:
    """Whether vLLM's weight loader takes a quantization config's checkpoint renames from
    ``get_checkpoint_weight_mapper`` (0.32); 0.26 takes only ``get_cache_scale_mapper``, at the same place."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    return hasattr(QuantizationConfig, CHECKPOINT_MAPPER_HOOK)


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
