"""Compiled loops of the "mma128" word order (formats/SPEC.md section 3), imported by :mod:`.word_order` on first
use so that loading a checkpoint never pays for numba.

Why compiled: the permutation moves nibbles across the 16 words of a block, which numpy can only express as many
whole-array passes (or byte gathers); one loop that takes each output row's block from the 16 input rows, swaps it
in registers and stores it once costs about what the plain transpose costs (benchmarks/RESULTS.md, "Conversion
(CPU)"). ``nogil``: the converter's hashing and writing threads run meanwhile.
"""

from __future__ import annotations

import numba
import numpy as np

_NIBBLES = np.uint32(0x0F0F0F0F)  # step 1: high nibbles of the first word <-> low nibbles of the second
_HALVES = np.uint32(0x0000FFFF)  # step 2
_BYTES = np.uint32(0x00FF00FF)  # step 3
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
# Step 1 writes each word to the row that step 3 leaves it as, so no reordering remains; each swap is its own
# inverse, so the inverse runs them in reverse order.


@numba.njit(inline="always")
def _swap(p, q, shift, mask):
    """Delta swap: the bits of ``p`` under ``mask << shift`` trade places with the bits of ``q`` under ``mask``."""
    t = ((p >> shift) ^ q) & mask
    return p ^ (t << shift), q ^ t


@numba.njit(nogil=True, cache=True)
def _swap_halves_then_bytes(block, undo):
    """Steps 2 and 3 on one block in "mma128" positions (or, with ``undo``, step 3 then step 2: each is its own
    inverse)."""
    for step in range(2):
        halves = (step == 0) != undo
        for g in range(2):
            for a in range(2):
                for x in range(2):
                    if halves:  # pairs d=0, d=1 of the same c = x
                        i, j, shift, mask = 8 * g + 4 * a + x, 8 * g + 4 * a + 2 + x, 16, _HALVES
                    else:  # pairs c=0, c=1 of the same d = x
                        i, j, shift, mask = 8 * g + 4 * a + 2 * x, 8 * g + 4 * a + 2 * x + 1, 8, _BYTES
                    block[i], block[j] = _swap(block[i], block[j], shift, mask)


@numba.njit(nogil=True, cache=True)
def transpose_to_mma128(source, target):
    """Input-major "gptq" words ``source [R, N]`` (uint32) -> output-major "mma128" words ``target [N, R]``."""
    rows, cols = source.shape
    for start in range(0, rows, _BLOCK):
        for n in range(cols):
            block = target[n, start : start + _BLOCK]
            for g in range(2):
                for c in range(2):
                    for a in range(2):
                        row = start + 8 * g + 4 * c + a
                        low, high = _swap(source[row, n], source[row + 2, n], 4, _NIBBLES)
                        block[8 * g + 4 * a + c] = low
                        block[8 * g + 4 * a + 2 + c] = high
            _swap_halves_then_bytes(block, False)


@numba.njit(nogil=True, cache=True)
def transpose_from_mma128(source, target):
    """Exact inverse of :func:`transpose_to_mma128`: output-major "mma128" ``source [N, R]`` -> input-major "gptq"
    ``target [R, N]``."""
    cols, rows = source.shape
    block = np.empty(_BLOCK, dtype=np.uint32)
    for start in range(0, rows, _BLOCK):
        for n in range(cols):
            block[:] = source[n, start : start + _BLOCK]
            _swap_halves_then_bytes(block, True)
            for g in range(2):
                for c in range(2):
                    for a in range(2):
                        row = start + 8 * g + 4 * c + a
                        low, high = _swap(block[8 * g + 4 * a + c], block[8 * g + 4 * a + 2 + c], 4, _NIBBLES)
                        target[row, n] = low
                        target[row + 2, n] = high
