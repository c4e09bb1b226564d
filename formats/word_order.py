"""Word orders of packed 4-bit qweights (formats/SPEC.md section 3): "gptq" and "mma128", and exact converters.

The converter stores qweights output-major (``[N, K/8]`` words per expert) while GPTQ sources are input-major
(``[K/8, N]``), so every stacked qweight is a transpose plus, for "mma128", a nibble permutation inside each
16-word block. :func:`transpose_to_word_order` does both in one pass over cache-sized blocks and
:func:`transpose_from_word_order` is its exact inverse; :func:`to_word_order` / :func:`from_word_order` are the
same permutation on words that are already output-major.

Why this way (see benchmarks/RESULTS.md for the figures): the permutation is done input-major, where the 16
words of a block are 16 rows of ``N`` contiguous words, so every step is a whole-row numpy bit operation on
long vectors (three delta swaps between pairs of rows) instead of a byte-granular gather or a permuted copy
with 4-byte inner runs; the rows land in "mma128" order as they are written, so the only transpose left is
the plain one the layout needs anyway. Blocks of 16 rows keep the swaps in cache.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .constants import GPTQ_ORDER, MMA128_BLOCK, WORD_ORDERS

_BLOCK_WORDS = MMA128_BLOCK // 8  # 16 words of 8 nibbles


def _mma128_index() -> torch.Tensor:
    """int64 [128]: entry ``8w + s`` is the block-local input that field s of word w holds in "mma128"."""
    w = torch.arange(16).view(16, 1)
    s = torch.arange(8).view(1, 8)
    return (16 * (4 * (w // 8) + s % 4) + 2 * (w % 8) + s // 4).reshape(-1)


# The definition of "mma128" as data (formats/SPEC.md section 3); the converters below compute the same
# permutation with whole-row bit operations instead of a per-nibble gather (tests/formats/test_word_order.py
# checks them against this table).
MMA128_INDEX = _mma128_index()


# Why three swaps suffice. Label a block's "gptq" words (g, c, d, a), word 8g + 4c + 2d + a, and a word's bytes
# b = 0..3: nibble h of byte b of word (g, c, d, a) holds input 16 (4g + 2c + d) + 2 (4a + b) + h, which "mma128"
# puts in field 4h + 2c + d of word 8g + 4a + b.
#   1. Between words d=0 and d=1, the high nibbles of d=0 trade places with the low nibbles of d=1: the pair
#      then holds nibble plane h in its word d=h, byte b being (nibble h of d=0's byte b, nibble h of d=1's).
#      That byte is exactly byte 2h + c of mma128 word 8g + 4a + b, so what is left, for each (g, a), is a
#      4x4 byte transpose between the words (c, h) and the bytes b.
#   2. Swap 16-bit halves between the words h=0 and h=1 of the same c,
#   3. then bytes between the words c=0 and c=1 of the same h: word (g, c, h, a) now is mma128 word
#      8g + 4a + 2h + c.
# Step 1 writes each word to the row that step 3 leaves it as, so no reordering remains; each swap is its own
# inverse, so the inverse runs them in reverse order.
_NIBBLES = (4, 0x0F0F0F0F)  # (shift, mask) of step 1
_HALVES = (16, 0x0000FFFF)
_BYTES = (8, 0x00FF00FF)


def to_word_order(words: torch.Tensor, order: str) -> torch.Tensor:
    """Packed "gptq"-order words ``[..., K/8]`` (int32, K % 128 == 0 for "mma128") -> the same words in ``order``.

    The identity (the same tensor) for "gptq"; a new tensor otherwise."""
    if _check_order(words, order) == GPTQ_ORDER:
        return words
    flat = words.reshape(-1, words.shape[-1])
    return transpose_to_word_order(flat.t(), order).view(words.shape)


def from_word_order(words: torch.Tensor, order: str) -> torch.Tensor:
    """Exact inverse of :func:`to_word_order`: words in ``order`` -> "gptq"-order words."""
    if _check_order(words, order) == GPTQ_ORDER:
        return words
    flat = words.reshape(-1, words.shape[-1])
    return transpose_from_word_order(flat, order).t().contiguous().view(words.shape)


def transpose_to_word_order(words: torch.Tensor, order: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Input-major "gptq" words ``[R, N]`` (a GPTQ qweight, any strides) -> output-major ``[N, R]`` in ``order``.

    Writes into ``out`` (any ``[N, R]`` int32 view, e.g. rows of a stack) when given; ``words`` is not modified."""
    _check_order(words.t(), order)
    rows, cols = words.shape
    out, arrays = _transposing(words, out, order, cols)
    if arrays is None:
        return out
    source, target, scratch, temp = arrays
    for start in range(0, rows, _BLOCK_WORDS):
        block = _labelled(source[start : start + _BLOCK_WORDS], "gcda")
        mma = _labelled(scratch, "gadc")  # rows in mma128 order, viewed by their gptq labels
        _delta_swap(block[:, 0], block[:, 1], *_NIBBLES, temp, into=(mma[:, 0], mma[:, 1]))
        _delta_swap(mma[:, 0], mma[:, 1], *_HALVES, temp)
        _delta_swap(mma[:, :, 0], mma[:, :, 1], *_BYTES, temp)
        np.copyto(target[:, start : start + _BLOCK_WORDS], scratch.T)
    return out


def transpose_from_word_order(words: torch.Tensor, order: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact inverse of :func:`transpose_to_word_order`: output-major ``[N, R]`` words in ``order`` -> input-major
    "gptq" words ``[R, N]`` (the GPTQ qweight). Writes into ``out`` when given; ``words`` is not modified."""
    _check_order(words, order)
    cols, rows = words.shape
    out, arrays = _transposing(words, out, order, cols)
    if arrays is None:
        return out
    source, target, scratch, temp = arrays
    for start in range(0, rows, _BLOCK_WORDS):
        np.copyto(scratch, source[:, start : start + _BLOCK_WORDS].T)
        mma = _labelled(scratch, "gadc")
        _delta_swap(mma[:, :, 0], mma[:, :, 1], *_BYTES, temp)
        _delta_swap(mma[:, 0], mma[:, 1], *_HALVES, temp)
        block = _labelled(target[start : start + _BLOCK_WORDS], "gcda")
        _delta_swap(mma[:, 0], mma[:, 1], *_NIBBLES, temp, into=(block[:, 0], block[:, 1]))
    return out


def _transposing(
    words: torch.Tensor, out: torch.Tensor | None, order: str, cols: int
) -> tuple[torch.Tensor, tuple[np.ndarray, ...] | None]:
    """The output (``out`` or a new int32 tensor of the transposed shape) and, for "mma128", the arrays the block
    loop works on: words and output as uint32, the scratch rows of one block (``cols`` wide) and the temporary
    words of a delta swap. For "gptq" the output already holds the answer (a plain transpose) and no arrays."""
    if out is None:
        out = torch.empty(tuple(reversed(words.shape)), dtype=torch.int32)
    if order == GPTQ_ORDER:
        return out.copy_(words.t()), None
    scratch = np.empty((_BLOCK_WORDS, cols), dtype=np.uint32)
    return out, (_uint32(words), _uint32(out), scratch, np.empty_like(scratch[: _BLOCK_WORDS // 2]))


def _labelled(rows: np.ndarray, layout: str) -> np.ndarray:
    """16 rows of one block, laid out as ``layout`` (the order of the labels g, c, d, a along the rows, each
    0 or 1), viewed with axes (g, d, c, a, column): ``view[:, d]`` are the step-1 pairs and ``view[:, :, c]``
    the step-3 pairs whatever the physical row order."""
    view = rows.reshape(2, 2, 2, 2, rows.shape[-1])
    return view.transpose(*(layout.index(label) for label in "gdca"), 4)


def _delta_swap(
    p: np.ndarray,
    q: np.ndarray,
    shift: int,
    mask: int,
    temp: np.ndarray,
    *,
    into: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """Exchange the bits of ``p`` under ``mask << shift`` with the bits of ``q`` under ``mask``, in place or
    written to ``into``; ``temp`` holds as many words as ``p``. ``mask << shift`` fits in 32 bits."""
    t = temp.reshape(p.shape)
    dp, dq = into or (p, q)
    np.right_shift(p, shift, out=t)
    np.bitwise_xor(t, q, out=t)
    np.bitwise_and(t, mask, out=t)
    np.bitwise_xor(q, t, out=dq)
    np.left_shift(t, shift, out=t)
    np.bitwise_xor(p, t, out=dp)


def _uint32(words: torch.Tensor) -> np.ndarray:
    """The same memory as unsigned words, so shifts are logical (no sign bits shifted in)."""
    if sys.byteorder != "little":  # the masks name nibbles and bytes of little-endian words
        raise RuntimeError("word orders are converted through little-endian words; this host is big-endian")
    return words.numpy().view(np.uint32)


def _check_order(words: torch.Tensor, order: str) -> str:
    if order not in WORD_ORDERS:
        raise ValueError(f"word order {order!r} is not one of {WORD_ORDERS}")
    if order != GPTQ_ORDER and (words.dtype != torch.int32 or words.dim() == 0 or words.shape[-1] % _BLOCK_WORDS):
        raise ValueError(f"word order {order!r} needs int32 words [..., 16 n], got {words.dtype} {list(words.shape)}")
    return order
