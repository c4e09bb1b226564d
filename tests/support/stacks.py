"""Expert stacks built from random GPTQ source experts: the packed MoeWeights next to the sources they came from."""

from __future__ import annotations

import torch

from repack.formats.gptq import GptqLinear, GptqScheme
from repack.formats.sources.gptq import canonical_from_gptq, gptq_tensors
from repack.formats.stacks import GPTQ_ORDER, MMA128_ORDER, ROUTED, StackInfo, pack_stack, stack_info, unpack_stack
from repack.runtime.weights import MoeWeights
from repack.synthetic_linear import quantize_linear

Expert = tuple[GptqLinear, GptqLinear, GptqLinear]


def expert_names(count: int) -> list[tuple[str, str, str]]:
    return [(f"e{j}.gate_proj", f"e{j}.up_proj", f"e{j}.down_proj") for j in range(count)]


def routed_stack_info(
    sources: list[Expert],
    scheme: GptqScheme,
    *,
    experts: int,
    hidden: int,
    inter: int,
    prefix: str = "mlp.experts",
    word_order: str = GPTQ_ORDER,
) -> StackInfo:
    """The StackInfo of a routed stack of ``experts`` (``len(sources)`` source experts, each split into
    ``experts // len(sources)`` chunks of ``inter``), act-order decided from the sources as the converter does."""
    names = expert_names(len(sources))
    return stack_info(
        prefix, ROUTED, names, sources, scheme, hidden=hidden, inter=inter, num_experts=experts, word_order=word_order
    )


def make_expert(hidden: int, inter: int, scheme: GptqScheme, act_order: bool, seed: int) -> Expert:
    """One GPTQ expert; gate and up share their act-order g_idx (same generator seed -> same random order)."""
    gen = torch.Generator().manual_seed(seed)
    w_gate, w_up = torch.randn(inter, hidden, generator=gen) * 0.05, torch.randn(inter, hidden, generator=gen) * 0.05
    w_down = torch.randn(hidden, inter, generator=gen) * 0.05
    gate = quantize_linear(w_gate, scheme, act_order=act_order, generator=torch.Generator().manual_seed(seed + 1))
    up = quantize_linear(w_up, scheme, act_order=act_order, generator=torch.Generator().manual_seed(seed + 1))
    down = quantize_linear(w_down, scheme, act_order=act_order, generator=torch.Generator().manual_seed(seed + 2))
    return gate, up, down


def make_stack(
    experts: int,
    hidden: int,
    inter: int,
    scheme: GptqScheme,
    act_order: bool = False,
    chunks: int = 1,
    word_order: str = GPTQ_ORDER,
) -> tuple[MoeWeights, list[Expert]]:
    """(MoeWeights in our layout, source experts). ``chunks`` > 1 packs ONE source expert as that many chunks."""
    sources = [make_expert(hidden, inter * chunks, scheme, act_order, 100 * j) for j in range(experts // chunks)]
    info = routed_stack_info(sources, scheme, experts=experts, hidden=hidden, inter=inter, word_order=word_order)
    return MoeWeights.from_tensors(info, pack_gptq(info, sources)), sources


def seeded_expert(hidden: int, inter: int, scheme: GptqScheme, act_order: bool, gen: torch.Generator):
    """gate/up quantized as one [2I, H] linear so they share g_idx (one Hessian per input), down on its own."""
    gate_up = quantize_linear(
        torch.randn(2 * inter, hidden, generator=gen) * 0.02, scheme, act_order=act_order, generator=gen
    )
    gate, up = (linear_columns(gate_up, scheme, slice(h * inter, (h + 1) * inter)) for h in range(2))
    down = quantize_linear(torch.randn(hidden, inter, generator=gen) * 0.02, scheme, act_order=act_order, generator=gen)
    return gate, up, down


def linear_columns(linear: GptqLinear, scheme: GptqScheme, cols: slice) -> GptqLinear:
    packed = slice(cols.start // scheme.pack_factor, cols.stop // scheme.pack_factor)
    return GptqLinear(
        linear.qweight[:, cols].contiguous(),
        linear.qzeros[:, packed].contiguous(),
        linear.scales[:, cols].contiguous(),
        linear.g_idx,
    )


def seeded_stack(scheme, act_order, *, experts=3, hidden=256, inter=128, chunks=1, seed=0, word_order=GPTQ_ORDER):
    """A routed stack of random experts from one generator: (StackInfo, source module names, the experts)."""
    gen = torch.Generator().manual_seed(seed)
    sources = [seeded_expert(hidden, inter * chunks, scheme, act_order, gen) for _ in range(experts // chunks)]
    info = routed_stack_info(
        sources,
        scheme,
        experts=experts,
        hidden=hidden,
        inter=inter,
        prefix="layers.0.mlp.experts",
        word_order=word_order,
    )
    return info, expert_names(len(sources)), sources


def zero_stack(
    experts: int = 2, hidden: int = 256, inter: int = 128, *, word_order: str = MMA128_ORDER, act_order: bool = False
) -> MoeWeights:
    """A 4-bit group-128 stack of zero words and unit scales: enough for the dispatch and tuning choices, which
    read only its shape, word order and act-order permutation."""
    return MoeWeights(
        w13_qweight=torch.zeros(experts, 2 * inter, hidden // 8, dtype=torch.int32),
        w13_scales=torch.ones(experts, hidden // 128, 2 * inter, dtype=torch.float16),
        w2_qweight=torch.zeros(experts, hidden, inter // 8, dtype=torch.int32),
        w2_scales=torch.ones(experts, inter // 128, hidden, dtype=torch.float16),
        bits=4,
        group_size=128,
        word_order=word_order,
        w13_perm=torch.zeros(experts, hidden, dtype=torch.int32) if act_order else None,
    )


def on_device(stack: MoeWeights, device: str | torch.device) -> MoeWeights:
    """``stack`` with every tensor moved to ``device`` (the tests' ``device`` fixture: the GPU when present)."""
    return MoeWeights(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(stack).items()})


def gpu_random_stack(asym_act_order: bool) -> MoeWeights:
    """A random mma128 stack of 8 experts (H 512, I 256) on the GPU (tune.random_stack's), with random zeros and
    act-order permutations when asked: the Hopper-only kernel tests' stack."""
    from dataclasses import replace

    from repack.runtime.tune import random_stack

    stack = random_stack(8, 512, 256, 1)[0]
    if asym_act_order:
        gen = torch.Generator(device="cuda").manual_seed(0)
        zeros = lambda s: torch.randint(0, 16, s.shape, dtype=torch.uint8, device="cuda", generator=gen)  # noqa: E731
        perm = torch.stack([torch.randperm(512, device="cuda", generator=gen) for _ in range(8)]).to(torch.int32)
        stack = replace(stack, w13_zeros=zeros(stack.w13_scales), w2_zeros=zeros(stack.w2_scales), w13_perm=perm)
    return stack


def canonical(sources: list[Expert], scheme: GptqScheme) -> list[tuple]:
    """GPTQ source experts as the canonical linears the packer takes (what the GPTQ reader produces)."""
    return [tuple(canonical_from_gptq(linear, scheme) for linear in expert) for expert in sources]


def pack_gptq(info: StackInfo, sources: list[Expert]) -> dict[str, torch.Tensor]:
    """pack_stack over GPTQ source experts."""
    return pack_stack(info, canonical(sources, info.scheme))


def unpack_gptq(info: StackInfo, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """unpack_stack, then every canonical linear as the GPTQ tensors of the stack's checkpoint_format."""
    out: dict[str, torch.Tensor] = {}
    for module, linear in unpack_stack(info, tensors).items():
        out.update(gptq_tensors(module, linear, info.scheme))
    return out
