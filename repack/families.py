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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from repack.formats.errors import RepackError
from repack.formats.gptq import LINEAR_SUFFIXES

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_W = ("w1", "w3", "w2")  # w1 = gate, w3 = up, w2 = down
REQUIRED_SUFFIXES = ("qweight", "qzeros", "scales")
_EXPERT_TENSOR = re.compile(
    r"^(?P<block>(?P<layers>.+)\.(?P<layer>\d+)\.(?P<module>[^.]+))\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>[^.]+)\.(?P<suffix>[^.]+)$"
)


@dataclass(frozen=True)
class Family:
    """How one architecture family lays out its MoE blocks."""

    name: str
    model_types: tuple[str, ...]
    block_modules: tuple[str, ...]  # MoE block module name inside a decoder layer, in preference order
    projection_sets: tuple[tuple[str, str, str], ...]  # expert (gate, up, down) names, accepted spellings
    shared_module: str | None  # shared expert module inside the block, None if the family has none
    is_sparse: Callable[[dict, int], bool]


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


def layers_in_weights(names: Iterable[str]) -> int:
    """1 + the highest decoder layer index any tensor name holds (0 when none does)."""
    return max((int(match[1]) + 1 for name in names if (match := _LAYER_OF_NAME.search(name))), default=0)


def num_routed_experts(config: dict) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return 0


def _qwen_sparse(config: dict, layer: int) -> bool:
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def _deepseek_sparse(config: dict, layer: int) -> bool:
    default_dense = 3 if config.get("model_type") == "deepseek_v3" else 0  # transformers' config defaults
    first_dense = int(config.get("first_k_dense_replace", default_dense) or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return layer >= first_dense and layer % freq == 0


FAMILIES = (
    Family("qwen2_moe", ("qwen2_moe",), ("mlp",), (GATE_UP_DOWN,), "shared_expert", _qwen_sparse),
    Family("qwen3_moe", ("qwen3_moe",), ("mlp",), (GATE_UP_DOWN,), None, _qwen_sparse),
    Family("mixtral", ("mixtral",), ("block_sparse_moe", "mlp"), (MIXTRAL_W, GATE_UP_DOWN), None, lambda c, i: True),
    Family("deepseek_v2", ("deepseek_v2",), ("mlp",), (GATE_UP_DOWN,), "shared_experts", _deepseek_sparse),
    Family("deepseek_v3", ("deepseek_v3",), ("mlp",), (GATE_UP_DOWN,), "shared_experts", _deepseek_sparse),
)
SUPPORTED = ", ".join(f.name for f in FAMILIES)


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
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    arch = ", ".join(config.get("architectures") or []) or "?"
    raise RepackError(f"{where}: unsupported architecture model_type={model_type!r} ({arch}); supported: {SUPPORTED}")


def find_moe_layers(family: Family, config: dict, names: Iterable[str], where: str) -> list[MoeLayer]:
    """One :class:`MoeLayer` per sparse layer; raises on missing, extra or unquantized expert tensors."""
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
    present = layers_in_weights(names)
    if num_layers > present:  # a count from the config never sizes a loop the weights cannot back
        raise RepackError(
            f"{config_file}: num_hidden_layers is {num_layers} but the weights hold {present} layers; fix config.json "
            "or re-download the weights"
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
            first = f"{layer_root}.{i}.{family.block_modules[0]}.experts.0.{family.projection_sets[0][0]}.qweight"
            raise RepackError(
                f"{where}: layer {i} is sparse per config.json but has no expert tensors (missing {first}); "
                "re-download the checkpoint or fix mlp_only_layers/decoder_sparse_step"
            )
        block = blocks[0]
        layers.append(_routed_layer(family, i, block, found.pop(block), num_experts))
        for other in blocks[1:]:
            _raise_extra(found[other], other, "a second MoE block naming in the same layer")
    for block, experts in found.items():
        _raise_extra(experts, block, "config.json says this layer is dense")
    for layer in layers:
        if family.shared_module:
            layer.shared = _shared_triple(family, layer, names)
    return layers


def _routed_layer(family: Family, layer: int, block: str, experts: dict, num_experts: int) -> MoeLayer:
    first = experts.get(0, {})
    projs = next((p for p in family.projection_sets if p[0] in first), family.projection_sets[0])
    moe = MoeLayer(layer, block, [])
    for j in range(num_experts):
        present = experts.pop(j, {})
        triple = tuple(f"{block}.experts.{j}.{p}" for p in projs)
        for proj, module in zip(projs, triple, strict=True):
            suffixes = present.pop(proj, set())
            _check_linear_suffixes(module, suffixes)
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


def _check_linear_suffixes(module: str, suffixes: set[str]) -> None:
    if "weight" in suffixes:
        raise RepackError(
            f"expert {module}.weight is not GPTQ-quantized (plain weight); repack needs every routed expert "
            "in GPTQ form (check dynamic / modules_in_block_to_quantize)"
        )
    for suffix in REQUIRED_SUFFIXES:
        if suffix not in suffixes:
            raise RepackError(f"missing expert tensor {module}.{suffix}; the checkpoint is incomplete, re-download it")
    extra = suffixes - set(LINEAR_SUFFIXES)
    if extra:
        raise RepackError(
            f"unexpected expert tensor {module}.{sorted(extra)[0]}: expert linears with bias or extra tensors "
            "are not supported"
        )


def _raise_extra(experts: dict, block: str, why: str) -> None:
    j = min(experts)
    proj = sorted(experts[j])[0]
    suffix = sorted(experts[j][proj])[0]
    raise RepackError(f"extra expert tensor {block}.experts.{j}.{proj}.{suffix}: {why}; remove it or fix config.json")


def _shared_triple(family: Family, layer: MoeLayer, names: set[str]) -> tuple[str, str, str] | None:
    """The quantized shared expert's modules; None when absent or kept in float (then it is copied)."""
    base = f"{layer.block}.{family.shared_module}"
    triple = tuple(f"{base}.{p}" for p in GATE_UP_DOWN)
    if not any(f"{m}.qweight" in names for m in triple):
        return None
    for module in triple:
        suffixes = {s for s in (*LINEAR_SUFFIXES, "bias", "weight") if f"{module}.{s}" in names}
        _check_linear_suffixes(module, suffixes)
        layer.consumed.update(f"{module}.{s}" for s in suffixes)
    return triple
