"""The decode in one launch: routing, w13, w2 and the top-k sum of a few tokens as one kernel (the ``decode``
family's second form; kernels/decode.py has the three-launch one and the arithmetic both share).

Dimension letters: runtime/kernels/__init__.py.

Why: at M = 1 on the small shapes the three launches (prepare, w13, w2) are a chain of dependent round trips whose
sum is 3x the bytes' floor (benchmarks/KERNEL_NOTES.md item 34: Qwen3-30B 3.7 + 8.9 + 7.2 us for 6.5 us of
weights). Here one grid holds w13's programs first and w2's after:

- every program routes its own token from the router logits (the same ``routing.routed`` the other paths use, in
  registers), so none waits for a routing launch, and w13 reads the activations themselves (no prepared rows);
- w2's programs load their first weight blocks, then spin until their pair's ``ready`` count says all of its w13
  tiles are written; w13's programs come first in the grid, so every one of them has been scheduled before any w2
  program can hold an SM while it waits (blocks are dispatched in order);
- split-K sums, arrival counts and ``ready`` live in one scratch buffer per device that every call leaves at zero
  (the last program of a sum or a count clears it), so nothing is zeroed before the launch.

MoE calls on a device run one after another (as the alignment's ticket assumes, kernels/align.py): the scratch is
shared by them. The buffer is made outside any CUDA-graph capture (the first call on a device; a capture before
it takes the three launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.runtime.kernel_config import KernelConfig
from repack.runtime.kernels.common import TL_DTYPES, await_previous_kernel, dependent_launches, projection_args
from repack.runtime.kernels.decode import FP32_TWO_POW_23, _w2_program, _w13_program, k_slices
from repack.runtime.kernels.routing import pow2_at_least, routed
from repack.runtime.weights import MoeWeights

SCRATCH_WORDS = 1 << 20  # int32 words of a device's scratch (4 MiB): a call that needs more takes three launches
ONE_LAUNCH_MAX_TOKENS = 8  # tokens routed by every program: a few rows of logits each


@triton.jit
def _pair_routing(logits_ptr, topk_ids_ptr, topk_weights_ptr, token, slot, num_tokens, num_experts, stride_logits,
                  TOP_K: tl.constexpr, ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """(expert, routing weight) of pair (``token``, ``slot``): routed here from the logits (ROUTE), else read."""
    if ROUTE:
        ids, weights = routed(logits_ptr, token, num_tokens, num_experts, stride_logits, TOP_K, RENORMALIZE, 1,
                              BLOCK_E)  # fmt: skip
        chosen = tl.arange(0, pow2_at_least(TOP_K))[None, :] == slot
        expert = tl.sum(tl.where(chosen, ids, 0))
        weight = tl.sum(tl.where(chosen, weights, 0.0))
    else:
        expert = tl.load(topk_ids_ptr + token * TOP_K + slot)
        weight = tl.load(topk_weights_ptr + token * TOP_K + slot).to(tl.float32)
    return tl.minimum(tl.maximum(expert, 0), num_experts - 1).to(tl.int64), weight


@triton.jit
def _store_routing(logits_ptr, topk_ids_ptr, topk_weights_ptr, token, num_tokens, num_experts, stride_logits,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """The token's ids and weights into the call's outputs (what the other paths' routing leaves there)."""
    ids, weights = routed(logits_ptr, token, num_tokens, num_experts, stride_logits, TOP_K, RENORMALIZE, 1,
                          BLOCK_E)  # fmt: skip
    slots = tl.arange(0, pow2_at_least(TOP_K))[None, :]
    tl.store(topk_ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)
    tl.store(topk_weights_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)


@triton.jit
def _decode_one_launch_kernel(
    # pointers: the call's tensors, the intermediate, the scratch's parts
    x_ptr, logits_ptr, topk_ids_ptr, topk_weights_ptr, out_ptr, inter_ptr,
    sums13_ptr, arrivals13_ptr, ready_ptr, sums2_ptr, arrivals2_ptr, finished_ptr,
    # the stack: w13 and w2 words, scales, zeros
    w13_ptr, w13_scales_ptr, w13_zeros_ptr, w2_ptr, w2_scales_ptr, w2_zeros_ptr,
    # sizes (and the field mask and exponent bits, in registers: kernels/decode.py _term)
    num_tokens, num_experts, H, I, group13, group2, per_slice13, per_slice2, field_mask, magic,
    stride_x, stride_logits, stride_out,
    # strides of the stack
    stride13_e, stride13_band, stride13_row, stride13_step, stride13_s_e, stride13_s_g,
    stride2_e, stride2_band, stride2_row, stride2_step, stride2_s_e, stride2_s_g,
    # the grid's shape: channel tiles and K slices of each projection
    TILES13: tl.constexpr, SLICES13: tl.constexpr, TILES2: tl.constexpr, SLICES2: tl.constexpr,
    # the stack, the routing, the tile
    TOP_K: tl.constexpr, BITS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    ACT_DTYPE: tl.constexpr, ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPENDENT: tl.constexpr,
):  # fmt: skip
    """Program ``pid`` < P * TILES13 * SLICES13 (P pairs) is w13 of pair ``pid % P``; the rest are w2's, in the
    same pair-fastest order (kernels/decode.py ``_w13_program``, ``_w2_program``)."""
    await_previous_kernel(DEPENDENT)  # the activations and logits come from the kernels before
    num_pairs = num_tokens * TOP_K
    pid = tl.program_id(0)
    w13_programs = num_pairs * TILES13 * SLICES13
    if pid < w13_programs:
        pair = pid % num_pairs
        tile = pid // num_pairs
        token = pair // TOP_K
        expert, _weight = _pair_routing(logits_ptr, topk_ids_ptr, topk_weights_ptr, token, pair % TOP_K,
                                        num_tokens, num_experts, stride_logits, TOP_K, ROUTE, RENORMALIZE,
                                        BLOCK_E)  # fmt: skip
        if ROUTE:  # noqa: SIM102 (a constexpr)
            if tile == 0 and pair % TOP_K == 0:
                _store_routing(logits_ptr, topk_ids_ptr, topk_weights_ptr, token, num_tokens, num_experts,
                               stride_logits, TOP_K, RENORMALIZE, BLOCK_E)  # fmt: skip
        _w13_program(x_ptr, w13_ptr, w13_scales_ptr, w13_zeros_ptr, inter_ptr, sums13_ptr, arrivals13_ptr, ready_ptr,
                     pair, expert, token.to(tl.int64) * stride_x, tile % TILES13, tile // TILES13, TILES13,
                     SLICES13, I, H, I, group13, per_slice13, field_mask, magic,
                     stride13_e, stride13_band, stride13_row, stride13_step, stride13_s_e, stride13_s_g,
                     BITS, SYM_ZERO, HAS_ZEROS, ACT_DTYPE, True, True, SLICES13 > 1, PREFETCH, BLOCK_N, BLOCK_K,
                     True, True)  # fmt: skip
    else:
        pid2 = pid - w13_programs
        pair = pid2 % num_pairs
        tile = pid2 // num_pairs
        token = pair // TOP_K
        expert, weight = _pair_routing(logits_ptr, topk_ids_ptr, topk_weights_ptr, token, pair % TOP_K,
                                       num_tokens, num_experts, stride_logits, TOP_K, ROUTE, RENORMALIZE,
                                       BLOCK_E)  # fmt: skip
        _w2_program(inter_ptr, w2_ptr, w2_scales_ptr, w2_zeros_ptr, topk_weights_ptr, out_ptr, sums2_ptr,
                    arrivals2_ptr, ready_ptr, finished_ptr, pair, expert, weight, tile % TILES2, tile // TILES2,
                    TILES2, SLICES2, TILES13, H, I, I, group2, per_slice2, field_mask, magic,
                    stride2_e, stride2_band, stride2_row, stride2_step, stride2_s_e, stride2_s_g, stride_out,
                    TOP_K, BITS, SYM_ZERO, HAS_ZEROS, ACT_DTYPE, True, True, True, PREFETCH, BLOCK_N, BLOCK_K,
                    DEPENDENT, True)  # fmt: skip


class Scratch:
    """One call's views of its device's zero-between-calls scratch: split-K sums and arrivals of w13, the pairs'
    ``ready`` counts, w2's sums and arrivals, the tokens' finished-tile counts."""

    def __init__(self, buffer: torch.Tensor, m: int, pairs: int, h: int, i: int, tiles13: int, tiles2: int):
        sizes = {
            "sums13": pairs * 2 * i,
            "arrivals13": pairs * tiles13,
            "ready": pairs,
            "sums2": m * h,
            "arrivals2": m * tiles2,
            "finished": m,
        }
        start = 0
        self.views: dict[str, torch.Tensor] = {}
        for name, size in sizes.items():
            view = buffer[start : start + size]
            self.views[name] = view.view(torch.float32) if name.startswith("sums") else view
            start += size

    @staticmethod
    def words(m: int, pairs: int, h: int, i: int, tiles13: int, tiles2: int) -> int:
        return pairs * (2 * i + tiles13 + 1) + m * (h + tiles2 + 1)


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _device_scratch(device: torch.device) -> torch.Tensor | None:
    """The device's scratch (zero between calls), made here unless a CUDA graph is being captured (None then)."""
    if device not in _SCRATCH:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _SCRATCH[device] = torch.zeros(SCRATCH_WORDS, dtype=torch.int32, device=device)
    return _SCRATCH[device]


def _grid_shape(weights: MoeWeights, config: KernelConfig) -> tuple[int, int, int, int, int, int]:
    """(per-slice blocks and slices of w13's K, of w2's K, channel tiles of w13 and of w2)."""
    per13, slices13 = k_slices(weights.hidden_size, 128, config.split_k)
    per2, slices2 = k_slices(weights.intermediate_size, 128, config.split_k)
    block_n = config.block_n
    return per13, slices13, per2, slices2, triton.cdiv(weights.intermediate_size, block_n), triton.cdiv(
        weights.hidden_size, block_n
    )


def takes(x: torch.Tensor, weights: MoeWeights, top_k: int, config: KernelConfig) -> bool:
    """Whether this call can run as one launch: mma128 words without act-order (K in whole 128-input blocks, w13
    reading the activations in place), few enough tokens that every program routes its own, the scratch big
    enough, and the device's scratch made or makeable (not inside a first capture)."""
    m = x.shape[0]
    if not weights.mma_order or weights.w13_perm is not None or m > ONE_LAUNCH_MAX_TOKENS:
        return False
    _p13, _s13, _p2, _s2, tiles13, tiles2 = _grid_shape(weights, config)
    needed = Scratch.words(m, m * top_k, weights.hidden_size, weights.intermediate_size, tiles13, tiles2)
    return needed <= SCRATCH_WORDS and _device_scratch(x.device) is not None


def launch(
    x: torch.Tensor,  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights,
    topk_ids: torch.Tensor,  # [M, T] int32: read, or (with routing) written
    topk_weights: torch.Tensor,  # [M, T] fp32: read, or (with routing) written
    out: torch.Tensor,  # [M, H] activation dtype
    config: KernelConfig,
    routing: tuple[torch.Tensor, bool] | None = None,  # (router logits [M, E] unit stride along E, renormalize)
) -> None:
    """The whole decode call as one launch (where :func:`takes` says it can): from ``config`` block_n, split_k,
    prefetch and num_warps, as the three launches read them."""
    m, h = x.shape
    i, top_k, pairs = weights.intermediate_size, topk_ids.shape[1], topk_ids.numel()
    per13, slices13, per2, slices2, tiles13, tiles2 = _grid_shape(weights, config)
    scratch = Scratch(_device_scratch(x.device), m, pairs, h, i, tiles13, tiles2).views
    inter = torch.empty(pairs * i, dtype=torch.float32, device=x.device)  # w2's prepared input, every value written
    logits, renormalize = routing if routing is not None else (x, False)  # logits unread without ROUTE
    args13 = projection_args(weights.w13_qweight, weights.w13_scales, weights.w13_zeros, weights.tiled, 128, 4)
    args2 = projection_args(weights.w2_qweight, weights.w2_scales, weights.w2_zeros, weights.tiled, 128, 4)
    strides = ("stride_qw_e", "stride_qw_band", "stride_qw_row", "stride_qw_step", "stride_s_e", "stride_s_g")
    grid = (pairs * (tiles13 * slices13 + tiles2 * slices2),)
    _decode_one_launch_kernel[grid](
        x, logits, topk_ids, topk_weights, out, inter,
        scratch["sums13"], scratch["arrivals13"], scratch["ready"], scratch["sums2"], scratch["arrivals2"],
        scratch["finished"],
        args13["qw_ptr"], args13["scales_ptr"], args13["zeros_ptr"], args2["qw_ptr"], args2["scales_ptr"],
        args2["zeros_ptr"],
        m, weights.num_experts, h, i, weights.group_len(h), weights.group_len(i), per13, per2,
        (1 << weights.bits) - 1, FP32_TWO_POW_23, x.stride(0), logits.stride(0), out.stride(0),
        *(args13[name] for name in strides), *(args2[name] for name in strides),
        TILES13=tiles13, SLICES13=slices13, TILES2=tiles2, SLICES2=slices2, TOP_K=top_k, BITS=weights.bits,
        SYM_ZERO=1 << (weights.bits - 1), HAS_ZEROS=weights.w13_zeros is not None, ACT_DTYPE=TL_DTYPES[x.dtype],
        ROUTE=routing is not None, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(weights.num_experts),
        PREFETCH=config.prefetch, BLOCK_N=config.block_n, BLOCK_K=128, num_warps=config.num_warps,
        num_stages=config.num_stages, **dependent_launches(x.device),
    )  # fmt: skip
