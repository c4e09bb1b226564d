"""The GPTQ source format, read exactly as GPTQModel and AutoGPTQ write it.

One GPTQ linear (``nn.Linear(in=K, out=N)``) is stored as four tensors:

- ``qweight`` int32 ``[K * bits / 32, N]``: packed along K. For 4 bits, element ``k = 8 r + s`` of
  column n sits in bits ``4 s .. 4 s + 3`` of word ``qweight[r, n]`` (little-endian nibbles).
- ``qzeros`` int32 ``[G, N * bits / 32]``: packed along N the same way, ``G = ceil(K / group)``.
- ``scales`` float16 ``[G, N]``.
- ``g_idx`` int32 ``[K]``: the group of each input row. Trivial (``k // group``) without act-order; with
  act-order it is the group of the row's rank in the Hessian order, stored in the original row order.
- optional ``bias`` float16 ``[N]``.

Zero points. ``checkpoint_format == "gptq"`` (v1, what Qwen ships) stores ``zero - 1``. GPTQModel writes
v1 by subtracting ``0x11111111`` (for 4 bits) from the whole int32 word and reads it back by adding the
same constant to the word, so a borrow can cross nibbles when a true zero is 0. AutoGPTQ adds 1 per
nibble instead; the two readings differ only where a true zero is 0. We follow GPTQModel (word-level),
which is also the reading that round-trips every stored word bit for bit. ``"gptq_v2"`` stores the zero.

Dequantization (GPTQModel's TorchLinear): ``W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`` with
``g = g_idx[k]``, computed in the activation dtype: ``(q - zero)`` is exact, the product is rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .schemes import GptqFormatError, GptqScheme

LINEAR_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
OPTIONAL_SUFFIXES = ("bias",)


@dataclass
class GptqLinear:
    """The stored tensors of one GPTQ linear, untouched."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def from_tensors(cls, tensors, module: str) -> GptqLinear:
        """The linear ``module`` out of a name -> tensor mapping (a dict, or anything with ``get``)."""
        return cls(
            qweight=tensors[f"{module}.qweight"],
            qzeros=tensors[f"{module}.qzeros"],
            scales=tensors[f"{module}.scales"],
            g_idx=tensors.get(f"{module}.g_idx"),
            bias=tensors.get(f"{module}.bias"),
        )

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    def in_features(self, scheme: GptqScheme) -> int:
        return int(self.qweight.shape[0]) * scheme.pack_factor


def _word_constant(bits: int) -> int:
    """0x11111111 for 4 bits, 0x01010101 for 8 bits: +1 in every field of one word."""
    value = 0
    for s in range(32 // bits):
        value |= 1 << (bits * s)
    return value


def _as_uint32(words: torch.Tensor) -> torch.Tensor:
    return words.to(torch.int64) & 0xFFFFFFFF


def unpack_along_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[K*bits/32, N]`` -> uint8 ``[K, N]``; field s of row r is row ``r * (32/bits) + s``."""
    pack = 32 // bits
    words = _as_uint32(qweight)
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    fields = (words.unsqueeze(1) >> shifts.view(1, pack, 1)) & ((1 << bits) - 1)
    return fields.reshape(words.shape[0] * pack, words.shape[1]).to(torch.uint8)


def pack_along_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_along_rows`."""
    pack = 32 // bits
    k, n = q.shape
    fields = q.to(torch.int64).reshape(k // pack, pack, n)
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    words = (fields << shifts.view(1, pack, 1)).sum(dim=1)
    return _to_int32(words)


def unpack_along_cols(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[G, N*bits/32]`` -> uint8 ``[G, N]``; field s of column c is column ``c * (32/bits) + s``."""
    return unpack_along_rows(qzeros.t(), bits).t().contiguous()


def pack_along_cols(z: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_along_rows(z.t().contiguous(), bits).t().contiguous()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 values -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def read_zero_points(qzeros: torch.Tensor, scheme: GptqScheme) -> torch.Tensor:
    """The true zero points, uint8 ``[G, N]`` (v1: stored + 1, added to the whole word like GPTQModel)."""
    if scheme.checkpoint_format == "gptq":
        qzeros = _to_int32(_as_uint32(qzeros) + _word_constant(scheme.bits))
    return unpack_along_cols(qzeros, scheme.bits)


def write_zero_points(zeros: torch.Tensor, scheme: GptqScheme) -> torch.Tensor:
    """Inverse of :func:`read_zero_points`: true zeros -> the stored int32 ``qzeros`` words."""
    words = pack_along_cols(zeros, scheme.bits)
    if scheme.checkpoint_format == "gptq":
        words = _to_int32(_as_uint32(words) - _word_constant(scheme.bits))
    return words


def trivial_g_idx(in_features: int, scheme: GptqScheme) -> torch.Tensor:
    return torch.arange(in_features, dtype=torch.int32) // scheme.group_len(in_features)


def check_linear(name: str, linear: GptqLinear, scheme: GptqScheme) -> None:
    """Shapes, dtypes and g_idx range of one linear; raises :class:`GptqFormatError` naming ``name``."""
    if linear.qweight.dtype != torch.int32 or linear.qweight.dim() != 2:
        raise GptqFormatError(f"{name}.qweight: expected a 2-D int32 tensor, got {_describe(linear.qweight)}")
    k = linear.in_features(scheme)
    n = linear.out_features
    groups = scheme.groups(k)
    expected = {
        "qzeros": ((groups, n // scheme.pack_factor), torch.int32),
        "scales": ((groups, n), torch.float16),
    }
    if n % scheme.pack_factor:
        raise GptqFormatError(f"{name}.qweight: {n} output columns is not a multiple of {scheme.pack_factor}")
    for suffix, (shape, dtype) in expected.items():
        tensor = getattr(linear, suffix)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise GptqFormatError(
                f"{name}.{suffix}: expected {dtype_name(dtype)} {list(shape)} for a {k}x{n} linear with "
                f"{scheme.bits}-bit group {scheme.group_size}, got {_describe(tensor)}"
            )
    if linear.g_idx is not None:
        g = linear.g_idx
        if g.dtype != torch.int32:
            raise GptqFormatError(f"{name}.g_idx: expected int32, got {_describe(g)}; re-save it as int32")
        if g.dim() != 1 or g.numel() != k:
            raise GptqFormatError(f"{name}.g_idx: expected {k} entries (one per input row), got {_describe(g)}")
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
            raise GptqFormatError(
                f"{name}.g_idx: group ids must lie in [0, {groups}), found [{int(g.min())}, {int(g.max())}]"
            )
    if linear.bias is not None and tuple(linear.bias.shape) != (n,):
        raise GptqFormatError(f"{name}.bias: expected [{n}], got {_describe(linear.bias)}")


def check_zero_points(name: str, linear: GptqLinear, scheme: GptqScheme) -> None:
    """Refuse zeros that contradict the config: a symmetric scheme must hold the symmetric zero everywhere."""
    if not scheme.sym:
        return
    zeros = read_zero_points(linear.qzeros, scheme)
    if bool((zeros != scheme.sym_zero).any()):
        stored = int(zeros.flatten()[0])
        other = "gptq_v2" if scheme.checkpoint_format == "gptq" else "gptq"
        raise GptqFormatError(
            f"{name}.qzeros: config says sym=True with checkpoint_format '{scheme.checkpoint_format}', so every "
            f"zero point should read {scheme.sym_zero}, but the data reads {stored} (is it '{other}'?); fix "
            "quantization_config.checkpoint_format or sym in config.json"
        )


def dequantize(linear: GptqLinear, scheme: GptqScheme, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` weight in ``dtype``, computed exactly as GPTQModel's TorchLinear does."""
    q = unpack_along_rows(linear.qweight, scheme.bits).to(torch.int32)
    zeros = read_zero_points(linear.qzeros, scheme).to(torch.int32)
    k = q.shape[0]
    g_idx = linear.g_idx.long() if linear.g_idx is not None else trivial_g_idx(k, scheme).long()
    diff = (q - zeros[g_idx]).to(dtype)
    weight = linear.scales.to(dtype)[g_idx] * diff
    return weight.t().contiguous()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(tensor: torch.Tensor) -> str:
    return f"{dtype_name(tensor.dtype)} {list(tensor.shape)}"
