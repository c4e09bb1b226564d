"""The MoE architecture families as data: where each one keeps its experts, router and shared expert.

One table, read by every side that needs to know a family's module names: the converter's planner
(:mod:`repack.families` finds the expert linears of a checkpoint with it), the runtime loader, the transformers
integration and the vLLM plugin. It imports nothing but the standard library (no torch), like gguf-py's
architecture tables, so any tool can read it.

Two namings exist for the same model. A checkpoint names modules as the library that wrote it did (older
Mixtral checkpoints: ``block_sparse_moe.experts.{j}.w1``; transformers 5: ``mlp.experts.{j}.gate_proj``), and
the model built by transformers 5 has one name for its MoE block (``mlp``). :attr:`Family.block_modules` lists the
checkpoint spellings, :attr:`Family.model_block` the model's, :attr:`Family.projection_sets` the expert
projection spellings, each as (gate, up, down).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_W = ("w1", "w3", "w2")  # w1 = gate, w3 = up, w2 = down
EXPERTS_MODULE = "experts"  # the routed experts' module inside a block, in every family
ROUTER_MODULE = "gate"  # the router's linear inside a block, in every family
# The config keys that hold the routed expert count, in the order the families use them.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _qwen_sparse(config: dict, layer: int) -> bool:
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def _deepseek_sparse(config: dict, layer: int) -> bool:
    default_dense = 3 if config.get("model_type") == "deepseek_v3" else 0  # transformers' config defaults
    first_dense = int(config.get("first_k_dense_replace", default_dense) or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return layer >= first_dense and layer % freq == 0


def _every_layer(config: dict, layer: int) -> bool:
    return True


@dataclass(frozen=True)
class Family:
    """How one architecture family lays out its sparse-MoE blocks, under every naming we read."""

    name: str
    model_types: tuple[str, ...]  # config.json ``model_type`` values of the family
    block_modules: tuple[str, ...]  # the MoE block inside a decoder layer, as checkpoints name it (preference order)
    model_block: str  # the MoE block's name in the transformers 5 model
    projection_sets: tuple[tuple[str, str, str], ...]  # expert (gate, up, down) spellings, preference order
    shared_expert: str | None  # the shared expert inside the block; None when the family has none
    shared_expert_gate: str | None  # the shared expert's sigmoid gate (Qwen2-MoE); None when absent
    is_sparse: Callable[[dict, int], bool]  # (config, layer index) -> whether that layer is a MoE block


FAMILIES = (
    Family("qwen2_moe", ("qwen2_moe",), ("mlp",), "mlp", (GATE_UP_DOWN,), "shared_expert", "shared_expert_gate",
           _qwen_sparse),
    Family("qwen3_moe", ("qwen3_moe",), ("mlp",), "mlp", (GATE_UP_DOWN,), None, None, _qwen_sparse),
    Family("mixtral", ("mixtral",), ("block_sparse_moe", "mlp"), "mlp", (MIXTRAL_W, GATE_UP_DOWN), None, None,
           _every_layer),
    Family("deepseek_v2", ("deepseek_v2",), ("mlp",), "mlp", (GATE_UP_DOWN,), "shared_experts", None,
           _deepseek_sparse),
    Family("deepseek_v3", ("deepseek_v3",), ("mlp",), "mlp", (GATE_UP_DOWN,), "shared_experts", None,
           _deepseek_sparse),
)  # fmt: skip
SUPPORTED = ", ".join(f.name for f in FAMILIES)

# Every family's shared-expert module and gate names (what a reader that does not know the family looks for).
SHARED_EXPERT_MODULES = tuple(dict.fromkeys(f.shared_expert for f in FAMILIES if f.shared_expert))
SHARED_GATE_MODULES = tuple(dict.fromkeys(f.shared_expert_gate for f in FAMILIES if f.shared_expert_gate))
# Checkpoint block names that transformers 5 models call otherwise: (".block_sparse_moe.", ".mlp."), ...
BLOCK_ALIASES = tuple(
    dict.fromkeys(
        (f".{stored}.", f".{f.model_block}.") for f in FAMILIES for stored in f.block_modules if stored != f.model_block
    )
)


def family_for(model_type: object) -> Family | None:
    """The family of a config's ``model_type``, or None when no family has it."""
    return next((family for family in FAMILIES if model_type in family.model_types), None)


def num_routed_experts(config: dict) -> int:
    """The routed expert count of a (text) config, 0 when it names none."""
    for key in EXPERT_COUNT_KEYS:
        if config.get(key):
            return int(config[key])
    return 0
