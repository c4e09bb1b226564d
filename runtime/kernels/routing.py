"""Router softmax + top-k on the GPU in one Triton launch, with no host synchronisation.

Why a kernel: at decode the whole MoE layer is a few tens of microseconds, and the torch sequence
(softmax, topk, div) costs three or four launches on its own. One program handles a block of tokens:
softmax over the experts in fp32, then ``top_k`` rounds of argmax (ties go to the lower expert id, like
``torch.topk``), then optional renormalisation of the selected weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from repack.formats.errors import RepackError


@triton.jit
def route_tokens(logits_ptr, weights_ptr, ids_ptr, first_token, num_tokens, num_experts, stride_logits,
                 TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr):  # fmt: skip
    """Route tokens ``first_token .. first_token + BLOCK_T`` (those below ``num_tokens``): their weights and ids
    stored at ``token * TOP_K + k``. The routing kernel's body, and the first step of the one-program alignment
    (kernels/align.py) and of the decode's preparation (kernels/decode.py).

    Each round's choice is stored straight from the reduced vectors. A single pass that gathered the choices into
    a [BLOCK_T, TOP_K] tensor and stored it once measured 1.1-1.8 us slower at 128 experts on the H200 than this
    form had in an earlier run (benchmarks/KERNEL_NOTES.md item 18), so renormalising keeps its first pass that
    only sums the choices."""
    tokens = first_token + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    valid = (tokens[:, None] < num_tokens) & (experts[None, :] < num_experts)
    logits = tl.load(
        logits_ptr + tokens[:, None].to(tl.int64) * stride_logits + experts[None, :], mask=valid, other=-float("inf")
    ).to(tl.float32)
    row_max = tl.where(tokens < num_tokens, tl.max(logits, axis=1), 0.0)  # padding rows stay finite
    exps = tl.where(valid, tl.exp(logits - row_max[:, None]), 0.0)
    probs = exps / tl.maximum(tl.sum(exps, axis=1), 1e-30)[:, None]
    # Experts already taken are set to -1 so they lose every later argmax (probabilities are >= 0).
    # NaN never equals the max, which would select no expert at all: a NaN probability loses like a taken one.
    candidates = tl.where(valid & (probs == probs), probs, -1.0)
    total = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
    if RENORMALIZE:
        remaining = candidates
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        for _ in tl.static_range(TOP_K):
            best = tl.max(remaining, axis=1)
            best_id = tl.min(tl.where(remaining == best[:, None], experts[None, :], BLOCK_E), axis=1)
            remaining = tl.where(experts[None, :] == best_id[:, None], -1.0, remaining)
            total += best
    remaining = candidates
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        best_id = tl.min(tl.where(remaining == best[:, None], experts[None, :], BLOCK_E), axis=1)
        remaining = tl.where(experts[None, :] == best_id[:, None], -1.0, remaining)
        tl.store(weights_ptr + tokens * TOP_K + k, best / total, mask=tokens < num_tokens)
        safe_id = tl.minimum(best_id, num_experts - 1)  # an all-NaN row still yields a valid expert id
        tl.store(ids_ptr + tokens * TOP_K + k, safe_id.to(tl.int32), mask=tokens < num_tokens)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
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


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, top-k, optional renormalisation.

    Returns ``(topk_weights fp32 [M, k], topk_ids int32 [M, k])``, sorted by descending weight.
    """
    router_logits, weights, ids = route_outputs(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = token_block(num_experts)
    grid = (triton.cdiv(num_tokens, block_t),)
    _route_kernel[grid](
        router_logits,
        weights,
        ids,
        num_tokens,
        num_experts,
        router_logits.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )
    return weights, ids
