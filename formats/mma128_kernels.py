"""Compiled loops of the "mma128" word order (formats/SPEC.md section 3), imported by :mod:`.word_order` on first
use so that loading a checkpoint never pays for numba.

Why compiled: the permutation moves nibbles across the 16 words of a block, which numpy can only express as many
whole-array passes (or byte gathers); one loop that takes each output row's block from the 16 input rows, swaps it
in registers and stores it once costs about what the plain transpose costs (benchmarks/RESULTS.md, "Conversion
(CPU)"). ``nogil``: the converter's hashing and writing threads run meanwhile.

The two entry loops are cached on disk where numba finds a writable place (``__pycache__`` beside this file, or
``NUMBA_CACHE_DIR``, or the user's cache folder) and compiled afresh in each process where it finds none (a
read-only install run by a user without a writable home): caching saves a second or so, it is never required.
"""

from __future__ import annotations

import numba
import numpy as np

_LOW = np.uint64(0xFFFFFFFF)
_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)  # step 1
_HALVES = np.uint64(0x0000FFFF0000FFFF)  # step 2
_BYTES = np.uint64(0xFF00FF00)  # step 3: these bytes of the low word <-> the bytes 24 bits up (of the high word)
_SHIFTS = (np.uint64(4), np.uint64(16), np.uint64(24), np.uint64(32))
_BLOCK = 16  # words of one 128-input block

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
# Each swap is its own inverse, so the inverse runs them in reverse order. The loops below hold the words c=0 and
# c=1 of the same (g, a, d) as the low and high half of one 64-bit integer, which is where steps 1-3 leave them
# (mma128 words 8g + 4a + 2d + c, so 64-bit word 4g + 2a + d of the block): steps 1 and 2 then swap between two
# such integers (d=0, d=1) and step 3 inside each, every operation serving two words.


def _compiled_loop(function):
    """``numba.njit(nogil=True)``, cached on disk when numba has somewhere to write the cache (see the docstring)."""
    try:
        return numba.njit(nogil=True, cache=True)(function)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available for file ..."
        return numba.njit(nogil=True)(function)


@numba.njit(inline="always")
def _swap(p, q, shift, mask):
    """Delta swap: the bits of ``p`` under ``mask << shift`` trade places with the bits of ``q`` under ``mask``."""
    t = ((p >> shift) ^ q) & mask
    return p ^ (t << shift), q ^ t


@numba.njit(inline="always")
def _swap_within(x, shift, mask):
    """Delta swap inside one integer: its bits under ``mask`` trade places with its bits under ``mask << shift``."""
    t = ((x >> shift) ^ x) & mask
    return x ^ t ^ (t << shift)


@numba.njit(inline="always")
def _to_mma128_pair(p, q):
    """Steps 1-3 on the 64-bit words d=0 (``p``) and d=1 (``q``) of one (g, a)."""
    nibble, half, byte, _ = _SHIFTS
    p, q = _swap(p, q, nibble, _NIBBLES)
    p, q = _swap(p, q, half, _HALVES)
    return _swap_within(p, byte, _BYTES), _swap_within(q, byte, _BYTES)


@numba.njit(inline="always")
def _from_mma128_pair(p, q):
    """Exact inverse of :func:`_to_mma128_pair`: steps 3, 2, 1."""
    nibble, half, byte, _ = _SHIFTS
    p, q = _swap_within(p, byte, _BYTES), _swap_within(q, byte, _BYTES)
    p, q = _swap(p, q, half, _HALVES)
    return _swap(p, q, nibble, _NIBBLES)


@_compiled_loop
def transpose_to_mma128(source, target):
    """Input-major "gptq" words ``source [R, N]`` (uint32) -> output-major "mma128" words ``target [N, R/2]`` (uint64,
    the view of ``[N, R]`` uint32 words)."""
    rows, cols = source.shape
    high = _SHIFTS[3]
    for start in range(0, rows, _BLOCK):
        for n in range(cols):
            block = target[n, start // 2 : (start + _BLOCK) // 2]
            for g in range(2):
                for a in range(2):
                    row = start + 8 * g + a  # word (g, c=0, d=0, a); c=1 is 4 rows on, d=1 2 rows on
                    p = np.uint64(source[row, n]) | (np.uint64(source[row + 4, n]) << high)
                    q = np.uint64(source[row + 2, n]) | (np.uint64(source[row + 6, n]) << high)
                    block[4 * g + 2 * a], block[4 * g + 2 * a + 1] = _to_mma128_pair(p, q)


@_compiled_loop
def transpose_from_mma128(source, target):
    """Exact inverse of :func:`transpose_to_mma128`: output-major "mma128" ``source [N, R/2]`` (uint64) -> input-major
    "gptq" ``target [R, N]`` (uint32)."""
    cols, rows = source.shape[0], 2 * source.shape[1]
    high = _SHIFTS[3]
    for start in range(0, rows, _BLOCK):
        for n in range(cols):
            block = source[n, start // 2 : (start + _BLOCK) // 2]
            for g in range(2):
                for a in range(2):
                    p, q = _from_mma128_pair(block[4 * g + 2 * a], block[4 * g + 2 * a + 1])
                    row = start + 8 * g + a
                    target[row, n], target[row + 4, n] = p & _LOW, p >> high
                    target[row + 2, n], target[row + 6, n] = q & _LOW, q >> high
