"""Packing unsigned b-bit fields into int32 words along the last axis, in a given field order.

Every source format packs ``32 / b`` values per int32 word; they differ in the axis and in which value goes to
which field. ``order[s]`` is the index (within its run of ``32 / b``) of the value that field ``s`` (bits
``b s .. b s + b - 1``) holds: ``0, 1, ..., 7`` for GPTQ and compressed-tensors, ``0, 2, 4, 6, 1, 3, 5, 7`` for
AutoAWQ's GEMM words.
"""

from __future__ import annotations

import torch

SEQUENTIAL_4BIT = (0, 1, 2, 3, 4, 5, 6, 7)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 values -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_last(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``[..., W]`` -> uint8 ``[..., W * 32/b]``: value ``pack w + order[s]`` is field s of word w."""
    pack = 32 // bits
    order = tuple(range(pack)) if order is None else order
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    fields = ((words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = torch.empty_like(fields)
    values[..., list(order)] = fields
    return values.reshape(*words.shape[:-1], words.shape[-1] * pack).to(torch.uint8)


def pack_last(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`unpack_last`: uint8 ``[..., W * 32/b]`` -> int32 ``[..., W]``."""
    pack = 32 // bits
    order = tuple(range(pack)) if order is None else order
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], values.shape[-1] // pack, pack)
    fields = grouped[..., list(order)]
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    return to_int32((fields << shifts).sum(dim=-1))
