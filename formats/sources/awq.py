"""AWQ (AutoAWQ, GPTQModel's AWQ) as a source format: the GEMM packing (``version``/``format`` "gemm").

One AWQ linear ``nn.Linear(in=K, out=N)`` with group size g stores:

- ``qweight`` int32 ``[K, N / 8]``: packed along the **output** dimension; field ``s`` of word ``[k, c]`` holds
  output ``8 c + AWQ_ORDER[s]`` with ``AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7`` (AutoAWQ's ``order_map``);
- ``qzeros`` int32 ``[K / g, N / 8]``: the true zero points (no offset), packed the same way;
- ``scales`` float16 ``[K / g, N]``;

and ``W[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n])``. No act-order (no ``g_idx``). The reader moves
every value into the canonical words (packed along the input), and :meth:`AwqSource.write` packs them back.
"""

from __future__ import annotations

import torch

from ..gptq import pack_along_rows, unpack_along_rows
from ..source_configs import AwqConfig
from .base import (
    CanonicalLinear,
    LinearScheme,
    SourceFormat,
    SourceFormatError,
    TensorSource,
    check_tensor,
    meta_tensor,
)
from .words import pack_last, unpack_last

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AwqSource(AwqConfig, SourceFormat):
    """The config (formats/source_configs.py: versions, bits, group sizes, modules_to_not_convert) and the tensors."""

    name = "awq"
    marker = "qweight"
    suffixes = ("qweight", "qzeros", "scales")
    required = ("qweight", "qzeros", "scales")

    def _shapes(self, source: TensorSource, module: str, scheme: LinearScheme) -> tuple[int, int]:
        qweight = meta_tensor(source, f"{module}.qweight")
        if qweight.dim() != 2 or qweight.dtype != torch.int32:
            raise SourceFormatError(
                f"{module}.qweight: expected a 2-D int32 tensor (AWQ GEMM, [K, N/8]), got "
                f"{str(qweight.dtype).removeprefix('torch.')} {list(qweight.shape)}"
            )
        k, n = int(qweight.shape[0]), int(qweight.shape[1]) * 8
        if k % 8:
            raise SourceFormatError(f"{module}.qweight: {k} input rows is not a multiple of 8")
        groups = scheme.groups(k)
        if scheme.group_size != -1 and k % scheme.group_size:
            raise SourceFormatError(f"{module}.qweight: {k} inputs is not a multiple of group_size {scheme.group_size}")
        why = f"a {k}x{n} AWQ linear with group {scheme.group_size}"
        check_tensor(f"{module}.qzeros", meta_tensor(source, f"{module}.qzeros"), (groups, n // 8), (torch.int32,), why)
        check_tensor(f"{module}.scales", meta_tensor(source, f"{module}.scales"), (groups, n), (torch.float16,), why)
        return k, n

    def header_linear(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        k, n = self._shapes(source, module, scheme)
        groups = scheme.groups(k)
        meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
        zeros = None if scheme.sym else meta((groups, n), torch.uint8)
        return CanonicalLinear(meta((k // 8, n), torch.int32), meta((groups, n), torch.float16), zeros)

    def read_small(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        k, n = self._shapes(source, module, scheme)
        zeros = unpack_last(source.read(f"{module}.qzeros"), 4, AWQ_ORDER)
        if scheme.sym:
            if bool((zeros != scheme.sym_zero).any()):
                raise SourceFormatError(
                    f"{module}.qzeros: config says zero_point=False (symmetric), so every zero should read "
                    f"{scheme.sym_zero}, but the data reads {int(zeros.flatten()[0])}; fix zero_point in config.json"
                )
            zeros = None
        qweight = torch.empty((k // 8, n), dtype=torch.int32, device="meta")
        return CanonicalLinear(qweight, source.read(f"{module}.scales"), zeros)

    def read_qweight(self, source: TensorSource, module: str, scheme: LinearScheme) -> torch.Tensor:
        values = unpack_last(source.read(f"{module}.qweight"), 4, AWQ_ORDER)  # [K, N]
        return pack_along_rows(values, 4)

    def write(self, module: str, linear: CanonicalLinear, scheme: LinearScheme, like: TensorSource) -> dict:
        if linear.g_idx is not None:
            raise SourceFormatError(f"{module}: AWQ stores no g_idx, so an act-order linear has no AWQ form")
        zeros = linear.zeros
        if zeros is None:
            zeros = torch.full(tuple(linear.scales.shape), scheme.sym_zero, dtype=torch.uint8)
        return {
            f"{module}.qweight": pack_last(unpack_along_rows(linear.qweight, 4), 4, AWQ_ORDER),
            f"{module}.qzeros": pack_last(zeros, 4, AWQ_ORDER),
            f"{module}.scales": linear.scales.contiguous(),
        }
