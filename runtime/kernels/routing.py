"""Router softmax + top-k on the GPU in one Triton launch, with no host synchronisation.

Why a kernel: at decode the whole MoE layer is a few tens of microseconds, and the torch sequence
(softmax, topk, div) costs three or four launches on its own. One program handles a block of tokens:
softmax over the experts in fp32, then the top-k as max-reductions over packed keys (ties go to the lower expert id,
like ``torch.topk``), then optional renormalisation of the selected weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from repack.formats.errors import RepackError
from repack.runtime.kernels.common import await_previous_kernel, dependent_launches

# Router logits per warp of a routing program (the routing kernel, the alignment's one program, a routed count
# program): each thread's share of the softmax and of the top-k is issue time on the call's critical path. Rows
# that are not 16-byte aligned (60 experts) cannot be read as vectors, so the compiler spreads a row over several
# warps and every reduction crosses them: half the logits per warp there. Measured on the H200 (KERNEL_NOTES.md
# item 22): 16 tokens x 128 experts 4.8 -> 4.1 us on 8 warps instead of 4; 16 x 60 experts 6.4 -> 4.6 on 8.
ROUTE_LOGITS_PER_WARP = 256
UNALIGNED_LOGITS_PER_WARP = 128


@constexpr_function
def pow2_at_least(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


@triton.jit
def _top_keys(keys, TOP_K: tl.constexpr, K_POW: tl.constexpr):
    """The TOP_K largest of each row of ``keys`` [rows, E] (distinct where >= 0), descending, in [rows, K_POW]
    (-1 past TOP_K): TOP_K rounds of one max-reduction along the row, each taking its winner out."""
    columns = tl.arange(0, K_POW)[None, :]
    best = tl.full([keys.shape[0], K_POW], -1, tl.int64)
    for j in tl.static_range(TOP_K):
        top = tl.max(keys, axis=1)[:, None]
        best = tl.where(columns == j, top, best)
        keys = tl.where(keys == top, -1, keys)
    return best


@triton.jit
def route_tokens(logits_ptr, weights_ptr, ids_ptr, first_token, num_tokens, num_experts, stride_logits,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr):  # fmt: skip
    """Route tokens ``first_token .. first_token + BLOCK_T`` (those below ``num_tokens``): their weights and ids
    stored at pair ``token * TOP_K + k``; returns the [BLOCK_T, TOP_K rounded up to a power of two] pair indices,
    ids (-1 where nothing was stored) and the stored mask, for a caller that aligns them. The routing kernel's
    body, and the first step of the alignment (kernels/align.py) and of the decode's preparation
    (kernels/decode.py)."""
    K_POW: tl.constexpr = pow2_at_least(TOP_K)
    tokens = first_token + tl.arange(0, BLOCK_T)
    ids, weights = routed(logits_ptr, first_token, num_tokens, num_experts, stride_logits, TOP_K, RENORMALIZE,
                          BLOCK_T, BLOCK_E)  # fmt: skip
    columns = tl.arange(0, K_POW)[None, :]
    pairs = tokens[:, None] * TOP_K + columns
    stored = (tokens[:, None] < num_tokens) & (columns < TOP_K)
    tl.store(weights_ptr + pairs, weights, mask=stored)
    tl.store(ids_ptr + pairs, ids, mask=stored)
    return pairs, tl.where(stored, ids, -1), stored


@triton.jit
def routed(logits_ptr, first_token, num_tokens, num_experts, stride_logits, TOP_K: tl.constexpr,
           RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """The ids and weights of tokens ``first_token .. first_token + BLOCK_T``, each [BLOCK_T, TOP_K rounded up to a
    power of two], descending by weight (columns past TOP_K and rows past ``num_tokens`` are not routings):
    :func:`route_tokens` stores them; the decode's preparation of an act-order stack (kernels/decode.py) picks its
    pair's expert from them in every program.

    The top-k runs over packed int64 keys, the probability's bits above the complement of the expert id: a
    non-negative fp32 orders as its bits, so the largest key is the largest probability and, among equal ones, the
    lowest expert id (``torch.topk``'s choice), and one max-reduction per choice finds both (:func:`_top_keys`). The
    first version took two reductions per choice (value, then index), whose latency made the routing of 16 tokens
    over 128 experts most of a 7 us launch (benchmarks/KERNEL_NOTES.md item 19); ``tl.topk``'s bitonic sort of the
    same keys compiled to a quarter more instructions than the rounds (item 22)."""
    K_POW: tl.constexpr = pow2_at_least(TOP_K)  # a power-of-two result tile; the columns past TOP_K are unused
    tokens = first_token + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    valid = (tokens[:, None] < num_tokens) & (experts[None, :] < num_experts)
    logits = tl.load(
        logits_ptr + tokens[:, None].to(tl.int64) * stride_logits + experts[None, :], mask=valid, other=-float("inf")
    ).to(tl.float32)
    row_max = tl.where(tokens < num_tokens, tl.max(logits, axis=1), 0.0)  # padding rows stay finite
    exps = tl.where(valid, tl.exp(logits - row_max[:, None]), 0.0)
    probs = exps / tl.maximum(tl.sum(exps, axis=1), 1e-30)[:, None]
    # A NaN probability (and a padding expert) gets key -1, below every real one: it is chosen only when nothing
    # else is left, and then as expert 0 with weight 0, so a broken row still reads inside the stack.
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - experts[None, :]).to(tl.int64)
    keys = tl.where(valid & (probs == probs), keys, -1)
    best = _top_keys(keys, TOP_K, K_POW)  # [BLOCK_T, K_POW], descending
    chosen = best >= 0
    ids = tl.where(chosen, BLOCK_E - 1 - (best & 0xFFFF).to(tl.int32), 0)
    weights = tl.where(chosen, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    if RENORMALIZE:
        columns = tl.arange(0, K_POW)[None, :]
        total = tl.sum(tl.where(columns < TOP_K, weights, 0.0), axis=1)
        weights = weights / tl.where(total > 0.0, total, 1.0)[:, None]  # a padding row's total is 0
    return ids, weights


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  DEPENDENT: tl.constexpr = False):  # fmt: skip
    await_previous_kernel(DEPENDENT)
    route_tokens(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) * BLOCK_T, num_tokens, num_experts,
                 stride_logits, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E)  # fmt: skip


def route_outputs(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits checked (one RepackError line each) and unit-stride along E, and empty ``(weights fp32 [M, k],
    ids int32 [M, k])`` for the routing to fill."""
    if router_logits.dim() != 2:
        raise RepackError(
            f"route: router_logits must be 2-D [tokens, experts], got shape {list(router_logits.shape)}; "
            "flatten the batch dimensions first"
        )
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise RepackError(f"route: top_k={top_k} must lie in [1, {num_experts}] (the number of experts)")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    return router_logits, weights, ids


def token_block(num_experts: int) -> int:
    """Tokens one routing step holds: up to 16, at most 2048 logits (4096 spilled to local memory at 256
    experts in the sm_90 compile test)."""
    return max(1, min(16, 2048 // triton.next_power_of_2(num_experts)))


def rows_aligned(router_logits: torch.Tensor) -> bool:
    """Whether every row of ``router_logits`` starts on 16 bytes (what vector loads of a row need)."""
    return router_logits.stride(0) * router_logits.element_size() % 16 == 0 and router_logits.data_ptr() % 16 == 0


def route_warps(logits: int, aligned: bool = True) -> int:
    """Warps of a program that routes ``logits`` router logits (4 to 16): ROUTE_LOGITS_PER_WARP each, or
    UNALIGNED_LOGITS_PER_WARP where the rows are not :func:`rows_aligned`."""
    return max(4, min(16, logits // (ROUTE_LOGITS_PER_WARP if aligned else UNALIGNED_LOGITS_PER_WARP)))


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, top-k, optional renormalisation.

    Returns ``(topk_weights fp32 [M, k], topk_ids int32 [M, k])``, sorted by descending weight.
    """
    router_logits, weights, ids = route_outputs(router_logits, top_k)
    route_into(router_logits, weights, ids, top_k, renormalize)
    return weights, ids


def route_into(
    router_logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, top_k: int, renormalize: bool
) -> None:
    """The routing kernel from the checked logits into the outputs of :func:`route_outputs`: one program per
    routing step of tokens (:func:`token_block`)."""
    num_tokens, num_experts = router_logits.shape
    if num_tokens == 0:
        return
    block_t = token_block(num_experts)
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0), TOP_K=top_k,
        RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=route_warps(block_t * block_e, rows_aligned(router_logits)),
        **dependent_launches(router_logits.device),
    )  # fmt: skip
