"""Make valid GPTQ linears from float weights (round-to-nearest), for tests, the demo and benchmarks.

The tensors follow the exact GPTQ conventions of :mod:`repack.formats.gptq` (packing, v1/v2 zero points,
act-order ``g_idx`` in original row order), so everything downstream treats them like a real checkpoint.
"""

from __future__ import annotations

import torch

from repack.formats.gptq import GptqLinear, GptqScheme, pack_along_rows, write_zero_points


def quantize_linear(
    weight: torch.Tensor,
    scheme: GptqScheme,
    *,
    act_order: bool = False,
    generator: torch.Generator | None = None,
    order: torch.Tensor | None = None,
) -> GptqLinear:
    """Quantize ``weight`` [N, K] to a GPTQ linear with round-to-nearest.

    With ``act_order`` the input rows are ranked by a random order (standing in for the Hessian order) and
    ``g_idx[k] = rank(k) // group``, stored in original row order, as GPTQ's desc_act writes it. Pass
    ``order`` (a permutation of ``range(K)``, first = most important row) to reuse one order for linears
    that share an input, as GPTQ does for an expert's gate and up projections (they share one g_idx).
    """
    n, k = weight.shape
    glen = scheme.group_len(k)
    groups = scheme.groups(k)
    if act_order:
        if order is None:
            order = torch.randperm(k, generator=generator)
        rank = torch.empty(k, dtype=torch.int64)
        rank[order] = torch.arange(k)
        g_idx = (rank // glen).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // glen).to(torch.int32)
    w = weight.t().to(torch.float32)  # [K, N]
    max_q = scheme.max_q
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.uint8)
    q = torch.empty(k, n, dtype=torch.uint8)
    for g in range(groups):
        rows = (g_idx == g).nonzero().flatten()
        block = w[rows]
        if scheme.sym:
            scale = (block.abs().amax(0) * 2 / max_q).clamp(min=1e-5)
            zero = torch.full((n,), scheme.sym_zero, dtype=torch.float32)
        else:
            lo, hi = block.amin(0).clamp(max=0), block.amax(0).clamp(min=0)
            scale = ((hi - lo) / max_q).clamp(min=1e-5)
            zero = torch.round(-lo / scale).clamp(0, max_q)
        scale = scale.to(torch.float16)
        q[rows] = torch.clamp(torch.round(block / scale.float()) + zero, 0, max_q).to(torch.uint8)
        scales[g], zeros[g] = scale, zero.to(torch.uint8)
    return GptqLinear(
        qweight=pack_along_rows(q, scheme.bits),
        qzeros=write_zero_points(zeros, scheme),
        scales=scales,
        g_idx=g_idx,
    )


def random_linear(
    in_features: int,
    out_features: int,
    scheme: GptqScheme,
    *,
    act_order: bool = False,
    std: float = 0.02,
    generator: torch.Generator | None = None,
) -> GptqLinear:
    """A GPTQ linear quantized from a random normal weight of standard deviation ``std``."""
    weight = torch.randn(out_features, in_features, generator=generator) * std
    return quantize_linear(weight, scheme, act_order=act_order, generator=generator)
