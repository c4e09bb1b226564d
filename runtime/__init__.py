"""repack.runtime: load a repack-moe checkpoint and run its MoE blocks on the fused W4A16 Triton kernels.

The names below are imported on first use, so ``import repack.runtime`` stays cheap: it loads neither
triton nor the CLI until a kernel or the loader is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from repack.runtime.fused_moe import fused_moe
    from repack.runtime.hf import load_hf_model
    from repack.runtime.loader import RepackCheckpoint, load
    from repack.runtime.moe_block import MoeBlock
    from repack.runtime.routing import route
    from repack.runtime.weights import MoeWeights

_EXPORTS = {
    "load": "loader",
    "RepackCheckpoint": "loader",
    "MoeBlock": "moe_block",
    "MoeWeights": "weights",
    "fused_moe": "fused_moe",
    "route": "routing",
    "load_hf_model": "hf",
}

__all__ = ["MoeBlock", "MoeWeights", "RepackCheckpoint", "fused_moe", "load", "load_hf_model", "route"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'repack.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"repack.runtime.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
