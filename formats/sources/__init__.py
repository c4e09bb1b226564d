"""Source-format readers: one module per format that a checkpoint's quantized linears may come in.

:func:`source_format` picks the reader of a checkpoint from its ``quantization_config`` (``quant_method``);
everything after it (the planner, the packer, the converter, verify) talks to the reader through
:class:`~.base.SourceFormat` and the :class:`~.base.CanonicalLinear` it produces, never to a format itself.
"""

from __future__ import annotations

from ..source_configs import source_method
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
    """The reader of a checkpoint whose quantization config is ``raw`` (read from ``where``); one line otherwise.
    Which format it is, and what its config refuses, are formats/source_configs.py's (the CLI asks it first)."""
    return READERS[source_method(raw, where)](raw, where)


def reader_named(name: str, raw: dict, where: str) -> SourceFormat:
    """The reader recorded as ``name`` (an output config's ``source_format``)."""
    if name not in READERS:
        raise SourceFormatError(f"{where}: source_format {name!r} is not one of {', '.join(READERS)}")
    return READERS[name](raw, where)
