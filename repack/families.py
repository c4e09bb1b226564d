"""Architecture families: which layers are sparse-MoE and where their expert linears live.

A family knows its config keys (expert count, which layers are sparse) and its module names; given the
checkpoint's tensor names it returns one :class:`MoeLayer` per sparse layer with the (gate, up, down)
module names of every routed expert and of the shared expert. Every expert tensor in the checkpoint must
be accounted for: a missing or extra one is an error that names it, never a silent skip.
"""

from __future__ import annotations

import re
import reprlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from repack.formats.errors import RepackError
from repack.formats.families import (
    EXPERTS_MODULE,
    GATE_UP_DOWN,
    ROUTER_MODULE,
    SUPPORTED,
    Family,
    family_for,
    num_routed_experts,
)

if TYPE_CHECKING:  # the readers import torch; detect_family runs before it is imported (repack/source_config.py)
    from repack.formats.sources import SourceFormat

_EXPERT_TENSOR = re.compile(
    rf"^(?P<block>(?P<layers>.+)\.(?P<layer>\d+)\.(?P<module>[^.]+))\.{EXPERTS_MODULE}\.(?P<expert>\d+)\."
    r"(?P<proj>[^.]+)\.(?P<suffix>[^.]+)$"
)
__all__ = ["GATE_UP_DOWN", "Family", "MoeLayer", "detect_family", "find_moe_layers", "num_routed_experts"]


_INT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_hidden_layers",
    "decoder_sparse_step",
    "first_k_dense_replace",
    "moe_layer_freq",
)
_LAYER_OF_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layout_keys(config: dict, where: str) -> None:
    """The config keys that decide which layers and experts exist are of the types transformers gives them.

    Why here: they come from a file a stranger wrote, and a string or a list where a count belongs would
    otherwise surface as a TypeError deep in the planner."""
    for key in _INT_KEYS:
        value = config.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise RepackError(
                f"{where}: {key} must be a non-negative integer, not {reprlib.repr(value)}; fix config.json"
            )
    dense = config.get("mlp_only_layers")
    if dense is not None and not (
        isinstance(dense, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)
    ):
        raise RepackError(
            f"{where}: mlp_only_layers must be a list of layer indices, not {reprlib.repr(dense)}; fix config.json"
        )


def first_layer_without_weights(names: Iterable[str], num_layers: int) -> int | None:
    """The lowest decoder layer index below ``num_layers`` that no tensor name holds, or None when all have weights.

    Why indices, not the highest one: a count from config.json sizes loops, and one zero-byte tensor named
    ``model.layers.999999999.pad`` would otherwise back a billion layers. Every real decoder layer has tensors
    (its norms at least), so the layers a config may declare are the ones the names hold, each of them."""
    held = {index for name in names if (match := _LAYER_OF_NAME.search(name)) and (index := int(match[1])) < num_layers}
    if len(held) == num_layers:
        return None
    return next(index for index, layer in enumerate(sorted(held) + [num_layers]) if index != layer)


@dataclass
class MoeLayer:
    """The expert modules of one sparse layer (full module names, without the tensor suffix)."""

    layer: int
    block: str  # e.g. "model.layers.3.mlp"
    routed: list[tuple[str, str, str]]
    shared: tuple[str, str, str] | None = None
    consumed: set[str] = field(default_factory=set)  # every source tensor name the stacks read

    @property
    def routed_prefix(self) -> str:
        return f"{self.block}.experts"

    @property
    def shared_prefix(self) -> str:
        return f"{self.block}.shared_experts"


def detect_family(config: dict, where: str) -> Family:
    model_type = config.get("model_type")
    family = family_for(model_type)
    if family is not None:
        return family
    arch = ", ".join(config.get("architectures") or []) or "?"
    raise RepackError(f"{where}: unsupported architecture model_type={model_type!r} ({arch}); supported: {SUPPORTED}")


def find_moe_layers(
    family: Family, config: dict, names: Iterable[str], where: str, source_format: SourceFormat
) -> list[MoeLayer]:
    """One :class:`MoeLayer` per sparse layer; raises on missing, extra or unquantized expert tensors (the linears'
    tensor suffixes are ``source_format``'s)."""
    names = set(names)
    found: dict[str, dict[int, dict[str, set[str]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(set)))
    layer_root = "model.layers"
    for name in names:
        match = _EXPERT_TENSOR.match(name)
        if match:
            found[match["block"]][int(match["expert"])][match["proj"]].add(match["suffix"])
            layer_root = match["layers"]
    config_file = f"{where}/config.json"
    check_layout_keys(config, config_file)
    num_experts = num_routed_experts(config)
    num_layers = int(config.get("num_hidden_layers") or 0)
    missing = first_layer_without_weights(names, num_layers)
    if missing is not None:  # a count from the config never sizes a loop the weights cannot back
        raise RepackError(
            f"{config_file}: num_hidden_layers is {num_layers} but the weights hold no tensor of layer {missing}; fix "
            "config.json or re-download the weights"
        )
    sparse = [i for i in range(num_layers) if num_experts and family.is_sparse(config, i)]
    if not sparse or not found:
        raise RepackError(
            f"{where}: dense model ({num_experts} experts in config, {len(found)} MoE blocks in the weights); "
            "repack converts Mixture-of-Experts checkpoints only"
        )
    layers = []
    for i in sparse:
        blocks = [f"{layer_root}.{i}.{m}" for m in family.block_modules if f"{layer_root}.{i}.{m}" in found]
        if not blocks:
            expert = f"{family.block_modules[0]}.experts.0.{family.projection_sets[0][0]}"
            first = f"{layer_root}.{i}.{expert}.{source_format.marker}"
            raise RepackError(
                f"{where}: layer {i} is sparse per config.json but has no expert tensors (missing {first}); "
                "re-download the checkpoint or fix mlp_only_layers/decoder_sparse_step"
            )
        block = blocks[0]
        layers.append(_routed_layer(family, i, block, found.pop(block), num_experts, source_format))
        for other in blocks[1:]:
            _raise_extra(found[other], other, "a second MoE block naming in the same layer")
    for block, experts in found.items():
        _raise_extra(experts, block, "config.json says this layer is dense")
    _check_block_modules(family, {layer.block for layer in layers}, names, config_file)
    for layer in layers:
        if family.shared_expert:
            layer.shared = _shared_triple(family, layer, names, source_format)
    return layers


_BLOCK_CHILD = re.compile(r"^(?P<block>.+\.\d+\.[^.]+)\.(?P<child>[^.]+)\.")


def _check_block_modules(family: Family, blocks: set[str], names: set[str], config_file: str) -> None:
    """Every tensor inside a MoE block belongs to a module the family's block has (experts, router gate, its shared
    expert and that expert's gate): a Qwen2-MoE checkpoint whose config says ``mixtral`` would otherwise convert,
    its shared expert copied through as tensors that the Mixtral model never reads."""
    allowed = {EXPERTS_MODULE, ROUTER_MODULE, family.shared_expert, family.shared_expert_gate} - {None}
    for name in sorted(names):
        match = _BLOCK_CHILD.match(name)
        if match and match["block"] in blocks and match["child"] not in allowed:
            raise RepackError(
                f"{config_file}: tensor {name} is in the MoE block {match['block']}, but a {family.name} block has no "
                f"{match['child']} (only {', '.join(sorted(allowed))}); is model_type right? Fix config.json"
            )


def _routed_layer(
    family: Family, layer: int, block: str, experts: dict, num_experts: int, source_format: SourceFormat
) -> MoeLayer:
    first = experts.get(0, {})
    projs = next((p for p in family.projection_sets if p[0] in first), family.projection_sets[0])
    moe = MoeLayer(layer, block, [])
    for j in range(num_experts):
        present = experts.pop(j, {})
        triple = tuple(f"{block}.experts.{j}.{p}" for p in projs)
        for proj, module in zip(projs, triple, strict=True):
            suffixes = present.pop(proj, set())
            _check_linear_suffixes(module, suffixes, source_format)
            moe.consumed.update(f"{module}.{s}" for s in suffixes)
        if present:
            proj = sorted(present)[0]
            raise RepackError(
                f"extra expert tensor {block}.experts.{j}.{proj}.{sorted(present[proj])[0]}: expected only "
                f"{'/'.join(projs)} in this checkpoint; remove it or report the layout"
            )
        moe.routed.append(triple)
    if experts:
        _raise_extra(experts, block, f"config.json says {num_experts} experts (num_experts)")
    return moe


def _check_linear_suffixes(module: str, suffixes: set[str], source_format: SourceFormat) -> None:
    fmt = source_format.name
    if "weight" in suffixes:
        raise RepackError(
            f"expert {module}.weight is not {fmt}-quantized (plain weight); repack needs every routed expert "
            f"quantized (check the quantization config's ignore / dynamic / modules_to_not_convert)"
        )
    for suffix in source_format.required:
        if suffix not in suffixes:
            raise RepackError(f"missing expert tensor {module}.{suffix}; the checkpoint is incomplete, re-download it")
    extra = suffixes - set(source_format.suffixes)
    if extra:
        raise RepackError(
            f"unexpected expert tensor {module}.{sorted(extra)[0]}: expert linears with bias or tensors other than "
            f"{fmt}'s ({', '.join(source_format.suffixes)}) are not supported"
        )


def _raise_extra(experts: dict, block: str, why: str) -> None:
    j = min(experts)
    proj = sorted(experts[j])[0]
    suffix = sorted(experts[j][proj])[0]
    raise RepackError(f"extra expert tensor {block}.experts.{j}.{proj}.{suffix}: {why}; remove it or fix config.json")


def _shared_triple(
    family: Family, layer: MoeLayer, names: set[str], source_format: SourceFormat
) -> tuple[str, str, str] | None:
    """The quantized shared expert's modules; None when absent or kept in float (then it is copied)."""
    base = f"{layer.block}.{family.shared_expert}"
    triple = tuple(f"{base}.{p}" for p in GATE_UP_DOWN)
    if not any(f"{m}.{source_format.marker}" in names for m in triple):
        return None
    for module in triple:
        candidates = (*source_format.suffixes, "bias", "weight")
        suffixes = {s for s in candidates if f"{module}.{s}" in names}
        _check_linear_suffixes(module, suffixes, source_format)
        layer.consumed.update(f"{module}.{s}" for s in suffixes)
    return triple
