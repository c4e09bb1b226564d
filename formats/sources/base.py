"""The source-format reader interface and the canonical int4 linear every reader produces.

A source format (GPTQ, AWQ, compressed-tensors) stores a quantized ``nn.Linear(in=K, out=N)`` as tensors of its
own layout. Its reader (one module per format beside this one) turns them into a :class:`CanonicalLinear`, the
one form the planner, the packer (formats/stacks.py) and the converter take, and turns a canonical linear back
into the exact source tensors (:meth:`SourceFormat.write`, what ``repack verify --source`` compares bit for bit).
Nothing downstream of a reader knows which format a checkpoint came in.

The canonical linear (lossless for every format we read):

- ``qweight`` int32 ``[K * bits / 32, N]``, packed along the input: field ``s`` (bits ``b s .. b s + b - 1``) of
  word ``[r, n]`` is the unsigned value ``q`` of input ``k = (32 / b) r + s`` and output ``n`` (GPTQ's packing);
- ``scales`` float16 ``[G, N]``, ``G`` groups along the input (1 for a per-channel scheme, ``group_size == -1``);
- ``zeros`` uint8 ``[G, N]``, the true zero points, or None for a symmetric scheme (every zero ``2^(bits-1)``);
- ``g_idx`` int32 ``[K]``: the group of each input, or None when the source stores none (groups are contiguous).

so that ``W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`` with ``g = g_idx[k]`` (or ``k // group_size``). Any
of the tensors may be a shape-only (meta) tensor where a caller only plans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ..schemes import GptqScheme
from ..source_configs import SourceFormatError

# The scheme of one canonical linear: bits, group size (-1: one group over K), sym, and the source's convention
# (``checkpoint_format``: "gptq", "gptq_v2", "awq", "pack-quantized"), which only its reader's inverse needs.
LinearScheme = GptqScheme


@dataclass
class CanonicalLinear:
    """One quantized linear in the form every reader produces (module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    def in_features(self, scheme: LinearScheme) -> int:
        return int(self.qweight.shape[0]) * scheme.pack_factor


class TensorSource(Protocol):
    """Where a reader finds a checkpoint's tensors: a :class:`~repack.formats.checkpoint.CheckpointReader`, or
    :class:`TensorDict` over tensors in memory."""

    def __contains__(self, name: str) -> bool: ...

    def entry(self, name: str): ...  # .shape and .torch_dtype, from the header

    def read(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    torch_dtype: torch.dtype


class TensorDict:
    """A :class:`TensorSource` over a name -> tensor mapping (tests, verify's rebuilt tensors)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def entry(self, name: str) -> _Entry:
        tensor = self.tensors[name]
        return _Entry(tuple(tensor.shape), tensor.dtype)

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def names(self) -> list[str]:
        return list(self.tensors)


def meta_tensor(source: TensorSource, name: str) -> torch.Tensor:
    """A shape-only tensor of the stored tensor's dtype and shape (nothing read)."""
    entry = source.entry(name)
    return torch.empty(tuple(entry.shape), dtype=entry.torch_dtype, device="meta")


class SourceFormat(ABC):
    """One source format's reader: which modules it quantized and with which scheme, and its tensors both ways.

    An instance holds one checkpoint's parsed quantization config (``raw`` as read, ``where`` the file it came
    from, for messages)."""

    name: ClassVar[str]  # the format's name, as the model card, provenance and output config say it
    marker: ClassVar[str]  # the tensor suffix that marks a quantized linear ("qweight", "weight_packed")
    suffixes: ClassVar[tuple[str, ...]]  # every suffix one quantized linear may store (bias is copied, not read)
    required: ClassVar[tuple[str, ...]]  # the suffixes it must store
    # Whether its linears are already GPTQ tensors the runtime's dense GPTQ linear reads: then the non-expert
    # linears are copied through; otherwise they are converted into GPTQ tensors of the same module name.
    stores_gptq_linears: ClassVar[bool] = False

    def __init__(self, raw: dict, where: str) -> None:
        self.raw = raw
        self.where = where

    @abstractmethod
    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of one module (full name), or None when the config says it is not quantized."""

    @abstractmethod
    def base_scheme(self) -> LinearScheme | None:
        """The checkpoint's main scheme (the config's default), for the output config's summary fields."""

    @abstractmethod
    def header_linear(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        """The canonical linear of ``module`` with shape-only tensors, after checking every stored tensor's dtype and
        shape from the headers; only tiny tensors (g_idx, stored shapes) are read."""

    @abstractmethod
    def read_small(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        """The canonical linear with real scales, zeros and g_idx and a shape-only qweight (read later with
        :meth:`read_qweight`); values that contradict the config (a symmetric scheme's zeros) are refused."""

    @abstractmethod
    def read_qweight(self, source: TensorSource, module: str, scheme: LinearScheme) -> torch.Tensor:
        """The canonical qweight words of ``module``."""

    @abstractmethod
    def write(self, module: str, linear: CanonicalLinear, scheme: LinearScheme, like: TensorSource) -> dict:
        """The inverse: full tensor name -> tensor, exactly as this format stores ``module``. ``like`` is the source
        checkpoint, from whose headers a format may take what the canonical linear does not say (a stored dtype)."""

    def read(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        """The whole canonical linear (small tensors and qweight)."""
        linear = self.read_small(source, module, scheme)
        linear.qweight = self.read_qweight(source, module, scheme)
        return linear

    def module_tensors(self, module: str, present: Callable[[str], bool]) -> list[str]:
        """The names of ``module``'s stored tensors of this format (the ones its reader consumes)."""
        return [f"{module}.{suffix}" for suffix in self.suffixes if present(f"{module}.{suffix}")]

    def describe(self) -> str:
        """A short description of the checkpoint's scheme for messages and the model card (``gptq 4-bit g128``)."""
        return self.name


def check_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], why: str):
    """Refuse a stored tensor of another shape or dtype with one line naming it; ``why`` says what sets the shape."""
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype not in dtypes:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise SourceFormatError(
            f"{name}: expected {wanted} {list(shape)} ({why}), got {str(tensor.dtype).removeprefix('torch.')} "
            f"{list(tensor.shape)}; the checkpoint does not follow its format, re-export it"
        )
