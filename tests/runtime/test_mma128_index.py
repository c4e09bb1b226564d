"""The kernels' own copies of the mma128 word order agree with the format's index table, formula by formula.

formats/stacks.py defines "mma128" as data (``MMA128_INDEX``: entry ``8w + s`` is the input that field s of word w
holds) and writes it with ``to_word_order``. The decode kernels (``_field_input`` and its inverse
``_field_major_slot``) and the weight-major kernels (``pair_weights`` + ``_activation_columns``; ``_channel_of``
for gptq-order stacks) each restate that permutation as index arithmetic. End-to-end tests would catch a
disagreement only as a numeric error somewhere; these run the jit helpers themselves in small kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.formats.stacks import MMA128_BLOCK, MMA128_INDEX, MMA128_ORDER, to_word_order
from repack.runtime.kernels.decode import _field_input, _field_major_slot
from repack.runtime.kernels.weight_major import _activation_columns, _channel_of, nibble_major, pair_weights

WORDS = MMA128_BLOCK // 8  # int32 words of one 128-input block (4-bit)


@triton.jit
def _decode_index_kernel(input_ptr, slot_ptr, MMA_ORDER: tl.constexpr, WORDS: tl.constexpr):
    """input_ptr[8w + s] = _field_input(w, s); slot_ptr[n] = _field_major_slot(n) (its offset in a prepared row)."""
    offs_w = tl.arange(0, WORDS)
    for s in tl.static_range(8):
        tl.store(input_ptr + offs_w * 8 + s, _field_input(0, offs_w, s, 4, MMA_ORDER))
    n = tl.arange(0, 8 * WORDS)
    slot, _inverse = _field_major_slot(n, 4, MMA_ORDER, 8 * WORDS)
    tl.store(slot_ptr + n, slot)


@triton.jit
def _weight_major_operand_kernel(words_ptr, out_ptr, ROWS: tl.constexpr):
    """out[row, column] = the weight the mma128 K step's dots multiply with activation ``column``: each chunk's
    [ROWS, 16] operand from pair_weights (q - zero, zero 0, no scale), scattered to _activation_columns."""
    rows = tl.arange(0, ROWS)
    offs_j = tl.arange(0, 16)
    low = tl.load(words_ptr + rows[:, None] * 16 + tl.arange(0, 8)[None, :])  # chunks 0..3
    high = tl.load(words_ptr + rows[:, None] * 16 + 8 + tl.arange(0, 8)[None, :])  # chunks 4..7
    zero_f = tl.full((ROWS,), 1024.0, tl.float16)  # 1024 + zero, zero = 0
    zero_odd = tl.full((ROWS,), 64.0, tl.float16)  # 64 + zero
    scale = tl.full((ROWS,), 1.0, tl.float16)
    for c in tl.static_range(8):
        words = low if c < 4 else high
        weights = pair_weights(words, zero_f, zero_odd, scale, c % 4, tl.float16, True, False)
        cols = _activation_columns(0, c, offs_j, words_ptr, False, True, False)
        tl.store(out_ptr + rows[:, None] * 128 + cols[None, :], weights.to(tl.float32))


@triton.jit
def _channel_of_kernel(out_ptr, N: tl.constexpr):
    positions = tl.arange(0, N)
    tl.store(out_ptr + positions, _channel_of(positions))


def one_hot_gptq_words(device: str) -> torch.Tensor:
    """int32 [128, 16]: row k holds q = 1 at input k and 0 elsewhere, in gptq order (field s of word j is 8j + s)."""
    k = torch.arange(MMA128_BLOCK)
    words = torch.zeros(MMA128_BLOCK, WORDS, dtype=torch.int32)
    words[k, k // 8] = (1 << (4 * (k % 8))).to(torch.int32)
    return words.to(device)


def test_decode_field_input_is_the_format_index_table(device):
    inputs = torch.empty(MMA128_BLOCK, dtype=torch.int32, device=device)
    slots = torch.empty(MMA128_BLOCK, dtype=torch.int32, device=device)
    _decode_index_kernel[(1,)](inputs, slots, MMA_ORDER=True, WORDS=WORDS)
    assert torch.equal(inputs.cpu().long(), MMA128_INDEX)
    # field s of word w sits at s * WORDS + w of a prepared (field-major) row
    w, s = torch.arange(WORDS).repeat_interleave(8), torch.arange(8).repeat(WORDS)
    expected = torch.empty(MMA128_BLOCK, dtype=torch.long)
    expected[MMA128_INDEX] = s * WORDS + w
    assert torch.equal(slots.cpu().long(), expected)
    # and the table is what the converter writes: the one nonzero nibble of input k lands at field s of word w
    mma = to_word_order(one_hot_gptq_words("cpu"), MMA128_ORDER)
    nibbles = torch.stack([(mma >> (4 * f)) & 0xF for f in range(8)], dim=-1).reshape(MMA128_BLOCK, -1)  # [k, 8w + s]
    assert torch.equal(MMA128_INDEX[nibbles.argmax(dim=1)], torch.arange(MMA128_BLOCK))


def test_decode_field_input_in_gptq_order(device):
    inputs = torch.empty(MMA128_BLOCK, dtype=torch.int32, device=device)
    slots = torch.empty(MMA128_BLOCK, dtype=torch.int32, device=device)
    _decode_index_kernel[(1,)](inputs, slots, MMA_ORDER=False, WORDS=WORDS)
    assert torch.equal(inputs.cpu().long(), torch.arange(MMA128_BLOCK))  # field s of word w: 8w + s
    n = torch.arange(MMA128_BLOCK)
    assert torch.equal(slots.cpu().long(), n % 8 * WORDS + n // 8)


def test_weight_major_operands_multiply_the_columns_the_format_says(device):
    """Row k of the words holds a 1 at input k only (written by to_word_order): the kernel's dots must put it
    against activation column k and nowhere else."""
    words = to_word_order(one_hot_gptq_words("cpu"), MMA128_ORDER).to(device)
    out = torch.full((MMA128_BLOCK, MMA128_BLOCK), float("nan"), device=device)
    _weight_major_operand_kernel[(1,)](words, out, ROWS=MMA128_BLOCK)
    assert torch.equal(out.cpu(), torch.eye(MMA128_BLOCK))


def test_weight_major_channel_of_inverts_nibble_major(device):
    n = 2 * MMA128_BLOCK
    out = torch.empty(n, dtype=torch.int32, device=device)
    _channel_of_kernel[(1,)](out, N=n)
    assert torch.equal(out.cpu().long(), nibble_major(torch.arange(n)[None])[0])
