"""The transformers integration: a converted checkpoint as a ``*ForCausalLM`` whose MoE and GPTQ layers run on our
kernels, through either door:

- ``repack.runtime.load_hf_model(folder)``: :func:`repack.runtime.load` puts every tensor on the device exactly
  as stored, the model skeleton is built from ``config.json`` with its parameters on the meta device (no random
  init of 57B parameters), and the loaded tensors are placed into it;
- ``AutoModelForCausalLM.from_pretrained(folder)`` once ``repack`` is imported: ``config.json`` says
  ``quant_method: "repack"``, transformers finds :class:`RepackHfQuantizer` in its quantizer registry and hands
  it the skeleton before any weight is read; the same modules are installed with meta buffers shaped from the
  safetensors headers (a few KiB), and transformers' own loader copies the stored bytes into them.

Both doors make the skeleton look like the file the same way:

1. each sparse-MoE block becomes a :class:`RepackMoeBlock` whose buffers are named exactly like the stored tensors
   (``gate.weight``, ``experts.w13_qweight``, ``shared_experts.w2_scales``...) and which runs the runtime
   ``MoeBlock`` (fused Triton kernel) over them; a shared expert the converter kept in float stays the model's
   own module inside it (:data:`SHARED_EXPERT_MODULES`, added to the output with its sigmoid gate if any);
2. each copied-through GPTQ linear becomes the Triton
   :class:`~repack.runtime.kernels.gptq_linear.GptqW4A16Linear` over the stored int4 tensors (the quantizer door
   first installs a :class:`GptqPlaceholder` with the same buffer names);
3. the float tensors (embeddings, norms, lm_head) are the model's parameters.

Nothing is cast or dequantized but the float tensors; a checkpoint that disagrees with its config is a one-line
:class:`RepackError`. Where the kernels run (GPU, or the Triton interpreter on a CPU) is runtime/kernels/backend.py's
choice. Importing this module imports transformers (seconds) but not triton: ``repack.runtime`` imports it only
when transformers' quantizer registry is imported (``repack.runtime.__init__``) or ``load_hf_model`` is called.
Supported: transformers 5.x (MoE blocks return one tensor).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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

from repack.formats.checkpoint import TensorEntry, read_safetensors_header
from repack.formats.errors import RepackError
from repack.formats.families import BLOCK_ALIASES, SHARED_EXPERT_MODULES, SHARED_GATE_MODULES
from repack.formats.gptq import GptqFormatError, GptqLinear
from repack.formats.quant_config import dense_linear_config, parse_quant_config
from repack.formats.stacks import (
    ACTIVATION_DTYPES,
    FORMAT_NAME,
    QUANT_METHOD,
    ROUTED,
    SHARED,
    SUPPORTED_FORMAT_VERSIONS,
    StackInfo,
    StackInfoError,
)
from repack.runtime.kernels.backend import check_kernel_backend
from repack.runtime.loader import load
from repack.runtime.moe_block import MoeBlock
from repack.runtime.routers import DEEPSEEK_V3, RouterSpec, router_spec

logger = logging.get_logger(__name__)

FROM_PRETRAINED = "from_pretrained (quant_method 'repack')"
ROUTER_WEIGHT = "gate.weight"
CORRECTION_BIAS = "gate.e_score_correction_bias"
SOURCE_MODULE_ALIASES = BLOCK_ALIASES  # checkpoint block names -> transformers 5 names (formats/families.py)
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


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
        except StackInfoError as error:
            raise RepackError(
                f"config.json quantization_config.stacks: malformed stack entry ({error}); re-run `repack convert`"
            ) from None


# -------------------------------------------------------------------------------------------- the modules


class StoredTensors(nn.Module):
    """A module that only holds checkpoint tensors as buffers (a router's weight, one expert stack)."""


def register_stored(root: nn.Module, relative: str, tensor: torch.Tensor) -> None:
    """Register ``relative`` (``experts.w13_qweight``) under ``root``, creating holder modules on the way."""
    *path, leaf = relative.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = StoredTensors()
            module.add_module(part, child)
        module = child
    module.register_buffer(leaf, tensor)


class RepackMoeBlock(nn.Module):
    """A sparse-MoE block whose buffers are the stored tensors, run by the runtime ``MoeBlock``.

    The runtime block is a view over this module's buffers, built on first use and dropped whenever the
    buffers move (``.to``, ``.cuda``), so it always sees the current tensors. A shared expert that the
    converter kept in float stays the model's own module (added here, with its sigmoid gate if any).
    Returns one tensor ``[..., H]``, as transformers 5's MoE blocks do.
    """

    def __init__(
        self,
        name: str,
        spec: RouterSpec,
        routed: StackInfo,
        shared: StackInfo | None,
        float_shared: dict[str, nn.Module],
        shared_mode: str | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.spec = spec
        self.routed_info = routed  # prefixes relative to this block
        self.shared_info = shared
        self.shared_mode = shared_mode
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
            self.__dict__["_runtime"] = MoeBlock.from_tensors(
                tensors, self.routed_info, self.shared_info, self.spec, where=self.name, shared_mode=self.shared_mode
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
        return gptq_linear(self.name, dict(self.named_buffers()), self.scheme, self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RepackError(f"{self.name}: weights were never loaded; load the model with from_pretrained")


def gptq_linear(name: str, tensors: dict[str, torch.Tensor], scheme, in_features: int, out_features: int):
    """The Triton GPTQ linear over a module's stored tensors, checked against the nn.Linear it replaces."""
    from repack.runtime.kernels.gptq_linear import GptqW4A16Linear  # imports triton: only once a model is built

    try:
        linear = GptqW4A16Linear(GptqLinear(**tensors), scheme, name=name)
    except (GptqFormatError, TypeError) as error:  # TypeError: a missing or unexpected GPTQ tensor
        raise RepackError(f"{name}: {error}; re-run `repack convert`") from None
    if (linear.in_features, linear.out_features) != (in_features, out_features):
        raise RepackError(
            f"GPTQ linear {name} is {linear.in_features}->{linear.out_features} but the model expects "
            f"{in_features}->{out_features}; config.json does not match the weights"
        )
    return linear


# ----------------------------------------------------------------------------------------- model surgery


def model_path(model: nn.Module, name: str, kind: str = "module") -> str | None:
    """The model's name for checkpoint name ``name`` (trying the source-name aliases), or None."""
    dotted = name + "."  # so an alias also matches the last component (a block path ends in ``block_sparse_moe``)
    candidates = [name] + [dotted.replace(old, new)[:-1] for old, new in SOURCE_MODULE_ALIASES if old in dotted]
    lookup = model.get_submodule if kind == "module" else _get_tensor(model)
    for candidate in candidates:
        try:
            lookup(candidate)
        except AttributeError:
            continue
        return candidate
    return None


def _get_tensor(model: nn.Module):
    def lookup(name: str) -> torch.Tensor:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if leaf in module._parameters or leaf in module._buffers:
            return getattr(module, leaf)
        raise AttributeError(name)

    return lookup


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def group_stacks(stacks: list[StackInfo]) -> dict[str, dict[str, StackInfo]]:
    """MoE block prefix (``model.layers.3.mlp``) -> {ROUTED: info, SHARED: info}."""
    blocks: dict[str, dict[str, StackInfo]] = {}
    for info in stacks:
        blocks.setdefault(info.prefix.rpartition(".")[0], {})[info.kind] = info
    return blocks


def relative_stack(info: StackInfo, block: str) -> StackInfo:
    """The stack with its prefix relative to its block, as the block's buffers are named."""
    return replace(info, prefix=info.prefix.removeprefix(f"{block}."))


def install_moe_blocks(
    model: nn.Module,
    stacks: list[StackInfo],
    stored: Mapping[str, torch.Tensor],
    folder: str,
    shared_mode: str | None = None,
) -> set[str]:
    """Swap each sparse-MoE block for a :class:`RepackMoeBlock` holding its ``stored`` tensors (the loaded ones,
    or meta tensors of their dtype and shape for transformers' loader to fill); returns the names it took."""
    spec = router_spec(model.config.get_text_config().to_dict())
    taken: set[str] = set()
    for block, kinds in group_stacks(stacks).items():
        routed, shared = kinds.get(ROUTED), kinds.get(SHARED)
        if routed is None:
            raise RepackError(f"{folder}: block {block} has a shared stack but no routed one; re-run `repack convert`")
        required = routed.tensor_names() + (shared.tensor_names() if shared else []) + [f"{block}.{ROUTER_WEIGHT}"]
        if spec.method == DEEPSEEK_V3:
            required.append(f"{block}.{CORRECTION_BIAS}")
        missing = [name for name in required if name not in stored]
        if missing:
            raise RepackError(f"{folder}: tensor {missing[0]} is missing from the shards; re-run `repack convert`")
        path = model_path(model, block)
        if path is None:
            raise RepackError(
                f"{folder}: MoE block {block} has no module in {type(model).__name__}; check config.json or the "
                "transformers version (pip install 'moe-repack[hf]')"
            )
        original = model.get_submodule(path)
        names = [name for name in stored if name.startswith(f"{block}.")]
        float_shared: dict[str, nn.Module] = {}
        if shared is None:
            for module_name in (*SHARED_EXPERT_MODULES, *SHARED_GATE_MODULES):
                if any(name.startswith(f"{block}.{module_name}.") for name in names):
                    float_shared[module_name] = getattr(original, module_name)
        shared_relative = relative_stack(shared, block) if shared is not None else None
        moe = RepackMoeBlock(block, spec, relative_stack(routed, block), shared_relative, float_shared, shared_mode)
        for name in names:
            relative = name.removeprefix(f"{block}.")
            if relative.split(".", 1)[0] not in float_shared:
                register_stored(moe, relative, stored[name])
                taken.add(name)
        set_module(model, path, moe)
    return taken


def gptq_modules(stored: Mapping[str, torch.Tensor], taken: set[str]) -> list[str]:
    """The copied-through GPTQ linears (modules with a stored ``qweight`` no MoE block took), sorted."""
    return sorted(n.removesuffix(".qweight") for n in stored if n.endswith(".qweight") and n not in taken)


def gptq_target(model: nn.Module, module: str, where: str) -> tuple[str, nn.Linear]:
    """(module path in ``model``, the nn.Linear it holds) for the GPTQ linear stored as ``module``."""
    path = model_path(model, module)
    target = model.get_submodule(path) if path is not None else None
    if not isinstance(target, nn.Linear):
        raise RepackError(
            f"{where}: GPTQ linear {module} has no nn.Linear in {type(model).__name__}; check config.json or the "
            "transformers version (pip install 'moe-repack[hf]')"
        )
    return path, target


def install_gptq_linears(
    model: nn.Module, source_quant: dict | None, stored: Mapping[str, torch.Tensor], taken: set[str], folder: str
) -> set[str]:
    """Swap each copied-through GPTQ linear's ``nn.Linear`` for the Triton GPTQ linear over its stored tensors, or
    for a :class:`GptqPlaceholder` when they are meta tensors still to be loaded; returns the names it took."""
    quant = parse_quant_config(source_quant, f"{folder}/config.json quantization_config (its GPTQ linears)")
    used: set[str] = set()
    for module in gptq_modules(stored, taken):
        tensors = {suffix: stored[f"{module}.{suffix}"] for suffix in GPTQ_SUFFIXES if f"{module}.{suffix}" in stored}
        if "qzeros" not in tensors or "scales" not in tensors:
            missing = "qzeros" if "qzeros" not in tensors else "scales"
            raise RepackError(f"{folder}: tensor {module}.{missing} is missing; re-run `repack convert`")
        scheme = quant.scheme_for(module) or quant.base
        path, target = gptq_target(model, module, folder)
        if tensors["qweight"].is_meta:
            placeholder = GptqPlaceholder(module, scheme, target.in_features, target.out_features)
            for suffix, tensor in tensors.items():
                placeholder.register_buffer(suffix, tensor)
            set_module(model, path, placeholder)
        else:
            set_module(model, path, gptq_linear(module, tensors, scheme, target.in_features, target.out_features))
        used.update(f"{module}.{suffix}" for suffix in tensors)
    return used


# ------------------------------------------------------------------------------- door 1: load_hf_model


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay real.

    Modules create their parameters with ``torch.empty`` (no page is touched) and initialise them after
    registering them, so initialisation then runs on meta tensors and costs nothing.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def hf_config(config: dict, folder: Path):
    """The transformers config of the converted model, without our quantization_config."""
    from transformers import AutoConfig

    raw = {key: value for key, value in config.items() if key != "quantization_config"}
    model_type = raw.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **raw)
    except Exception as error:  # transformers' validators raise several types; all mean a bad config.json
        cause = " ".join(str(error).split()) or type(error).__name__
        raise RepackError(
            f"{folder / 'config.json'}: transformers cannot build a {model_type!r} config ({cause}); fix "
            "config.json or install a supported transformers (pip install 'moe-repack[hf]')"
        ) from None


def build_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The ``*ForCausalLM`` with parameters on meta and real buffers, in eval mode."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def attach_float_tensors(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], taken: set[str], dtype: torch.dtype, folder: Path
) -> None:
    """Every remaining checkpoint tensor becomes the model's parameter of that name, in ``dtype``."""
    for name, tensor in tensors.items():
        if name in taken or IGNORED_TENSORS.search(name):
            continue
        path = model_path(model, name, kind="tensor")
        if path is None:
            raise RepackError(
                f"{folder}: tensor {name} has no place in {type(model).__name__}; the checkpoint does not "
                "match config.json (re-run `repack convert`)"
            )
        module_name, _, leaf = path.rpartition(".")
        module = model.get_submodule(module_name)
        current = getattr(module, leaf)
        if tuple(current.shape) != tuple(tensor.shape):
            raise RepackError(
                f"{folder}: tensor {name} has shape {list(tensor.shape)}, the model expects "
                f"{list(current.shape)}; config.json does not match the weights"
            )
        value = tensor.to(dtype) if tensor.is_floating_point() else tensor
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[leaf] = value


def check_complete(model: nn.Module, folder: Path) -> None:
    """After tying, no parameter may still be on meta: that would be a tensor the file lacks."""
    for name, param in model.named_parameters():
        if param.is_meta:
            raise RepackError(f"{folder}: tensor {name} is missing from the checkpoint; re-run `repack convert`")


def attach_generation_config(model: nn.Module, folder: Path) -> None:
    """Use the checkpoint's generation_config.json (eos, sampling defaults) when it has one."""
    if not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(folder)


def load_hf_model(
    path: str | os.PathLike,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.float16,
    *,
    shared_mode: str | None = None,
) -> nn.Module:
    """A transformers ``*ForCausalLM`` for a converted checkpoint, running on the repack kernels.

    ``generate`` and ``forward`` work as for any transformers model. The int4 weights stay int4 on
    ``device`` (loaded once by :func:`repack.runtime.load`, exactly as stored); only the float tensors of
    the file are cast to ``dtype`` (float16 or bfloat16). ``device='cpu'`` runs the Triton interpreter
    (tests only; slow). ``shared_mode`` is how the MoE blocks run a stacked shared expert (see
    :func:`repack.runtime.load`; None takes ``runtime.moe_block.DEFAULT_SHARED_MODE``).
    """
    device = torch.device(device)
    check_kernel_backend(device, "load_hf_model")
    ckpt = load(path, device, dtype, shared_mode=shared_mode)
    model = build_skeleton(hf_config(ckpt.config, ckpt.path), dtype)
    folder = str(ckpt.path)
    taken = install_moe_blocks(model, ckpt.stacks, ckpt.tensors, folder, ckpt.shared_mode)
    linear_quant = dense_linear_config(ckpt.config.get("quantization_config") or {})
    taken |= install_gptq_linears(model, linear_quant, ckpt.tensors, taken, folder)
    attach_float_tensors(model, ckpt.tensors, taken, dtype, ckpt.path)
    model.tie_weights()
    check_complete(model, ckpt.path)
    attach_generation_config(model, ckpt.path)
    model.requires_grad_(False)
    model = model.to(device)
    for module in model.modules():
        if isinstance(module, RepackMoeBlock):
            module.runtime()  # shape checks now, not at the first forward
    return model


# ----------------------------------------------------------------------- door 2: from_pretrained (quantizer)


def header_tensors(checkpoint_files: list[str] | None) -> dict[str, torch.Tensor]:
    """Every stored tensor as an empty meta tensor of its dtype and shape, from the safetensors headers (no data
    read): transformers' loader then copies the bytes into them as they are."""
    if not checkpoint_files:
        raise RepackError(f"{FROM_PRETRAINED}: no weight files found; pass the output folder of `repack convert`")
    entries: dict[str, TensorEntry] = {}
    for file in checkpoint_files:
        if not str(file).endswith(".safetensors"):
            raise RepackError(f"{file}: repack checkpoints are safetensors only; re-run `repack convert`")
        entries.update(read_safetensors_header(Path(file)))
    return {name: torch.empty(e.shape, dtype=e.torch_dtype, device="meta") for name, e in entries.items()}


def finish_gptq_linears(model: nn.Module) -> None:
    """Replace every loaded placeholder by the Triton GPTQ linear over the same tensors."""
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
            raise RepackError(
                f"{FROM_PRETRAINED}: device_map puts weights on 'disk'; the int4 kernels need them on a GPU"
            )
        if isinstance(value, str) and value in ("auto", "balanced", "balanced_low_0", "sequential"):
            devices.add(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
            continue
        devices.add(torch.device(value) if not isinstance(value, int) else torch.device("cuda", value))
    return devices


def drop_expert_converters(weight_conversions: list, model: nn.Module) -> list:
    """Keep renamings; drop converters whose targets (e.g. ``experts.gate_up_proj``) the model no longer has.

    transformers' MoE weight conversions (per-expert ``*.gate_proj.weight`` fused into ``experts.gate_up_proj``)
    target parameters our blocks do not have; renamings (Mixtral's ``block_sparse_moe`` -> ``mlp``) still apply.
    """
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
        for device in kernel_devices(device_map if device_map is not None else self.update_device_map(None)):
            check_kernel_backend(device, FROM_PRETRAINED)
        folder = str(Path(checkpoint_files[0]).parent) if checkpoint_files else str(model.config.name_or_path)
        stored = header_tensors(checkpoint_files)
        config = self.quantization_config
        taken = install_moe_blocks(model, config.stack_infos(), stored, folder)
        install_gptq_linears(model, dense_linear_config(config.__dict__), stored, taken, folder)
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


def register() -> None:
    """Register the config and the quantizer under ``quant_method: "repack"`` (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(RepackQuantConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(RepackHfQuantizer)


register()  # importing this module is registering it; see repack.runtime.__init__
