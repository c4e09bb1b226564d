"""The fused W4A16 MoE: check the inputs, choose a kernel family, align the pairs, run it, sum the top-k.

``fused_moe`` computes ``sum_k w[m,k] * W2[e] @ (silu(W1[e] x) * (W3[e] x))`` with ``e = topk_ids[m,k]``, from
the repack-moe layout as stored (formats/SPEC.md). The families live in runtime/kernels/, one module each, and
export one ``run``:

- ``decode`` (runtime/kernels/decode.py): CUDA cores, one program per (token, expert) pair; any word order.
  It writes ``out`` itself (its w2 sums the top-k).
- ``weight_major`` (runtime/kernels/weight_major.py): tensor cores with the weights as the MMA's register
  operand; the tuned default past decode, and the only tensor-core family that reads mma128 words.
- ``gptq_order`` (runtime/kernels/gptq_order.py): the older tensor-core kernels, for the gptq-order stacks the
  weight-major kernels cannot run (groups under 128, K not a multiple of 128, 8-bit).
- ``gluon_sm90`` (runtime/kernels/gluon_sm90.py): the weight-major GEMMs in Gluon for Hopper, a wgmma kept in
  flight while the next chunk dequantizes; on sm_90 by default where they measured faster
  (:func:`gluon_sm90.preferred`) or where asked for (a config's ``GLUON`` tile, $REPACK_GLUON_KERNELS=1), unless
  the config is ``PORTABLE`` or $REPACK_PORTABLE_KERNELS=1.

The config (runtime/kernel_config.py) names the family; :func:`choose_kernels` turns that into the family that
can run the stack (:func:`kernel_path`: which one a call takes). The tensor-core families write one row per
(token, k) pair, summed by kernels/topk_sum.py (or fp32 atomics into [M, H] with ``reduce="atomic"``). Nothing
here synchronises with the host, so the whole call can be captured in a CUDA graph. Dimension letters:
runtime/kernels/__init__.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from repack.formats.errors import RepackError
from repack.runtime.kernel_config import KernelConfig, Kernels, as_kernel_config, get_config
from repack.runtime.kernels import decode, gluon_sm90, gptq_order, weight_major
from repack.runtime.kernels.act_order import gather_act_order
from repack.runtime.kernels.align import align_pairs, route_and_align
from repack.runtime.kernels.backend import gluon_sm90_runs
from repack.runtime.kernels.common import TL_DTYPES
from repack.runtime.kernels.routing import route, route_outputs
from repack.runtime.kernels.topk_sum import topk_sum
from repack.runtime.weights import MoeWeights

# bf16 activations on the weight-major kernels (past decode). True (default): each fp16 scale is rounded to bf16
# inside the dequantized weight, as serving stacks that cast GPTQ scales to the model dtype do; bf16 then runs as
# fast as fp16. False: the scale is applied exactly, in fp32 once per K step, at the cost of a second accumulator
# and half-width tiles. Speed and error of both: benchmarks/KERNEL_NOTES.md item 13. The decode kernels apply
# scales in fp32 either way.
BF16_SCALES_IN_WEIGHTS = True

PORTABLE_ENV = "REPACK_PORTABLE_KERNELS"  # "1": never the Gluon sm_90 kernels (the tl kernels everywhere)
GLUON_ENV = "REPACK_GLUON_KERNELS"  # "1": the Gluon sm_90 kernels wherever they can run, tile from their heuristic


def supports_weight_major(weights: MoeWeights) -> bool:
    return weight_major.supports(weights.bits, weights.hidden_size, weights.intermediate_size, weights.group_size)


def choose_kernels(
    weights: MoeWeights, config: KernelConfig, device: torch.device, dtype: torch.dtype, num_pairs: int
) -> Kernels:
    """The family that runs on ``device``: the config's, except that the Gluon sm_90 kernels run on an aligned
    tensor-core config where they can (an mma128 stack, a Hopper GPU: kernels/backend.py) and either are faster
    there (:func:`gluon_sm90.preferred`, unless the config is ``portable``: a tl config that won a tuning here) or
    are asked for (a ``gluon`` tile, or $GLUON_ENV, which overrides ``portable``), unless $PORTABLE_ENV; mma128
    words are otherwise read only by the decode and weight-major kernels, and a stack the weight-major kernels
    cannot run takes the gptq-order kernels."""
    if config.kernels is Kernels.DECODE:
        return Kernels.DECODE
    gluon_allowed = not config.direct and os.environ.get(PORTABLE_ENV, "") != "1"
    if gluon_allowed and gluon_sm90.supports(weights) and gluon_sm90_runs(device):
        asked = config.gluon is not None or os.environ.get(GLUON_ENV, "") == "1"
        if asked or (not config.portable and gluon_sm90.preferred(weights, dtype, num_pairs)):
            return Kernels.GLUON_SM90
    if weights.mma_order or (config.kernels is Kernels.WEIGHT_MAJOR and supports_weight_major(weights)):
        return Kernels.WEIGHT_MAJOR
    return Kernels.GPTQ_ORDER


def kernel_path(
    hidden_states: torch.Tensor, weights: MoeWeights, top_k: int, config: KernelConfig | Mapping | None = None
) -> Kernels:
    """The family ``fused_moe(hidden_states, weights, <[M, top_k] ids>, ..., config=config)`` runs."""
    cfg = _config(config, weights, hidden_states, top_k)
    num_pairs = hidden_states.shape[0] * top_k
    return choose_kernels(weights, cfg, hidden_states.device, hidden_states.dtype, num_pairs)


def _config(config: KernelConfig | Mapping | None, weights: MoeWeights, x: torch.Tensor, top_k: int) -> KernelConfig:
    """The caller's config parsed, else the tuned/heuristic one for this call."""
    return as_kernel_config(config) if config is not None else get_config(weights, x.shape[0], top_k, x.dtype, x.device)


def _check_inputs(hidden_states: torch.Tensor, weights: MoeWeights, topk_ids: torch.Tensor, topk_weights) -> None:
    """Turn shape/dtype/device mistakes into one-line RepackErrors before any kernel runs."""
    if hidden_states.dtype not in TL_DTYPES:
        raise RepackError(
            f"fused_moe: hidden_states dtype {hidden_states.dtype} is not supported; pass float16 or bfloat16"
        )
    if hidden_states.dim() != 2 or hidden_states.shape[1] != weights.hidden_size:
        raise RepackError(
            f"fused_moe: hidden_states shape {list(hidden_states.shape)} does not match the stack's hidden size "
            f"{weights.hidden_size}; pass [tokens, {weights.hidden_size}]"
        )
    m = hidden_states.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise RepackError(
            f"fused_moe: topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
            f"[{m}, top_k] for {m} tokens"
        )
    if weights.bits not in (4, 8):
        raise RepackError(f"fused_moe: {weights.bits}-bit weights are not supported; use a 4- or 8-bit stack")
    group = weights.group_size
    for name, k in (("hidden", weights.hidden_size), ("intermediate", weights.intermediate_size)):
        if group != -1 and k % group:
            raise RepackError(f"fused_moe: {name} size {k} is not a multiple of group size {group}")
    if weights.mma_order and not supports_weight_major(weights):
        raise RepackError(
            "fused_moe: an mma128 stack needs 4-bit weights, hidden and intermediate sizes and the group size "
            "in multiples of 128; re-convert the checkpoint with this repack"
        )
    tensors = [weights.w13_qweight, weights.w13_scales, weights.w2_qweight, weights.w2_scales, topk_ids]
    if any(t.device != hidden_states.device for t in tensors):
        raise RepackError(
            f"fused_moe: weights, topk_ids and hidden_states must be on one device (hidden_states is on "
            f"{hidden_states.device}); move them with .to(device)"
        )


def fused_moe(
    hidden_states: torch.Tensor,
    weights: MoeWeights,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    config: KernelConfig | Mapping | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, H]`` fp16/bf16 -> ``[M, H]`` same dtype: the routed experts' weighted sum for every token.

    ``topk_ids`` [M, T] (int32 or int64, values in [0, E)), ``topk_weights`` [M, T] (any float dtype).
    ``config`` overrides the tuned/heuristic kernel config: a :class:`KernelConfig`, or a dict in the tables'
    spelling (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, and optionally DIRECT, WEIGHT_MAJOR,
    SCALE_ACC, SPLIT_K, QUANT_AHEAD, PORTABLE, GLUON, REDUCE, PREFETCH: runtime/kernel_config.py).
    ``out`` receives the result.
    """
    _check_inputs(hidden_states, weights, topk_ids, topk_weights)
    out = _output(hidden_states, out)
    if hidden_states.shape[0] == 0:
        return out
    call = _plan(hidden_states, weights, topk_ids.shape[1], config, out)
    ids = topk_ids.contiguous()
    rows = align_pairs(ids, weights.num_experts, call.block_m) if call.aligned else None
    return _run(call, hidden_states, weights, ids, topk_weights.to(torch.float32).contiguous(), rows, out)


def routed_moe(
    hidden_states: torch.Tensor,
    weights: MoeWeights,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    config: KernelConfig | Mapping | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_moe`` from router logits [M, E] (softmax top-k, renormalised if asked: kernels/routing.py), with
    the routing inside the call's first launch where that measured faster: the alignment's for up to one routing
    step of tokens (kernels/align.py ``routes_in_alignment``: 16) and, at decode, the activation preparation's
    (kernels/decode.py; not for act-order stacks). One launch fewer per call than routing first.
    The same result as ``fused_moe(hidden_states, weights, *reversed(route(router_logits, top_k, renormalize)))``."""
    m = hidden_states.shape[0]
    if router_logits.dim() != 2 or router_logits.shape[0] != m or router_logits.shape[1] != weights.num_experts:
        raise RepackError(
            f"routed_moe: router_logits {list(router_logits.shape)} must be [{m}, {weights.num_experts}]: one row "
            "per token, one logit per expert of the stack"
        )
    out = _output(hidden_states, out)
    if m == 0:
        return out
    call = _plan(hidden_states, weights, top_k, config, out)
    rows = routing = None
    if call.aligned:
        route_w, ids, rows = route_and_align(router_logits, top_k, renormalize, call.block_m)
    elif call.kernels is Kernels.DECODE and weights.w13_perm is None:
        logits, route_w, ids = route_outputs(router_logits, top_k)  # filled by the decode's first launch
        routing = (logits, renormalize)
    else:
        route_w, ids = route(router_logits, top_k, renormalize)
    _check_inputs(hidden_states, weights, ids, route_w)
    return _run(call, hidden_states, weights, ids, route_w, rows, out, routing)


def _output(hidden_states: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format) if out is None else out


@dataclass(frozen=True)
class _Call:
    """What one call runs: the config (its Gluon tile and top-k sum filled in), the family, the row block of its
    alignment."""

    config: KernelConfig
    kernels: Kernels
    block_m: int
    aligned: bool  # the family works on per-expert row blocks (kernels/align.py), not one pair per program


def _plan(hidden_states: torch.Tensor, weights: MoeWeights, top_k: int, config, out: torch.Tensor) -> _Call:
    num_pairs = hidden_states.shape[0] * top_k
    dtype = hidden_states.dtype
    cfg = _config(config, weights, hidden_states, top_k).fit_group(weights.group_size)
    kernels = choose_kernels(weights, cfg, hidden_states.device, dtype, num_pairs)
    if kernels is Kernels.GLUON_SM90 and cfg.gluon is None:  # no tuned Gluon tile: the heuristic's tile and sum
        tile = gluon_sm90.heuristic(num_pairs, weights.num_experts)
        cfg = replace(cfg, gluon=tile, reduce=gluon_sm90.heuristic_reduce(dtype))
    cfg = replace(cfg, reduce=_reduce(cfg.reduce, dtype, top_k, out))
    block_m = cfg.gluon.block_m if kernels is Kernels.GLUON_SM90 else cfg.block_m
    direct = kernels is Kernels.DECODE or (kernels is Kernels.WEIGHT_MAJOR and cfg.direct)
    return _Call(cfg, kernels, block_m, aligned=not direct)


def _reduce(asked: str, dtype: torch.dtype, top_k: int, out: torch.Tensor) -> str:
    """The top-k sum a call can take: per-pair rows that are the output itself at top-1; atomics of the activation
    dtype into ``out`` ("out") only for fp16 (eight bf16 roundings per element would cost more than the 5e-3 the
    bf16 path is held to: fp32 atomics instead) and a contiguous ``out`` (cleared as one run of memory)."""
    if top_k == 1:
        return "pairs"
    if asked == "out" and (dtype != torch.float16 or not out.is_contiguous()):
        return "atomic"
    return asked


def _run(call: _Call, hidden_states, weights: MoeWeights, ids, route_w, rows, out: torch.Tensor,
         routing: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:  # fmt: skip
    """The family's launches, then the top-k sum (the decode family sums in its w2; with ``routing`` it also
    routes, into ``ids`` and ``route_w``)."""
    m, h = hidden_states.shape
    top_k, dtype, device, cfg = ids.shape[1], hidden_states.dtype, hidden_states.device, call.config
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    if call.kernels is Kernels.DECODE:
        decode.run(x, weights, ids, route_w, out, cfg, routing)
        return out
    num_pairs = m * top_k
    inter = torch.empty(num_pairs, weights.intermediate_size, dtype=dtype, device=device)  # [P, I]
    gluon = call.kernels is Kernels.GLUON_SM90  # its w13 clears an atomic target itself (kernels/gluon_sm90.py)
    if cfg.reduce == "atomic":
        target = (torch.empty if gluon else torch.zeros)(m, h, dtype=torch.float32, device=device)  # [M, H] fp32
    elif cfg.reduce == "out":
        target = out if gluon else out.zero_()
    elif top_k == 1 and out.is_contiguous():
        target = out
    else:
        target = torch.empty(num_pairs, h, dtype=dtype, device=device)  # [P, H] one row per pair
    if gluon and weights.w13_perm is not None and gluon_sm90.ACT_ORDER_GATHER:  # act-order: rows gathered once
        xg = gather_act_order(x, ids, weights.w13_perm)
        plain = replace(weights, w13_perm=None)
        gluon_sm90.run(xg, plain, ids, route_w, rows, inter, target, cfg, x_per_pair=True)
    elif gluon:
        gluon_sm90.run(x, weights, ids, route_w, rows, inter, target, cfg)
    elif call.kernels is Kernels.WEIGHT_MAJOR:
        exact_bf16 = not BF16_SCALES_IN_WEIGHTS
        weight_major.run(x, weights, ids, route_w, rows, inter, target, cfg, exact_bf16_scales=exact_bf16)
    else:
        gptq_order.run(x, weights, ids, route_w, rows, inter, target, cfg)
    if cfg.reduce == "atomic":
        out.copy_(target)
    elif target is not out:
        topk_sum(target, top_k, out)  # [M * T, H] -> [M, H]
    return out
