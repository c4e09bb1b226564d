"""compressed-tensors (llm-compressor) as a source format: ``pack-quantized`` integer weights, activations unquantized.

One linear ``nn.Linear(in=K, out=N)`` stores:

- ``weight_packed`` int32 ``[N, K * b / 32]``: packed along the **input**; value ``q + 2^(b-1)`` (the signed value
  made unsigned) of input ``k = (32 / b) r + s`` sits in field ``s`` of word ``[n, r]`` (``pack_to_int32``);
- ``weight_scale`` ``[N, G]`` in the model's float dtype: G groups (strategy "group", ``group_size``) or 1 (strategy
  "channel");
- ``weight_zero_point`` int32 ``[N * b / 32, G]`` (asymmetric only): the signed zero points packed the same way but
  along the **output** dimension; a symmetric scheme stores none (its zero is 0, unsigned ``2^(b-1)``);
- ``weight_shape`` int64 ``[2]`` = ``[N, K]``; ``weight_g_idx`` int32 ``[K]`` with ``actorder: "group"``.

and ``W[n, k] = scale[n, g] * (q[n, k] - zp[n, g])``. Signed minus signed equals unsigned minus unsigned, so the
canonical values and zeros are the stored unsigned ones: the canonical qweight is ``weight_packed`` transposed, not a
field moved. Scales of another float dtype (bfloat16, float32) are taken where every value is a float16 exactly
(and written back in their own dtype), else refused: the format stores float16 scales.

Which linears are quantized, and how: each ``config_groups`` entry's ``targets`` (``"Linear"``, an exact module
name, or ``"re:<regex>"``) with its ``weights`` arguments, the most specific match winning; ``ignore`` (names or
``re:`` regexes) wins over every target.
"""

from __future__ import annotations

import torch

from ..source_configs import CompressedTensorsConfig
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

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CompressedTensorsSource(CompressedTensorsConfig, SourceFormat):
    """The config (formats/source_configs.py: config_groups, ignore, strategies) and the tensors."""

    name = "compressed-tensors"
    marker = "weight_packed"
    suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    required = ("weight_packed", "weight_scale", "weight_shape")

    def _shapes(self, source: TensorSource, module: str, scheme: LinearScheme, shape: tuple[int, int] | None):
        """(K, N) after checking every stored tensor's dtype and shape; ``shape`` is weight_shape's value."""
        packed = meta_tensor(source, f"{module}.weight_packed")
        if packed.dim() != 2 or packed.dtype != torch.int32:
            raise SourceFormatError(
                f"{module}.weight_packed: expected a 2-D int32 tensor ([N, K*bits/32], pack-quantized), got "
                f"{str(packed.dtype).removeprefix('torch.')} {list(packed.shape)}"
            )
        n, words = (int(d) for d in packed.shape)
        k = words * scheme.pack_factor if shape is None else shape[1]
        if shape is not None and (shape[0] != n or k != words * scheme.pack_factor):
            raise SourceFormatError(
                f"{module}.weight_shape: says {shape[0]}x{shape[1]} (out x in) but weight_packed {list(packed.shape)} "
                f"holds {n} rows of {words * scheme.pack_factor} {scheme.bits}-bit inputs; inputs must fill whole "
                "int32 words and the shapes agree (re-export the checkpoint)"
            )
        if n % scheme.pack_factor:
            raise SourceFormatError(f"{module}.weight_packed: {n} outputs is not a multiple of {scheme.pack_factor}")
        groups = scheme.groups(k)
        why = f"a {k}x{n} {scheme.bits}-bit linear, group {scheme.group_size}"
        scale = meta_tensor(source, f"{module}.weight_scale")
        check_tensor(f"{module}.weight_scale", scale, (n, groups), SCALE_DTYPES, why)
        zero = f"{module}.weight_zero_point"
        if scheme.sym and zero in source:
            raise SourceFormatError(f"{zero}: present, but the config says symmetric (no zero point); fix the config")
        if not scheme.sym:
            if zero not in source:
                raise SourceFormatError(
                    f"{zero}: missing, but the config says asymmetric; the checkpoint is incomplete"
                )
            stored = meta_tensor(source, zero)
            check_tensor(zero, stored, (n // scheme.pack_factor, groups), (torch.int32,), why + ", packed along N")
        g_idx = f"{module}.weight_g_idx"
        if g_idx in source:
            check_tensor(g_idx, meta_tensor(source, g_idx), (k,), (torch.int32,), why)
        return k, n

    def _weight_shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        name = f"{module}.weight_shape"
        entry = source.entry(name)
        if tuple(entry.shape) != (2,) or entry.torch_dtype not in (torch.int64, torch.int32):
            raise SourceFormatError(
                f"{name}: expected an integer tensor of 2 entries [out, in], got {list(entry.shape)}"
            )
        n, k = (int(v) for v in source.read(name))
        return n, k

    def _g_idx(self, source: TensorSource, module: str, k: int, scheme: LinearScheme) -> torch.Tensor | None:
        name = f"{module}.weight_g_idx"
        if name not in source:
            return None
        g_idx = source.read(name)
        groups = scheme.groups(k)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise SourceFormatError(f"{name}: group ids must lie in [0, {groups}), found [{int(g_idx.min())}, "
                                    f"{int(g_idx.max())}]")  # fmt: skip
        return g_idx

    def header_linear(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        k, n = self._shapes(source, module, scheme, self._weight_shape(source, module))
        groups = scheme.groups(k)
        meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
        zeros = None if scheme.sym else meta((groups, n), torch.uint8)
        qweight = meta((k // scheme.pack_factor, n), torch.int32)
        return CanonicalLinear(qweight, meta((groups, n), torch.float16), zeros, self._g_idx(source, module, k, scheme))

    def read_small(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        k, n = self._shapes(source, module, scheme, self._weight_shape(source, module))
        scales = exact_float16(source.read(f"{module}.weight_scale"), f"{module}.weight_scale").t().contiguous()
        zeros = None
        if not scheme.sym:
            packed = source.read(f"{module}.weight_zero_point")
            zeros = unpack_last(packed.t().contiguous(), scheme.bits)  # [G, N], unsigned
        qweight = torch.empty((k // scheme.pack_factor, n), dtype=torch.int32, device="meta")
        return CanonicalLinear(qweight, scales, zeros, self._g_idx(source, module, k, scheme))

    def read_qweight(self, source: TensorSource, module: str, scheme: LinearScheme) -> torch.Tensor:
        return source.read(f"{module}.weight_packed").t().contiguous()

    def write(self, module: str, linear: CanonicalLinear, scheme: LinearScheme, like: TensorSource) -> dict:
        k, n = linear.in_features(scheme), linear.out_features
        scale_name, shape_name = f"{module}.weight_scale", f"{module}.weight_shape"
        scale_dtype = like.entry(scale_name).torch_dtype if scale_name in like else torch.float16
        shape_dtype = like.entry(shape_name).torch_dtype if shape_name in like else torch.int64
        out = {
            f"{module}.weight_packed": linear.qweight.t().contiguous(),
            scale_name: linear.scales.t().to(scale_dtype).contiguous(),
            shape_name: torch.tensor([n, k], dtype=shape_dtype),
        }
        if linear.zeros is not None:
            out[f"{module}.weight_zero_point"] = pack_last(linear.zeros, scheme.bits).t().contiguous()
        if linear.g_idx is not None:
            out[f"{module}.weight_g_idx"] = linear.g_idx.contiguous()
        return out


def exact_float16(scales: torch.Tensor, name: str) -> torch.Tensor:
    """``scales`` as float16, refused unless every value is a float16 exactly (so the inverse restores the bits)."""
    if scales.dtype == torch.float16:
        return scales
    half = scales.to(torch.float16)
    back = half.to(scales.dtype)
    if not torch.equal(back.view(torch.int16 if scales.itemsize == 2 else torch.int32),
                       scales.view(torch.int16 if scales.itemsize == 2 else torch.int32)):  # fmt: skip
        raise SourceFormatError(
            f"{name}: {str(scales.dtype).removeprefix('torch.')} scales that float16 cannot hold exactly (the format "
            "stores float16 scales); quantize the model in float16 (load it with dtype=torch.float16)"
        )
    return half
