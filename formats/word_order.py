"""Word orders of packed 4-bit qweights (formats/SPEC.md section 3): "gptq", "mma128" and "mma128_tiles", and exact
converters.

The converter stores qweights output-major (``[N, K/8]`` words per expert) while GPTQ sources are input-major
(``[K/8, N]``), so every stacked qweight is a transpose plus, for "mma128", a nibble permutation inside each
16-word block. :func:`transpose_to_word_order` does both in one pass and
:func:`transpose_from_word_order` is its exact inverse; :func:`to_word_order` / :func:`from_word_order` are the
same permutation on words that are already output-major. "mma128_tiles" is "mma128" with each expert's rows cut into
tiles (:func:`to_tiles`, :func:`from_tiles`: a reshape and one copy, no nibble moves).

Why this way (see benchmarks/RESULTS.md, "Conversion (CPU)", for the figures): the permutation is fused into the
transpose the layout needs anyway, as compiled loops (:mod:`.mma128_kernels`, numba) that take each output row's
16-word block from 16 input rows, permute it in registers with three delta swaps and store it once; as numpy
passes the same swaps cost several times the transpose itself.
"""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np
import torch

from .constants import GPTQ_ORDER, MMA128_BLOCK, MMA128_ORDER, TILE_ROWS, TILES_ORDER

_BLOCK_WORDS = MMA128_BLOCK // 8  # 16 words of 8 nibbles


def _mma128_index() -> torch.Tensor:
    """int64 [128]: entry ``8w + s`` is the block-local input that field s of word w holds in "mma128"."""
    w = torch.arange(16).view(16, 1)
    s = torch.arange(8).view(1, 8)
    return (16 * (4 * (w // 8) + s % 4) + 2 * (w % 8) + s // 4).reshape(-1)


# The definition of "mma128" as data (formats/SPEC.md section 3); the converters below compute the same
# permutation with three delta swaps per block instead of a per-nibble gather (tests/formats/test_word_order.py
# checks them against this table).
MMA128_INDEX = _mma128_index()


def to_word_order(words: torch.Tensor, order: str) -> torch.Tensor:
    """Packed "gptq"-order rows of words ``[..., N, K/8]`` (int32, K % 128 == 0 for "mma128") -> the same words in
    ``order``: the same shape, or for "mma128_tiles" ``[..., N/64, K/128, 64, 16]`` (N % 64 == 0).

    The identity (the same tensor) for "gptq"; a new tensor otherwise."""
    rows = rows_order(order)
    if _check_order(words, rows) == GPTQ_ORDER:
        return words
    flat = words.reshape(-1, words.shape[-1])
    permuted = transpose_to_word_order(flat.t(), rows).view(words.shape)
    return to_tiles(permuted) if order == TILES_ORDER else permuted


def from_word_order(words: torch.Tensor, order: str) -> torch.Tensor:
    """Exact inverse of :func:`to_word_order`: words in ``order`` -> "gptq"-order rows ``[..., N, K/8]``."""
    rows = rows_order(order)
    if order == TILES_ORDER:
        words = from_tiles(words)
    if _check_order(words, rows) == GPTQ_ORDER:
        return words
    flat = words.reshape(-1, words.shape[-1])
    return transpose_from_word_order(flat, rows).t().contiguous().view(words.shape)


def transpose_to_word_order(words: torch.Tensor, order: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Input-major "gptq" words ``[R, N]`` (a GPTQ qweight, any strides) -> output-major ``[N, R]`` in ``order``.

    Writes into ``out`` (any ``[N, R]`` int32 view, e.g. rows of a stack) when given; ``words`` is not modified."""
    _check_order(words.t(), order)
    if out is None:
        out = torch.empty(tuple(reversed(words.shape)), dtype=torch.int32)
    if order == GPTQ_ORDER:
        return out.copy_(words.t())
    if out.stride(-1) != 1:  # the loops store pairs of words
        return out.copy_(transpose_to_word_order(words, order))
    _kernels().transpose_to_mma128(_uint32(words), _word_pairs(out))
    return out


def transpose_to_tiles(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Input-major "gptq" words ``[R, N]`` -> "mma128_tiles" ``[N/64, R/16, 64, 16]``: :func:`to_tiles` of
    :func:`transpose_to_word_order`'s "mma128" rows, in one pass (each row's block stored straight into its tile).
    Writes into ``out`` (tiles whose two last axes are dense, e.g. a band range of a stack) when given."""
    rows, cols = words.shape
    _check_order(words.t(), MMA128_ORDER)
    if cols % TILE_ROWS:
        raise ValueError(f"tiles of {TILE_ROWS} rows do not cut {cols} output rows")
    shape = (cols // TILE_ROWS, rows // _BLOCK_WORDS, TILE_ROWS, _BLOCK_WORDS)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32)
    if tuple(out.shape) != shape or out.stride(-1) != 1 or out.stride(-2) != _BLOCK_WORDS:
        raise ValueError(f"transpose_to_tiles: out {list(out.shape)} is not dense {list(shape)} tiles")
    _kernels().transpose_to_mma128_tiles(_uint32(words), _uint32(out).view(np.uint64))
    return out


def transpose_from_word_order(words: torch.Tensor, order: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact inverse of :func:`transpose_to_word_order`: output-major ``[N, R]`` words in ``order`` -> input-major
    "gptq" words ``[R, N]`` (the GPTQ qweight). Writes into ``out`` when given; ``words`` is not modified."""
    _check_order(words, order)
    if out is None:
        out = torch.empty(tuple(reversed(words.shape)), dtype=torch.int32)
    if order == GPTQ_ORDER:
        return out.copy_(words.t())
    _kernels().transpose_from_mma128(_word_pairs(words if words.stride(-1) == 1 else words.contiguous()), _uint32(out))
    return out


def transpose_from_tiles(tiles: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact inverse of :func:`transpose_to_tiles`: "mma128_tiles" ``[N/64, R/16, 64, 16]`` -> input-major "gptq"
    words ``[R, N]`` (the GPTQ qweight), read out of the tiles in place (no untiled copy). Writes into ``out`` (rows
    contiguous, e.g. a column range of a wider qweight) when given; ``tiles`` is not modified."""
    bands, steps, rows, width = tiles.shape
    if (rows, width) != (TILE_ROWS, _BLOCK_WORDS) or tiles.dtype != torch.int32:
        raise ValueError(f"{tiles.dtype} {list(tiles.shape)} is not [N/64, K/128, 64, 16] int32 tiles of words")
    if out is None:
        out = torch.empty((steps * _BLOCK_WORDS, bands * TILE_ROWS), dtype=torch.int32)
    _kernels().transpose_from_mma128_tiles(_uint32(tiles.contiguous()).view(np.uint64), _uint32(out))
    return out


def to_tiles(words: torch.Tensor) -> torch.Tensor:
    """Row-major words ``[..., N, K/8]`` -> ``[..., N/64, K/128, 64, 16]``: each tile of 64 rows and one 128-input
    block (16 words) one contiguous run, tiles of a row band in K order (the "mma128_tiles" layout of "mma128"
    words). A new contiguous tensor."""
    *lead, rows, width = words.shape
    if rows % TILE_ROWS or width % _BLOCK_WORDS:
        raise ValueError(f"tiles of {TILE_ROWS} rows x {_BLOCK_WORDS} words do not cut words {list(words.shape)}")
    banded = words.reshape(*lead, rows // TILE_ROWS, TILE_ROWS, width // _BLOCK_WORDS, _BLOCK_WORDS)
    return banded.transpose(-3, -2).contiguous()


def from_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`to_tiles`: ``[..., N/64, K/128, 64, 16]`` -> row-major ``[..., N, K/8]`` (a new
    contiguous tensor)."""
    *lead, bands, steps, rows, width = tiles.shape
    if (rows, width) != (TILE_ROWS, _BLOCK_WORDS):
        raise ValueError(f"{list(tiles.shape)} is not [..., N/64, K/128, 64, 16] tiles of words")
    return tiles.transpose(-3, -2).reshape(*lead, bands * TILE_ROWS, steps * _BLOCK_WORDS)


def rows_order(order: str) -> str:
    """The order of the row-major words a tiled order cuts into tiles ("mma128" for "mma128_tiles"), else
    ``order`` itself: what the nibble converters below take."""
    return MMA128_ORDER if order == TILES_ORDER else order


def _kernels() -> ModuleType:
    """The compiled loops, imported on first use (numba takes a moment to import; loading a checkpoint needs none)."""
    from . import mma128_kernels

    return mma128_kernels


def _uint32(words: torch.Tensor) -> np.ndarray:
    """The same memory as unsigned words, so shifts are logical (no sign bits shifted in)."""
    if sys.byteorder != "little":  # the masks name nibbles and bytes of little-endian words
        raise RuntimeError("word orders are converted through little-endian words; this host is big-endian")
    return words.numpy().view(np.uint32)


def _word_pairs(words: torch.Tensor) -> np.ndarray:
    """Rows of words (last axis contiguous, even length) as 64-bit integers, each holding two words (the first in
    the low half)."""
    return _uint32(words).view(np.uint64)


def _check_order(words: torch.Tensor, order: str) -> str:
    """``order`` if it is a nibble order of row-major words these converters take (a tiled order is converted as
    its :func:`rows_order`, then cut by :func:`to_tiles`)."""
    if order not in (GPTQ_ORDER, MMA128_ORDER):
        raise ValueError(f"word order {order!r} is not a row-major nibble order ({GPTQ_ORDER!r}, {MMA128_ORDER!r})")
    if order != GPTQ_ORDER and (words.dtype != torch.int32 or words.dim() == 0 or words.shape[-1] % _BLOCK_WORDS):
        raise ValueError(f"word order {order!r} needs int32 words [..., 16 n], got {words.dtype} {list(words.shape)}")
    return order
