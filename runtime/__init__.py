"""repack.runtime: load a repack-moe checkpoint and run its MoE blocks on the fused W4A16 Triton kernels.

The names below are imported on first use, so ``import repack.runtime`` stays cheap: it loads neither
triton nor the CLI until a kernel or the loader is needed.

Importing this package also makes ``transformers.AutoModelForCausalLM.from_pretrained`` understand
``quant_method: "repack"`` (runtime/integrations/transformers.py). Registering needs transformers' quantizer registry,
whose import costs seconds, so it is not imported here: when it is already loaded we register now,
otherwise a one-shot import hook registers right after transformers first imports it. The installed package imports
this module in every interpreter (``moe_repack.pth``, see setup.py), so a plain ``from_pretrained`` needs no import.

On a machine without a GPU the kernels run only in Triton's interpreter, which Triton switches on when it is first
imported (``TRITON_INTERPRET=1``); transformers imports triton (through torch._dynamo) before any quantizer runs. So
a second one-shot hook sets ``TRITON_INTERPRET=1`` when triton is first imported by a torch that sees no GPU, as
``repack.runtime.load`` does when it runs first: the README's and the model card's snippets then run alike on a CPU.
A TRITON_INTERPRET already set, to 0 too (compiling for a GPU on a machine without one), is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from repack.runtime.fused_moe import fused_moe
    from repack.runtime.integrations.transformers import load_hf_model
    from repack.runtime.kernels.routing import route
    from repack.runtime.loader import RepackCheckpoint, load
    from repack.runtime.moe_block import MoeBlock
    from repack.runtime.weights import MoeWeights

_EXPORTS = {
    "load": "loader",
    "RepackCheckpoint": "loader",
    "MoeBlock": "moe_block",
    "MoeWeights": "weights",
    "fused_moe": "fused_moe",
    "route": "kernels.routing",
    "load_hf_model": "integrations.transformers",
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


_TRANSFORMERS_REGISTRY = "transformers.quantizers.auto"


def _register_repack_quantizer() -> None:
    """The integration registers itself when imported (also when it is the module that triggered the import).

    A transformers version our quantizer does not fit must not break transformers itself: warn instead."""
    try:
        importlib.import_module("repack.runtime.integrations.transformers")
    except Exception as error:  # noqa: BLE001 - any failure here is reported, never raised into transformers
        import warnings

        warnings.warn(f"repack: could not register the 'repack' quantizer with transformers ({error})", stacklevel=2)


class _RegisterAfterTransformersImport(importlib.abc.MetaPathFinder):
    """Finds transformers' quantizer registry like the normal path finder, and registers ours once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRANSFORMERS_REGISTRY:
            return None
        sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def execute_then_register(module) -> None:
            execute(module)
            _register_repack_quantizer()

        spec.loader.exec_module = execute_then_register
        return spec


class _InterpretTritonWithoutGpu(importlib.abc.MetaPathFinder):
    """Sets TRITON_INTERPRET=1 just before triton's first import when torch is loaded and sees no GPU; never
    decides anything itself: returns None so the normal finders import triton."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "triton":
            return None
        sys.meta_path.remove(self)  # one shot
        torch = sys.modules.get("torch")
        if "TRITON_INTERPRET" not in os.environ and torch is not None:
            try:
                # device_count: NVML where it can (no CUDA context, so it is safe before a fork); 0 without CUDA.
                no_gpu = torch.cuda.device_count() == 0
            except Exception:  # noqa: BLE001 - a half-imported torch: leave Triton's default alone
                no_gpu = False
            if no_gpu:
                os.environ["TRITON_INTERPRET"] = "1"
        return None


if "triton" not in sys.modules and not any(isinstance(f, _InterpretTritonWithoutGpu) for f in sys.meta_path):
    sys.meta_path.insert(0, _InterpretTritonWithoutGpu())

if _TRANSFORMERS_REGISTRY in sys.modules:
    _register_repack_quantizer()
elif not any(isinstance(finder, _RegisterAfterTransformersImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterTransformersImport())
