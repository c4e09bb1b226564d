"""The decode in one launch (runtime/kernels/decode_one_launch.py) against the three launches it replaces.

Both run the same arithmetic in the same order in the interpreter (w13's activations read in place are what the
prepare launch would have stored; a top-1 unsplit sum adds into a zero), so the outputs agree bit for bit, and
both against the float32 reference. The scratch every call shares must be all zero after each call, whatever
shape the call before had.
"""

from __future__ import annotations

import pytest
import torch

from repack.formats.gptq import GptqScheme
from repack.runtime.fused_moe import fused_moe, routed_moe
from repack.runtime.kernels import decode, decode_one_launch
from repack.runtime.kernels.routing import route
from repack.runtime.weights import MoeWeights
from tests.runtime.test_fused_moe import random_routing, reference, relative_error
from tests.support.stacks import make_stack

DECODE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=1, num_stages=1, DIRECT=True, PREFETCH=1)


def on(device: str, stack: MoeWeights) -> MoeWeights:
    return MoeWeights(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(stack).items()})


def both_ways(monkeypatch, call):
    """``call()`` as three launches, then as one (checking that the one-launch path took it)."""
    monkeypatch.setattr(decode, "ONE_LAUNCH", False)
    three = call()
    taken = []
    launch = decode_one_launch.launch
    monkeypatch.setattr(decode, "ONE_LAUNCH", True)
    monkeypatch.setattr(decode_one_launch, "launch", lambda *a, **k: (taken.append(1), launch(*a, **k)))
    one = call()
    assert taken, "the one-launch path did not take the call"
    return three, one


def scratch_is_zero(device: str) -> bool:
    return not decode_one_launch._SCRATCH[torch.device(device)].any()


@pytest.mark.parametrize(
    ("word_order", "sym", "m", "top_k", "split_k"),
    [
        ("mma128_tiles", True, 1, 4, 2),  # M = 1: w13 and w2 in K slices, four pairs
        ("mma128_tiles", False, 3, 2, 1),  # zero points, three tokens, no split
        ("mma128", True, 2, 1, 3),  # top-1: each token's one pair, w13 in three slices
    ],
    ids=["m1-split", "asym-m3", "rows-top1-split3"],
)
def test_one_launch_computes_what_three_do(device, monkeypatch, word_order, sym, m, top_k, split_k):
    """fused_moe with the ids given: bit for bit the three launches' output, within 2e-3 of float32; the scratch
    zero after."""
    scheme = GptqScheme(4, 128, sym, "gptq")
    stack, sources = make_stack(5, 384, 256, scheme, word_order=word_order)
    weights = on(device, stack)
    gen = torch.Generator().manual_seed(m * 10 + top_k)
    x = torch.randn(m, 384, generator=gen).to(torch.float16)
    ids, route_w = random_routing(m, top_k, [0, 1, 3, 4], gen)
    config = dict(DECODE, SPLIT_K=split_k)

    def call():
        return fused_moe(x.to(device), weights, ids.to(device), route_w.to(device), config=config).cpu()

    three, one = both_ways(monkeypatch, call)
    assert torch.equal(one, three)
    assert relative_error(one, reference(x, sources, scheme, ids, route_w)) <= 2e-3
    assert scratch_is_zero(device)


def test_one_launch_routes_every_program_alike(device, monkeypatch):
    """routed_moe: every program routes its own token from the logits, and the outputs, ids and weights are those
    of route() + the three launches; a second call of another shape right after finds the scratch zero."""
    scheme = GptqScheme(4, 128, True, "gptq")
    stack, _ = make_stack(6, 256, 128, scheme, word_order="mma128_tiles")
    weights = on(device, stack)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=gen).to(torch.float16).to(device)
    logits = torch.randn(2, 6, generator=gen).to(device)
    config = dict(DECODE, SPLIT_K=2)
    three, one = both_ways(monkeypatch, lambda: routed_moe(x, weights, logits, 3, True, config=config))
    assert torch.equal(one, three)
    route_w, ids = route(logits, 3, True)
    assert torch.equal(one, fused_moe(x, weights, ids, route_w, config=config))
    assert scratch_is_zero(device)
    smaller = routed_moe(x[:1], weights, logits[:1], 2, False, config=dict(DECODE, SPLIT_K=1))
    route_w, ids = route(logits[:1], 2, False)
    monkeypatch.setattr(decode, "ONE_LAUNCH", False)
    assert torch.equal(smaller, fused_moe(x[:1], weights, ids, route_w, config=dict(DECODE, SPLIT_K=1)))
    assert scratch_is_zero(device)


def test_calls_it_does_not_take(device):
    """Act-order stacks (w13 gathers its rows), gptq-order words and more tokens than every program can route
    take the three launches."""
    scheme = GptqScheme(4, 128, True, "gptq")
    config = decode.KernelConfig.from_dict(dict(DECODE, SPLIT_K=2))
    x = torch.zeros(1, 256, dtype=torch.float16, device=device)
    plain, _ = make_stack(2, 256, 128, scheme, word_order="mma128_tiles")
    act_order, _ = make_stack(2, 256, 128, scheme, act_order=True, word_order="mma128_tiles")
    gptq, _ = make_stack(2, 256, 128, scheme)
    assert decode_one_launch.takes(x, on(device, plain), 2, config)
    assert not decode_one_launch.takes(x, on(device, act_order), 2, config)
    assert not decode_one_launch.takes(x, on(device, gptq), 2, config)
    many = torch.zeros(decode_one_launch.ONE_LAUNCH_MAX_TOKENS + 1, 256, dtype=torch.float16, device=device)
    assert not decode_one_launch.takes(many, on(device, plain), 2, config)


def test_scratch_views_do_not_overlap():
    words = decode_one_launch.Scratch.words(3, 6, 384, 256, 8, 12)
    buffer = torch.zeros(words, dtype=torch.int32)
    views = decode_one_launch.Scratch(buffer, 3, 6, 384, 256, 8, 12).views
    for i, view in enumerate(views.values()):
        view.view(torch.int32).fill_(i + 1)
    assert sorted(torch.unique(buffer).tolist()) == list(range(1, len(views) + 1))
    assert sum(v.numel() for v in views.values()) == words
