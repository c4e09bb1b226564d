"""transformers' own loader for converted checkpoints: ``AutoModelForCausalLM.from_pretrained("out/")``.

Why a quantizer: ``config.json`` says ``quant_method: "repack"``; transformers looks that name up in its
quantizer registry (``register_quantization_config`` / ``register_quantizer``) and hands us the model
skeleton, on the meta device, before any weight is read. We then make the skeleton look like the file:

1. each sparse-MoE block becomes a :class:`RepackMoeBlock` whose buffers are named exactly like the stored
   tensors (``<block>.gate.weight``, ``<block>.experts.w13_qweight``, ``<block>.shared_experts.w2_scales``...),
   so transformers' loader copies every int4 stack into place untouched and the block runs the runtime
   ``MoeBlock`` (fused Triton kernel) on them;
2. each copied-through GPTQ linear becomes a :class:`GptqPlaceholder` with buffers ``qweight``, ``qzeros``,
   ``scales`` (``g_idx``, ``bias``), swapped after loading for the Triton
   :class:`~repack.runtime.kernels.gptq_linear.GptqW4A16Linear` (same buffer names);
3. the float tensors (embeddings, norms, lm_head) load as for any model.

Every placeholder takes the dtype and shape that the safetensors headers give (read before loading: a
few KiB), so nothing is cast or dequantized and a checkpoint that disagrees with its config fails before
the weights are read. transformers' MoE weight conversions (per-expert ``*.gate_proj.weight`` fused into
``experts.gate_up_proj``) target parameters our blocks do not have and are dropped; renamings (Mixtral's
``block_sparse_moe`` -> ``mlp``) are kept.

This module imports transformers at import time; ``repack.runtime`` imports it only once transformers'
quantizer registry is being imported (see ``repack.runtime.__init__``), so ``import repack.runtime``
stays cheap. Supported: transformers 5.x.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils import logging
from transformers.utils.quantization_config import QuantizationConfigMixin

from repack.formats.errors import RepackError
from repack.formats.stacks import FORMAT_NAME, QUANT_METHOD, ROUTED, SHARED, SUPPORTED_FORMAT_VERSIONS, StackInfo
from repack.runtime.loader import TensorEntry, read_shard_layout
from repack.runtime.moe_block import ACTIVATION_DTYPES, MoeBlock
from repack.runtime.routers import DEEPSEEK_V3, RouterSpec, router_spec
from repack.runtime.weights import MoeWeights

logger = logging.get_logger(__name__)

CALLER = "from_pretrained (quant_method 'repack')"
ROUTER_WEIGHT = "gate.weight"
CORRECTION_BIAS = "gate.e_score_correction_bias"


# ------------------------------------------------------------------------------------------------ config


class RepackQuantConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` for ``quant_method: "repack"`` (formats/SPEC.md section 4).

    Every field is kept as read, so ``to_dict`` (and a saved config) returns the same dict.
    """

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)
        self.quant_method = fields.get("quant_method", QUANT_METHOD)
        if fields.get("format") != FORMAT_NAME:
            raise RepackError(
                f"config.json quantization_config: format {fields.get('format')!r} is not {FORMAT_NAME!r}; "
                "convert the source with `repack convert`"
            )
        if fields.get("format_version") not in SUPPORTED_FORMAT_VERSIONS:
            raise RepackError(
                f"config.json quantization_config: {FORMAT_NAME} format_version {fields.get('format_version')!r} "
                f"is not supported by this reader (knows {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}); upgrade "
                "moe-repack or re-convert"
            )

    def stack_infos(self) -> list[StackInfo]:
        try:
            return [StackInfo.from_json(stack) for stack in self.__dict__.get("stacks", [])]
        except TypeError as error:
            raise RepackError(
                f"config.json quantization_config.stacks: malformed stack entry ({error}); re-run `repack convert`"
            ) from None


# -------------------------------------------------------------------------------------------- placeholders


def meta_tensor(entry: TensorEntry) -> torch.Tensor:
    """An empty tensor of the stored dtype and shape: transformers' loader then copies the bytes as they are."""
    return torch.empty(entry.shape, dtype=entry.dtype, device="meta")


class StoredTensors(nn.Module):
    """A module that only holds checkpoint tensors as buffers (a router's weight, one expert stack)."""


def register_stored(root: nn.Module, relative: str, entry: TensorEntry) -> None:
    """Register ``relative`` (``experts.w13_qweight``) under ``root``, creating holder modules on the way."""
    *path, leaf = relative.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = StoredTensors()
            module.add_module(part, child)
        module = child
    module.register_buffer(leaf, meta_tensor(entry))


class RepackMoeBlock(nn.Module):
    """A sparse-MoE block whose buffers are the stored tensors, run by the runtime ``MoeBlock``.

    The runtime block is a view over this module's buffers, built on first use and dropped whenever the
    buffers move (``.to``, ``.cuda``), so it always sees the current tensors. A shared expert that the
    converter kept unstacked stays the model's own module (added here, with its sigmoid gate if any).
    """

    def __init__(
        self,
        name: str,
        spec: RouterSpec,
        routed: StackInfo,
        shared: StackInfo | None,
        float_shared: dict[str, nn.Module],
    ) -> None:
        super().__init__()
        self.name = name
        self.spec = spec
        self.routed_info = routed  # prefixes relative to this block
        self.shared_info = shared
        self.float_shared_names = tuple(float_shared)
        for module_name, module in float_shared.items():
            self.add_module(module_name, module)
        self.__dict__["_runtime"] = None  # not a submodule: it holds no tensor of its own

    def _apply(self, fn, recurse: bool = True):
        self.__dict__["_runtime"] = None
        return super()._apply(fn, recurse)

    def runtime(self) -> MoeBlock:
        """The runtime block over the current buffers (views: nothing copied)."""
        if self.__dict__["_runtime"] is None:
            tensors = dict(self.named_buffers())
            shared = MoeWeights.from_tensors(self.shared_info, tensors) if self.shared_info is not None else None
            self.__dict__["_runtime"] = MoeBlock(
                MoeWeights.from_tensors(self.routed_info, tensors),
                tensors[ROUTER_WEIGHT],
                self.spec,
                shared=shared,
                shared_gate_weight=tensors.get("shared_expert_gate.weight") if shared is not None else None,
                correction_bias=tensors.get(CORRECTION_BIAS),
                name=self.name,
            )
        return self.__dict__["_runtime"]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.runtime()(hidden_states)
        if self.float_shared_names:
            expert, *gate = (getattr(self, name) for name in self.float_shared_names)
            shared = expert(hidden_states)
            if gate:
                shared = torch.sigmoid(gate[0](hidden_states)) * shared
            out = out + shared
        return out


class GptqPlaceholder(nn.Module):
    """Where a copied-through GPTQ linear's stored tensors land; replaced after loading by the Triton linear."""

    def __init__(self, name: str, scheme, in_features: int, out_features: int) -> None:
        super().__init__()
        self.name = name
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features

    def build(self) -> nn.Module:
        from repack.formats.gptq import GptqFormatError, GptqLinear
        from repack.runtime.kernels.gptq_linear import GptqW4A16Linear

        tensors = {name: buffer for name, buffer in self.named_buffers()}
        try:
            linear = GptqW4A16Linear(GptqLinear(**tensors), self.scheme, name=self.name)
        except (GptqFormatError, TypeError) as error:
            raise RepackError(f"{self.name}: {error}; re-run `repack convert`") from None
        if (linear.in_features, linear.out_features) != (self.in_features, self.out_features):
            raise RepackError(
                f"GPTQ linear {self.name} is {linear.in_features}->{linear.out_features} but the model expects "
                f"{self.in_features}->{self.out_features}; config.json does not match the weights"
            )
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RepackError(f"{self.name}: weights were never loaded; load the model with from_pretrained")


# ----------------------------------------------------------------------------------------- model surgery


def read_headers(checkpoint_files: list[str] | None) -> dict[str, TensorEntry]:
    """Every stored tensor's name, dtype and shape, from the safetensors headers (no data read)."""
    if not checkpoint_files:
        raise RepackError(f"{CALLER}: no weight files found; pass the output folder of `repack convert`")
    entries: dict[str, TensorEntry] = {}
    for file in checkpoint_files:
        if not str(file).endswith(".safetensors"):
            raise RepackError(f"{file}: repack checkpoints are safetensors only; re-run `repack convert`")
        entries.update((entry.name, entry) for entry in read_shard_layout(Path(file)).entries)
    return entries


def group_stacks(stacks: list[StackInfo]) -> dict[str, dict[str, StackInfo]]:
    """MoE block prefix (``model.layers.3.mlp``) -> {ROUTED: info, SHARED: info}."""
    blocks: dict[str, dict[str, StackInfo]] = {}
    for info in stacks:
        blocks.setdefault(info.prefix.rpartition(".")[0], {})[info.kind] = info
    return blocks


def relative_stack(info: StackInfo, block: str) -> StackInfo:
    """The stack with its prefix relative to its block, as the block's buffers are named."""
    return replace(info, prefix=info.prefix.removeprefix(f"{block}."))


def require(headers: dict[str, TensorEntry], names: list[str], folder: str) -> None:
    for name in names:
        if name not in headers:
            raise RepackError(f"{folder}: tensor {name} is missing from the shards; re-run `repack convert`")


def install_moe_blocks(model: nn.Module, config: RepackQuantConfig, headers: dict[str, TensorEntry], folder: str):
    """Swap each sparse-MoE block for a :class:`RepackMoeBlock` with placeholders for its stored tensors."""
    from repack.runtime.integrations.hf import SHARED_EXPERT_MODULES, SHARED_GATE_MODULE, model_path, set_module

    spec = router_spec(model.config.get_text_config().to_dict())
    for block, stacks in group_stacks(config.stack_infos()).items():
        routed, shared = stacks.get(ROUTED), stacks.get(SHARED)
        if routed is None:
            raise RepackError(f"{folder}: block {block} has a shared stack but no routed one; re-run `repack convert`")
        required = routed.tensor_names() + (shared.tensor_names() if shared else []) + [f"{block}.{ROUTER_WEIGHT}"]
        if spec.method == DEEPSEEK_V3:
            required.append(f"{block}.{CORRECTION_BIAS}")
        require(headers, required, folder)
        path = model_path(model, block)
        if path is None:
            raise RepackError(
                f"{folder}: MoE block {block} has no module in {type(model).__name__}; check config.json or the "
                "transformers version (pip install 'moe-repack[hf]')"
            )
        original = model.get_submodule(path)
        stored = [name for name in headers if name.startswith(f"{block}.")]
        float_shared: dict[str, nn.Module] = {}
        if shared is None:
            for module_name in (*SHARED_EXPERT_MODULES, SHARED_GATE_MODULE):
                if any(name.startswith(f"{block}.{module_name}.") for name in stored):
                    float_shared[module_name] = getattr(original, module_name)
        shared_relative = relative_stack(shared, block) if shared is not None else None
        moe = RepackMoeBlock(block, spec, relative_stack(routed, block), shared_relative, float_shared)
        for name in stored:
            relative = name.removeprefix(f"{block}.")
            if relative.split(".", 1)[0] not in float_shared:
                register_stored(moe, relative, headers[name])
        set_module(model, path, moe)


def install_gptq_placeholders(model: nn.Module, config: RepackQuantConfig, headers: dict[str, TensorEntry], folder):
    """Swap each copied-through GPTQ linear's ``nn.Linear`` for a :class:`GptqPlaceholder`."""
    from repack.formats.quant_config import parse_quant_config
    from repack.runtime.integrations.hf import GPTQ_SUFFIXES, gptq_target, set_module

    source = getattr(config, "source_quantization_config", None)
    quant = parse_quant_config(source, f"{folder}/config.json source_quantization_config")
    for name in sorted(headers):
        if not name.endswith(".qweight"):
            continue
        module = name.removesuffix(".qweight")
        path, target = gptq_target(model, module, str(folder))
        scheme = quant.scheme_for(module) or quant.base
        placeholder = GptqPlaceholder(module, scheme, target.in_features, target.out_features)
        for suffix in GPTQ_SUFFIXES:
            if f"{module}.{suffix}" in headers:
                placeholder.register_buffer(suffix, meta_tensor(headers[f"{module}.{suffix}"]))
        set_module(model, path, placeholder)


def finish_gptq_linears(model: nn.Module) -> None:
    """Replace every loaded placeholder by the Triton GPTQ linear over the same tensors."""
    from repack.runtime.integrations.hf import set_module

    placeholders = [(path, module) for path, module in model.named_modules() if isinstance(module, GptqPlaceholder)]
    for path, placeholder in placeholders:
        set_module(model, path, placeholder.build())


def check_loaded(model: nn.Module, folder: str) -> None:
    """Every placeholder got its tensor (a renaming that sent a stored name elsewhere would leave it on meta)."""
    for path, module in model.named_modules():
        if not isinstance(module, (RepackMoeBlock, GptqPlaceholder)):
            continue
        for name, buffer in module.named_buffers(prefix=path):
            if buffer.is_meta:
                raise RepackError(f"{folder}: tensor {name} was not loaded from the shards; re-run `repack convert`")


def kernel_devices(device_map) -> set[torch.device]:
    """The devices a ``device_map`` puts weights on; "disk" offload cannot feed the kernels."""
    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    devices = set()
    for value in values:
        if value == "disk":
            raise RepackError(f"{CALLER}: device_map puts weights on 'disk'; the int4 kernels need them on a GPU")
        if isinstance(value, str) and value in ("auto", "balanced", "balanced_low_0", "sequential"):
            devices.add(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
            continue
        devices.add(torch.device(value) if not isinstance(value, int) else torch.device("cuda", value))
    return devices


def check_kernel_devices(device_map) -> None:
    """CPU weights run the kernels in the Triton interpreter only (tests); refuse early if it is off."""
    devices = kernel_devices(device_map)
    if any(device.type == "cpu" for device in devices):
        if "triton" not in sys.modules and not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import defines the kernels
        from repack.runtime.integrations.hf import check_kernel_backend

        check_kernel_backend(torch.device("cpu"), caller=CALLER)


def drop_expert_converters(weight_conversions: list, model: nn.Module) -> list:
    """Keep renamings; drop converters whose targets (e.g. ``experts.gate_up_proj``) the model no longer has."""
    from transformers.core_model_loading import WeightConverter

    keys = list(model.state_dict().keys())

    def targets_exist(converter) -> bool:
        for pattern in converter._original_target_patterns:
            try:
                if any(re.search(pattern, key) for key in keys):
                    return True
            except re.error:
                return True  # not a plain pattern: keep it, transformers knows what it means
        return False

    return [c for c in weight_conversions if not isinstance(c, WeightConverter) or targets_exist(c)]


# --------------------------------------------------------------------------------------------- quantizer


class RepackHfQuantizer(HfQuantizer):
    """Loads a repack-moe checkpoint into a transformers model that runs on the repack Triton kernels."""

    requires_calibration = True  # only pre-converted checkpoints: there is no on-the-fly path
    quantization_config: RepackQuantConfig
    folder: str = ""  # the checkpoint folder, for messages (known once the weight files are resolved)

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """The kernels take float16 or bfloat16 activations; anything else loads as float16 (with a warning)."""
        if dtype in ACTIVATION_DTYPES:
            return dtype
        logger.warning(f"repack: dtype {dtype} is not supported by the W4A16 kernels; loading with torch.float16")
        return torch.float16

    def update_device_map(self, device_map):
        """No device_map: the current GPU (the kernels are CUDA kernels), or the CPU where there is none."""
        if device_map is None:
            return {"": torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"}
        return device_map

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, device_map=None, **kwargs):
        check_kernel_devices(device_map if device_map is not None else self.update_device_map(None))
        folder = str(Path(checkpoint_files[0]).parent) if checkpoint_files else str(model.config.name_or_path)
        headers = read_headers(checkpoint_files)
        install_moe_blocks(model, self.quantization_config, headers, folder)
        install_gptq_placeholders(model, self.quantization_config, headers, folder)
        self.folder = folder
        return model

    def update_weight_conversions(self, weight_conversions, model):
        return super().update_weight_conversions(drop_expert_converters(weight_conversions, model), model)

    def _process_model_after_weight_loading(self, model, **kwargs):
        check_loaded(model, self.folder)
        finish_gptq_linears(model)
        for module in model.modules():
            if isinstance(module, RepackMoeBlock):
                module.runtime()  # shape checks now, not at the first forward
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


# ------------------------------------------------------------------------------------------ registration


def register() -> None:
    """Register the config and the quantizer under ``quant_method: "repack"`` (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(RepackQuantConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(RepackHfQuantizer)


register()  # importing this module is registering it; see repack.runtime.__init__
