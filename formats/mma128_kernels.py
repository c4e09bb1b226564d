"""Compiled loops of the "mma128" word order (formats/SPEC.md section 3), imported by :mod:`.word_order` on first
use so that loading a checkpoint never pays for numba.

Why compiled: the permutation moves nibbles across the 16 words of a block, which numpy can only express as many
whole-array passes (or byte gathers); one loop that takes each output row's block from the 16 input rows, swaps it
in registers and stores it once costs about what the plain transpose costs (benchmarks/RESULTS.md, "Conversion
(CPU)"); the inverse goes through a scratch panel instead (see :func:`transpose_from_mma128`). ``nogil``: the
converter's hashing and writing threads run meanwhile.

The entry loops are cached on disk where numba finds a writable place (``__pycache__`` beside this file, or
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


@numba.njit(inline="always")
def _store_block(source, start, n, block):
    """Column ``n``'s input rows ``start .. start + 15`` of ``source`` permuted into one "mma128" block: ``block``,
    8 64-bit words (wherever the layout keeps that row's block)."""
    high = _SHIFTS[3]
    for g in range(2):
        for a in range(2):
            row = start + 8 * g + a  # word (g, c=0, d=0, a); c=1 is 4 rows on, d=1 2 rows on
            p = np.uint64(source[row, n]) | (np.uint64(source[row + 4, n]) << high)
            q = np.uint64(source[row + 2, n]) | (np.uint64(source[row + 6, n]) << high)
            block[4 * g + 2 * a], block[4 * g + 2 * a + 1] = _to_mma128_pair(p, q)


@_compiled_loop
def transpose_to_mma128(source, target):
    """Input-major "gptq" words ``source [R, N]`` (uint32) -> output-major "mma128" words ``target [N, R/2]`` (uint64,
    the view of ``[N, R]`` uint32 words)."""
    rows, cols = source.shape
    for start in range(0, rows, _BLOCK):
        for n in range(cols):
            _store_block(source, start, n, target[n, start // 2 : (start + _BLOCK) // 2])


@_compiled_loop
def transpose_to_mma128_tiles(source, target):
    """:func:`transpose_to_mma128` into "mma128_tiles": ``target [N/64, R/16, 64, 8]`` (uint64, the view of the
    ``[N/64, K/128, 64, 16]`` uint32 tiles), each output row's 16-word block stored straight into its tile."""
    rows, cols = source.shape
    tile_rows = target.shape[2]
    for start in range(0, rows, _BLOCK):
        for n in range(cols):
            _store_block(source, start, n, target[n // tile_rows, start // _BLOCK, n % tile_rows])


# The inverse, in panels. Turned around, the forward loop reads one 64-byte line per output column across the whole
# input (loads that miss stall, where the forward loop's equally scattered stores did not) and stores into 16 rows 4
# bytes at a time, rows that share one L1 set whenever a row is a multiple of 4 KB long (N % 1024 == 0: Qwen2-57B's
# w13, most DeepSeek-V3 and Mixtral shapes): it ran at 0.33-0.5x the forward loop's speed there, 0.75-0.85x
# elsewhere. So the inverse takes up to ``_PANEL_BYTES`` of input rows at a time (one contiguous piece of
# ``source``), reads them front to back once, which brings them into L2, permutes them from there into a scratch
# panel ``_TILE`` columns at a time (each column's 8-word block gathered into a small stage, then the three swaps and
# the stores vectorized across the columns) and copies each scratch row into ``target`` whole. Indices are unsigned
# so that numba's handling of negative indices stays out of the loops LLVM vectorizes.
# benchmarks/bench_word_order.py measures both directions.
_TILE = 32  # columns permuted together (the vectorized loops' trip count)
_PANEL_BYTES = 512 << 10  # at most this much input per panel, and as much scratch: both stay in a 2 MB L2
_PANEL_COLUMNS = 1024  # columns per panel where rows are short (else ``_PANEL_BYTES`` decides)
_U = np.uint64


@numba.njit(inline="always")
def _block_start(row, block, row_words, tiled):
    """Index of 64-bit word ``block`` (a multiple of 8: one 16-word block) of output row ``row`` in the flat source:
    rows ``[N, R/2]``, or with ``tiled`` "mma128_tiles" ``[N/64, R/16, 64, 8]`` (row r's block b at
    ((r / 64 * R/16 + b / 8) * 64 + r % 64) * 8)."""
    if tiled:
        return (((row >> _U(6)) * (row_words >> _U(3)) + (block >> _U(3))) * _U(64) + (row & _U(63))) * _U(8)
    return row * row_words + block


@numba.njit(inline="always")
def _stage_tile(words, stage, column, row_words, block, tiled):
    """Block ``block`` (8 64-bit words) of the ``_TILE`` input rows from ``column`` on, as ``stage [8, _TILE]``."""
    tile = _U(_TILE)
    for j in range(_TILE):
        uj = _U(j)
        base = _block_start(column + uj, block, row_words, tiled)
        for k in range(8):
            uk = _U(k)
            stage[uk * tile + uj] = words[base + uk]


@numba.njit(inline="always")
def _unstage_tile(stage, panel, start, column, width):
    """The inverse swaps on a staged tile, stored as its 16 "gptq" rows ``start ..`` of ``panel [R, width]``, words
    ``column .. column + _TILE`` of each."""
    tile = _U(_TILE)
    high = _SHIFTS[3]
    for g in range(2):
        for a in range(2):
            k = _U(4 * g + 2 * a)
            row = start + _U(8 * g + a)  # word (g, c=0, d=0, a); c=1 is 4 rows on, d=1 2 rows on
            r0 = row * width + column
            r2, r4, r6 = r0 + _U(2) * width, r0 + _U(4) * width, r0 + _U(6) * width
            sp = k * tile
            sq = sp + tile
            for j in range(_TILE):
                uj = _U(j)
                p, q = _from_mma128_pair(stage[sp + uj], stage[sq + uj])
                panel[r0 + uj], panel[r4 + uj] = p & _LOW, p >> high
                panel[r2 + uj], panel[r6 + uj] = q & _LOW, q >> high


def transpose_from_mma128(source, target):
    """Exact inverse of :func:`transpose_to_mma128`: output-major "mma128" ``source [N, R/2]`` (uint64) -> input-major
    "gptq" ``target [R, N]`` (uint32). In panels where ``source`` is C-contiguous and ``target``'s rows are
    contiguous, at any distance from each other (a column slice of a wider array: the gate or up columns of a source
    expert); other strides take :func:`transpose_from_mma128_strided`."""
    rows, cols = target.shape
    if source.shape != (cols, rows // 2):
        raise ValueError(f"transpose_from_mma128: source {source.shape} does not fit target {target.shape}")
    rows_apart = target.strides[1] == target.itemsize and target.strides[0] >= cols * target.itemsize
    if not (source.flags.c_contiguous and rows_apart):
        transpose_from_mma128_strided(source, target)
    elif rows and cols:
        _transpose_from_mma128_rows(source.reshape(-1), rows // 2, _flat_rows(target), target.strides[0] // 4, False)


def transpose_from_mma128_tiles(source, target):
    """Exact inverse of :func:`transpose_to_mma128_tiles`: C-contiguous "mma128_tiles" ``source [N/64, R/16, 64, 8]``
    (uint64) -> input-major "gptq" ``target [R, N]`` (uint32, rows contiguous), by the same panels as
    :func:`transpose_from_mma128`, reading each row's blocks out of its tiles (no untiled copy)."""
    rows, cols = target.shape
    if source.shape != (cols // 64, rows // _BLOCK, 64, 8) or not source.flags.c_contiguous:
        raise ValueError(f"transpose_from_mma128_tiles: source {source.shape} does not fit target {target.shape}")
    if target.strides[1] != target.itemsize or target.strides[0] < cols * target.itemsize:
        raise ValueError("transpose_from_mma128_tiles: the target's rows must be contiguous")
    if rows and cols:
        _transpose_from_mma128_rows(source.reshape(-1), rows // 2, _flat_rows(target), target.strides[0] // 4, True)


def _flat_rows(target):
    """``target [R, N]`` (rows contiguous, any distance apart) as one flat array from its first word to its last."""
    rows, cols = target.shape
    row_stride = target.strides[0] // target.itemsize
    return np.lib.stride_tricks.as_strided(target, ((rows - 1) * row_stride + cols,), (target.itemsize,))


@_compiled_loop
def _transpose_from_mma128_rows(words, row_words, flat, row_stride, tiled):
    """:func:`transpose_from_mma128` (``tiled``: :func:`transpose_from_mma128_tiles`) of the flat source ``words``,
    rows of ``row_words`` 64-bit words, into row r = ``flat[r * row_stride :][:N]``. A panel of whole bands of 64
    rows is one contiguous piece of the source in both layouts. Returns the XOR of the words the read-ahead loaded
    (so that it is not optimized away; ignore it)."""
    cols = words.shape[0] // row_words
    rows = 2 * row_words
    high = _SHIFTS[3]
    panel_cols = max(64, min(_PANEL_COLUMNS, _PANEL_BYTES // (8 * row_words) // 64 * 64))
    panel = np.empty(rows * panel_cols, np.uint32)
    stage = np.empty(8 * _TILE, np.uint64)
    touched = _U(0)
    for first in range(0, cols, panel_cols):
        width = min(panel_cols, cols - first)
        tiles = width - width % _TILE
        piece = _U(first) * _U(row_words)
        for i in range(0, width * row_words, 8):  # read ahead: one load per line brings the panel's input into L2
            touched ^= words[piece + _U(i)]
        for start in range(0, rows, _BLOCK):
            for column in range(0, tiles, _TILE):
                _stage_tile(words, stage, _U(first + column), _U(row_words), _U(start // 2), tiled)
                _unstage_tile(stage, panel, _U(start), _U(column), _U(width))
            for column in range(tiles, width):  # the columns past the last whole tile, one by one
                at0 = _block_start(_U(first + column), _U(start // 2), _U(row_words), tiled)
                for g in range(2):
                    for a in range(2):
                        k = at0 + _U(4 * g + 2 * a)
                        p, q = _from_mma128_pair(words[k], words[k + _U(1)])
                        at = (start + 8 * g + a) * width + column
                        panel[at], panel[at + 4 * width] = p & _LOW, p >> high
                        panel[at + 2 * width], panel[at + 6 * width] = q & _LOW, q >> high
        uwidth, ustride = _U(width), _U(row_stride)
        for r in range(rows):  # the scratch panel into its columns of ``target``, row by row
            ur = _U(r)
            src, dst = ur * uwidth, ur * ustride + _U(first)
            for j in range(width):
                flat[dst + _U(j)] = panel[src + _U(j)]
    return touched


@_compiled_loop
def transpose_from_mma128_strided(source, target):
    """:func:`transpose_from_mma128` for arrays of any strides (rows of ``source`` contiguous): one column's block at
    a time, straight into ``target`` (the loop the panels replaced: 0.3-0.7x their speed)."""
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
