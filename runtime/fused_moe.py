"""The fused W4A16 MoE: check the inputs, choose a kernel family, align the pairs, run it, sum the top-k.

``fused_moe`` computes ``sum_k w[m,k] * W2[e] @ (silu(W1[e] x) * (W3[e] x))`` with ``e = topk_ids[m,k]``, from
the repack-moe layout as stored (formats/SPEC.md). The kernel families live in runtime/kernels/, one module each,
and each describes itself (runtime/kernels/family.py: what it supports, the config it takes a call with, its
heuristic, its launches, which top-k sum it does). :data:`FAMILIES` is the ordered list this module walks:

- ``decode_mma`` (kernels/decode_mma.py): the decode's launches with each K step on Hopper's tensor cores (Gluon),
  mma128 stacks; off the heuristic's path until measured (``decode_mma.PREFERRED``);
- ``decode`` (kernels/decode.py): CUDA cores, one program per (token, expert) pair, any stack; sums the top-k in w2;
- ``gluon_sm90`` (kernels/gluon_sm90.py): the weight-major GEMMs in Gluon for Hopper, a wgmma kept in flight while
  the next chunk dequantizes; mma128 stacks on a compute capability 9.0 GPU;
- ``weight_major`` (kernels/weight_major.py): tensor cores with the weights as the MMA's register operand, the
  stacks whose sizes and groups allow mma128 words (either word order); the only tl family that reads mma128;
- ``gptq_order`` (kernels/gptq_order.py): the older tensor-core kernels, for gptq-order stacks of any bits and
  groups.

A call runs the config's family (the tuned table's or, without a table, the first family whose heuristic claims
the call: :func:`get_config`) where that family takes it, else the first family of the list that runs other
families' tl tiles and can (:func:`choose_family`; :func:`kernel_path` says which one a call takes).
$REPACK_GLUON_KERNELS=1 asks for the Gluon kernels on every aligned tensor-core call they can run, with their
heuristic's tile; $REPACK_PORTABLE_KERNELS=1 never runs them (kernels/gluon_sm90.py ``GLUON_ENV``, ``PORTABLE_ENV``).
Families with row blocks get the pairs sorted by expert first (kernels/align.py); those that leave the top-k sum to
the config's ``reduce`` write per-pair rows summed by kernels/topk_sum.py, fp32 atomics into [M, H], or adds
straight into the output. Nothing here synchronises with the host, so the whole call can be captured in a CUDA
graph. Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from repack.formats.errors import RepackError
from repack.runtime.kernel_config import (
    INTERPRETER_CONFIG,
    Family,
    KernelConfig,
    as_kernel_config,
    device_name,
    load_configs,
)
from repack.runtime.kernels import decode, decode_mma, gluon_sm90, gptq_order, weight_major
from repack.runtime.kernels.align import align_pairs, route_and_align
from repack.runtime.kernels.common import TL_DTYPES
from repack.runtime.kernels.family import Call, KernelFamily, TopkSum, Work
from repack.runtime.kernels.routing import route, route_outputs
from repack.runtime.kernels.topk_sum import topk_sum
from repack.runtime.weights import MoeWeights

# The families, in the order a call asks them (its config's family first: choose_family): the decode kernels (on
# tensor cores where they run, else on CUDA cores), the Gluon sm_90 ones, then the tl tensor-core ones that run any
# config's tile where its own family cannot.
FAMILIES: tuple[KernelFamily, ...] = (
    decode_mma.FAMILY,
    decode.FAMILY,
    gluon_sm90.FAMILY,
    weight_major.FAMILY,
    gptq_order.FAMILY,
)


def choose_family(
    weights: MoeWeights, config: KernelConfig, device: torch.device, dtype: torch.dtype, num_pairs: int
) -> tuple[KernelFamily, KernelConfig]:
    """(the family that runs the call, the config it runs it with): the first family of :data:`FAMILIES` the
    config asks for (its own; the Gluon one too under $REPACK_GLUON_KERNELS=1) that takes the call, else the first
    that runs other families' tl tiles and can."""
    call = Call(weights, torch.device(device), dtype, num_pairs)
    asked = [family for family in FAMILIES if family.asked_by(config)]
    fallbacks = [family for family in FAMILIES if family.runs_tl_tiles and family not in asked]
    for family in asked + fallbacks:
        planned = family.configure(config, call)
        if planned is not None:
            return family, planned
    raise RepackError(f"fused_moe: no kernel family runs this stack ({weights.bits}-bit, {weights.word_order} words)")


def heuristic_config(call: Call) -> KernelConfig:
    """The config of the first family of :data:`FAMILIES` whose heuristic claims ``call`` (one nobody tuned)."""
    for family in FAMILIES:
        config = family.heuristic(call)
        if config is not None:
            return config
    raise RepackError(f"fused_moe: no kernel family runs this stack ({call.weights.bits}-bit)")


HEURISTIC_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def heuristic_configs() -> list[KernelConfig]:
    """Every distinct tl config the heuristics return, for the sm_90 compile test (the Gluon heuristic's tiles are
    gluon_sm90.SHIPPED_TILES; the gptq-order heuristic is the weight-major tile)."""
    seen: dict[KernelConfig, None] = {}
    for m in HEURISTIC_TOKEN_COUNTS:
        for top_k, experts in ((8, 64), (4, 60), (1, 8), (2, 160)):
            stack = _shape_only_stack(experts)
            call = Call(stack, torch.device("meta"), torch.float16, m * top_k)
            seen[decode.FAMILY.heuristic(call) or weight_major.FAMILY.heuristic(call)] = None
    return list(seen)


def _shape_only_stack(experts: int) -> MoeWeights:
    """A 4-bit g128 stack of ``experts`` experts without storage: what the heuristics read is the expert count."""
    meta = lambda *shape: torch.empty(shape, dtype=torch.int32, device="meta")  # noqa: E731
    return MoeWeights(meta(experts, 256, 16), meta(experts, 1, 256), meta(experts, 128, 16), meta(experts, 1, 128),
                      bits=4, group_size=128)  # fmt: skip


def get_config(weights: MoeWeights, num_tokens: int, top_k: int, dtype: torch.dtype, device) -> KernelConfig:
    """The tuned table's entry of the nearest M for this device and shape, else (no table) the interpreter's config
    on the CPU and :func:`heuristic_config` elsewhere.

    A routed stack joined with its shared chunks (``weights.routed_experts`` set) uses the routed stack's table:
    tables are tuned per routed shape. Its ``top_k`` counts the shared chunks too, so a token brings more pairs than
    the table's entries were tuned for; the choice between one-program-per-pair (``direct``) and aligned entries is
    then made by decode.direct_mode on the joined pairs, and the nearest M among the entries of that kind is used.
    """
    device = torch.device(device)
    table = load_configs(weights.config_experts, weights.intermediate_size, device_name(device))
    if not table:
        if device.type == "cpu":
            return INTERPRETER_CONFIG
        return heuristic_config(Call(weights, device, dtype, num_tokens * top_k))
    if weights.config_experts != weights.num_experts:
        direct = decode.direct_mode(num_tokens * top_k, weights.num_experts)
        table = {m: cfg for m, cfg in table.items() if cfg.direct == direct} or table
    nearest = min(table, key=lambda m: abs(m - num_tokens))
    return table[nearest]


def kernel_path(
    hidden_states: torch.Tensor, weights: MoeWeights, top_k: int, config: KernelConfig | Mapping | None = None
) -> Family:
    """The family ``fused_moe(hidden_states, weights, <[M, top_k] ids>, ..., config=config)`` runs."""
    return _plan(hidden_states, weights, top_k, config, hidden_states).family.family


def _check_inputs(hidden_states: torch.Tensor, weights: MoeWeights, topk_ids: torch.Tensor, topk_weights) -> None:
    """Turn shape/dtype/device mistakes into one-line RepackErrors before any kernel runs."""
    dims = 5 if weights.tiled else 3
    if weights.w13_qweight.dim() != dims or weights.w2_qweight.dim() != dims:
        raise RepackError(
            f"fused_moe: {weights.word_order!r} words are {dims}-D, got w13 {list(weights.w13_qweight.shape)} and w2 "
            f"{list(weights.w2_qweight.shape)}; build MoeWeights from the checkpoint's stack (MoeWeights.from_tensors)"
        )
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
    if weights.mma_order and not weight_major.supports(
        weights.bits, weights.hidden_size, weights.intermediate_size, weights.group_size
    ):
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
    spelling (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, FAMILY, and the family's DIRECT, SCALE_ACC,
    SPLIT_K, QUANT_AHEAD, REDUCE, PREFETCH, GLUON: runtime/kernel_config.py). ``out`` receives the result.
    """
    _check_inputs(hidden_states, weights, topk_ids, topk_weights)
    out = _output(hidden_states, out)
    if hidden_states.shape[0] == 0:
        return out
    plan = _plan(hidden_states, weights, topk_ids.shape[1], config, out)
    ids = topk_ids.contiguous()
    rows = align_pairs(ids, weights.num_experts, plan.block_m) if plan.block_m is not None else None
    work = Work(hidden_states, weights, ids, topk_weights.to(torch.float32).contiguous(), out, rows)
    return _run(plan, work)


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
    the routing inside the call's first launch: the alignment's (kernels/align.py) and, at decode, the activation
    preparation's (kernels/decode.py; not for act-order stacks). One launch fewer per call than routing first.
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
    plan = _plan(hidden_states, weights, top_k, config, out)
    rows = routing = None
    stage = routing_stage(plan, weights)
    if stage == "alignment":
        route_w, ids, rows = route_and_align(router_logits, top_k, renormalize, plan.block_m)
    elif stage == "first launch":
        logits, route_w, ids = route_outputs(router_logits, top_k)  # filled by the family's first launch
        routing = (logits, renormalize)
    else:
        route_w, ids = route(router_logits, top_k, renormalize)
    _check_inputs(hidden_states, weights, ids, route_w)
    return _run(plan, Work(hidden_states, weights, ids, route_w, out, rows, routing=routing))


@dataclass(frozen=True)
class Plan:
    """What one call runs: the family, the config it runs with (its tile and top-k sum filled in), and the rows of
    its per-expert blocks (None: one program per pair, no alignment)."""

    family: KernelFamily
    config: KernelConfig
    block_m: int | None


def routing_stage(plan: Plan, weights: MoeWeights) -> str:
    """Where routed_moe routes: inside the alignment ("alignment": kernels/align.py decides how far), inside the
    family's first launch ("first launch"), or in a launch of its own ("routing")."""
    if plan.block_m is not None:
        return "alignment"
    return "first launch" if plan.family.routes_in_first_launch(weights) else "routing"


def _output(hidden_states: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty_like(hidden_states, memory_format=torch.contiguous_format) if out is None else out


def _plan(hidden_states: torch.Tensor, weights: MoeWeights, top_k: int, config, out: torch.Tensor) -> Plan:
    """The config (the caller's, parsed, else :func:`get_config`'s), its family and its top-k sum for this call."""
    m, dtype, device = hidden_states.shape[0], hidden_states.dtype, hidden_states.device
    if config is None:
        config = get_config(weights, m, top_k, dtype, device)
    config = as_kernel_config(config).fit_group(weights.group_size)
    family, config = choose_family(weights, config, device, dtype, m * top_k)
    config = replace(config, reduce=_reduce(config.reduce, dtype, top_k, out, family))
    return Plan(family, config, family.block_rows(config))


def _reduce(asked: str, dtype: torch.dtype, top_k: int, out: torch.Tensor, family: KernelFamily) -> str:
    """The top-k sum a call can take: per-pair rows that are the output itself at top-1; a mode the family's w2
    writes (``reduce_modes``), else per-pair rows; atomics of the activation dtype into ``out`` ("out") only for fp16
    (eight bf16 roundings per element would cost more than the 5e-3 the bf16 path is held to: fp32 atomics instead)
    and a contiguous ``out`` (cleared as one run of memory); w2's own sum ("last") into rows of unit stride."""
    if top_k == 1 or asked not in family.reduce_modes or (asked == "last" and out.stride(1) != 1):
        return "pairs"
    if asked == "out" and (dtype != torch.float16 or not out.is_contiguous()):
        return "atomic"
    return asked


def _run(plan: Plan, work: Work) -> torch.Tensor:
    """The family's launches between the top-k sum's set-up and its end (a family that sums in w2 does both)."""
    if work.x.stride(1) != 1:
        work.x = work.x.contiguous()
    if plan.family.topk_sum is TopkSum.BY_REDUCE:
        work.target = _sum_target(plan, work)
    plan.family.run(work, plan.config)
    if plan.family.topk_sum is TopkSum.BY_REDUCE:
        _sum_topk(plan.config.reduce, work)
    return work.out


def _sum_target(plan: Plan, work: Work) -> torch.Tensor:
    """Where w2 writes for ``config.reduce``: fp32 [M, H] ("atomic"), the output ("out"), zeroed here unless the
    family's w13 clears it; the output itself at top-1; else one row per pair [P, H] ("pairs", "last")."""
    (m, h), top_k, out, device = work.x.shape, work.topk_ids.shape[1], work.out, work.x.device
    cleared = plan.family.clears_target
    if plan.config.reduce == "atomic":
        return (torch.empty if cleared else torch.zeros)(m, h, dtype=torch.float32, device=device)
    if plan.config.reduce == "out":
        return out if cleared else out.zero_()
    if top_k == 1 and out.is_contiguous():
        return out
    return torch.empty(m * top_k, h, dtype=work.x.dtype, device=device)


def _sum_topk(reduce: str, work: Work) -> None:
    """The finalize step: the fp32 sums cast into the output, or the per-pair rows summed into it (unless w2 summed
    them, "last")."""
    if reduce == "atomic":
        work.out.copy_(work.target)
    elif work.target is not work.out and reduce != "last":
        topk_sum(work.target, work.topk_ids.shape[1], work.out)  # [M * T, H] -> [M, H]
