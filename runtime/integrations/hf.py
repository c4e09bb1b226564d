"""transformers drop-in: a converted checkpoint as a ``*ForCausalLM`` whose MoE and GPTQ layers run on our kernels.

Why this shape: transformers already has the decoder (attention, norms, rotary, cache, ``generate``); only
the quantized parts differ. So the model is built from the converted ``config.json`` with every parameter
on the meta device (no random init of 57B parameters; real buffers such as rotary ``inv_freq`` are
computed as usual), then:

1. each sparse-MoE block is replaced by :class:`HfMoeBlock` around the runtime ``MoeBlock`` (router, routed
   experts and a stacked shared expert through the fused kernel);
2. each copied-through GPTQ linear (attention, dense MLPs, a quantized lm_head) is replaced by
   :class:`~repack.runtime.kernels.gptq_linear.GptqW4A16Linear`, which reads the stored int4 tensors directly;
3. the float tensors (embeddings, norms, lm_head, a float shared expert) are attached as parameters,
   cast to the activation dtype (a no-op view when the file already holds it).

Every tensor of the file must find its place and every parameter of the model must be filled: anything
else is a one-line :class:`RepackError`. Supported: transformers 5.x (MoE blocks return one tensor).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqFormatError, GptqLinear
from repack.formats.stacks import SHARED
from repack.runtime.kernels.backend import check_kernel_backend
from repack.runtime.kernels.gptq_linear import GptqW4A16Linear
from repack.runtime.loader import RepackCheckpoint, load
from repack.runtime.moe_block import MoeBlock

SHARED_EXPERT_MODULES = ("shared_expert", "shared_experts")  # Qwen2-MoE, DeepSeek (kept in float)
SHARED_GATE_MODULE = "shared_expert_gate"
ROUTER_TENSORS = ("gate.weight", "gate.e_score_correction_bias")
SOURCE_MODULE_ALIASES = ((".block_sparse_moe.", ".mlp."),)  # Mixtral v4 names -> transformers 5 names
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class HfMoeBlock(nn.Module):
    """The transformers sparse-MoE block's place in a decoder layer, computed by the runtime.

    ``moe`` runs router, routed experts and a stacked shared expert. A shared expert that the converter
    left unstacked (kept in float) stays the model's own module and is added here, with its sigmoid gate
    when the family has one. Returns one tensor ``[..., H]``, as transformers 5's MoE blocks do.
    """

    def __init__(self, moe: MoeBlock, shared_expert: nn.Module | None = None, shared_gate: nn.Module | None = None):
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.moe(hidden_states)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            out = out + shared
        return out


# -------------------------------------------------------------------------------------------- kernels


# -------------------------------------------------------------------------------------- model skeleton


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


def hf_config(ckpt: RepackCheckpoint):
    """The transformers config of the converted model, without our quantization_config."""
    from transformers import AutoConfig

    raw = {key: value for key, value in ckpt.config.items() if key != "quantization_config"}
    model_type = raw.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **raw)
    except Exception as error:  # transformers' validators raise several types; all mean a bad config.json
        cause = " ".join(str(error).split()) or type(error).__name__
        raise RepackError(
            f"{ckpt.path / 'config.json'}: transformers cannot build a {model_type!r} config ({cause}); fix "
            "config.json or install a supported transformers (pip install 'moe-repack[hf]')"
        ) from None


def build_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The ``*ForCausalLM`` with parameters on meta and real buffers, in eval mode."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# ----------------------------------------------------------------------------------------- placement


def model_path(model: nn.Module, name: str, kind: str = "module") -> str | None:
    """The model's name for checkpoint name ``name`` (trying the source-name aliases), or None."""
    candidates = [name] + [name.replace(old, new) for old, new in SOURCE_MODULE_ALIASES if old in name]
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


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def install_moe_blocks(model: nn.Module, ckpt: RepackCheckpoint) -> set[str]:
    """Swap each sparse-MoE block for :class:`HfMoeBlock`; returns the checkpoint tensors the blocks use."""
    consumed: set[str] = set()
    for layer in ckpt.moe_layers:
        moe = ckpt.moe_block(layer)
        prefix = moe.name  # the source block path, e.g. model.layers.3.mlp
        path = model_path(model, prefix)
        if path is None:
            raise RepackError(
                f"{ckpt.path}: MoE block {prefix} has no module in the transformers model "
                f"({type(model).__name__}); check the transformers version (pip install 'moe-repack[hf]')"
            )
        original = model.get_submodule(path)
        for info in ckpt.stacks:
            if info.prefix.startswith(f"{prefix}."):
                consumed.update(info.tensor_names())
        consumed.update(f"{prefix}.{name}" for name in ROUTER_TENSORS)
        shared_expert = shared_gate = None
        if ckpt.stack_info(layer, SHARED) is not None:
            consumed.add(f"{prefix}.{SHARED_GATE_MODULE}.weight")
        else:
            for module_name in SHARED_EXPERT_MODULES:
                if any(name.startswith(f"{prefix}.{module_name}.") for name in ckpt.tensors):
                    shared_expert = getattr(original, module_name)
                    shared_gate = getattr(original, SHARED_GATE_MODULE, None)
        set_module(model, path, HfMoeBlock(moe, shared_expert, shared_gate))
    return consumed


def install_gptq_linears(model: nn.Module, ckpt: RepackCheckpoint, consumed: set[str]) -> set[str]:
    """Swap each copied-through GPTQ linear's ``nn.Linear`` for the Triton GPTQ linear; returns its tensors."""
    from repack.formats.quant_config import parse_quant_config

    where = str(ckpt.path / "config.json")
    source = (ckpt.config.get("quantization_config") or {}).get("source_quantization_config")
    quant = parse_quant_config(source, f"{where} source_quantization_config")
    used: set[str] = set()
    for name in sorted(ckpt.tensors):
        if not name.endswith(".qweight") or name in consumed:
            continue
        module = name.removesuffix(".qweight")
        scheme = quant.scheme_for(module) or quant.base
        tensors = {suffix: ckpt.tensors.get(f"{module}.{suffix}") for suffix in GPTQ_SUFFIXES}
        if tensors["qzeros"] is None or tensors["scales"] is None:
            missing = "qzeros" if tensors["qzeros"] is None else "scales"
            raise RepackError(f"{ckpt.path}: tensor {module}.{missing} is missing; re-run `repack convert`")
        try:
            linear = GptqW4A16Linear(GptqLinear(**{k: v for k, v in tensors.items()}), scheme, name=module)
        except GptqFormatError as error:
            raise RepackError(f"{ckpt.path}: {error}") from None
        path, target = gptq_target(model, module, str(ckpt.path))
        if (target.in_features, target.out_features) != (linear.in_features, linear.out_features):
            raise RepackError(
                f"{ckpt.path}: GPTQ linear {module} is {linear.in_features}->{linear.out_features} but the "
                f"model expects {target.in_features}->{target.out_features}; config.json does not match the weights"
            )
        set_module(model, path, linear)
        used.update(f"{module}.{suffix}" for suffix, tensor in tensors.items() if tensor is not None)
    return used


def attach_float_tensors(model: nn.Module, ckpt: RepackCheckpoint, consumed: set[str], dtype: torch.dtype) -> None:
    """Every remaining checkpoint tensor becomes the model's parameter of that name, in ``dtype``."""
    for name, tensor in ckpt.tensors.items():
        if name in consumed or IGNORED_TENSORS.search(name):
            continue
        path = model_path(model, name, kind="tensor")
        if path is None:
            raise RepackError(
                f"{ckpt.path}: tensor {name} has no place in {type(model).__name__}; the checkpoint does not "
                "match config.json (re-run `repack convert`)"
            )
        module_name, _, leaf = path.rpartition(".")
        module = model.get_submodule(module_name)
        current = getattr(module, leaf)
        if tuple(current.shape) != tuple(tensor.shape):
            raise RepackError(
                f"{ckpt.path}: tensor {name} has shape {list(tensor.shape)}, the model expects "
                f"{list(current.shape)}; config.json does not match the weights"
            )
        value = tensor.to(dtype) if tensor.is_floating_point() else tensor
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[leaf] = value


def check_complete(model: nn.Module, ckpt: RepackCheckpoint) -> None:
    """After tying, no parameter may still be on meta: that would be a tensor the file lacks."""
    for name, param in model.named_parameters():
        if param.is_meta:
            raise RepackError(f"{ckpt.path}: tensor {name} is missing from the checkpoint; re-run `repack convert`")


def attach_generation_config(model: nn.Module, folder: Path) -> None:
    """Use the checkpoint's generation_config.json (eos, sampling defaults) when it has one."""
    if not (folder / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------- entry


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
    model = build_skeleton(hf_config(ckpt), dtype)
    consumed = install_moe_blocks(model, ckpt)
    consumed |= install_gptq_linears(model, ckpt, consumed)
    attach_float_tensors(model, ckpt, consumed, dtype)
    model.tie_weights()
    check_complete(model, ckpt)
    attach_generation_config(model, ckpt.path)
    model.requires_grad_(False)
    return model.to(device)
