"""Source-format readers: one module per format that a checkpoint's quantized linears may come in.

:func:`source_format` picks the reader of a checkpoint from its ``quantization_config`` (``quant_method``);
everything after it (the planner, the packer, the converter, verify) talks to the reader through
:class:`~.base.SourceFormat` and the :class:`~.base.CanonicalLinear` it produces, never to a format itself.
"""

from __future__ import annotations

from .awq import AwqSource
from .base import CanonicalLinear, LinearScheme, SourceFormat, SourceFormatError, TensorDict, TensorSource
from .compressed_tensors import CompressedTensorsSource
from .gptq import GptqSource

__all__ = [
    "CanonicalLinear",
    "LinearScheme",
    "SourceFormat",
    "SourceFormatError",
    "TensorDict",
    "TensorSource",
    "READERS",
    "source_format",
    "reader_named",
]

READERS: dict[str, type[SourceFormat]] = {
    "gptq": GptqSource,
    "awq": AwqSource,
    "compressed-tensors": CompressedTensorsSource,
}


def source_format(raw: dict | None, where: str) -> SourceFormat:
    """The reader of a checkpoint whose quantization config is ``raw`` (read from ``where``); one line otherwise."""
    if raw is None:
        raise SourceFormatError(
            f"{where}: no quantization_config in config.json and no quantize_config.json: this is not a quantized "
            "checkpoint (fp16/bf16?); quantize it first (GPTQ, AWQ or compressed-tensors W4A16)"
        )
    if not isinstance(raw, dict):
        raise SourceFormatError(f"{where}: quantization_config must be an object; fix config.json")
    method = str(raw.get("quant_method") or "gptq").lower()
    if method not in READERS:
        raise SourceFormatError(
            f"{where}: quant_method is {raw.get('quant_method')!r}; supported source formats: "
            f"{', '.join(READERS)} (re-quantize with one of them)"
        )
    return READERS[method](raw, where)


def reader_named(name: str, raw: dict, where: str) -> SourceFormat:
    """The reader recorded as ``name`` (an output config's ``source_format``)."""
    if name not in READERS:
        raise SourceFormatError(f"{where}: source_format {name!r} is not one of {', '.join(READERS)}")
    return READERS[name](raw, where)
