"""The decode's request to L2 for the call's experts (runtime/kernels/decode.py ``ASK_L2_PIECES``): extra programs
of the prepare launch route a pair again and ask L2 for a piece of its expert's words, so DRAM streams them while
w13 waits. Where it may run (the host's choice), what ptxas makes of it for sm_90, and on Hopper that it changes no
number of the call (KERNEL_NOTES.md item 40)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace

import pytest
import torch

from repack.runtime.kernels import decode
from tests.runtime.test_kernel_compile_sm90 import _compile
from tests.support.sm90 import before_dependency_wait, ptxas_spills, run_compile_worker
from tests.support.stacks import gpu_random_stack, zero_stack

CUDA = torch.device("cuda", 0)


def test_only_on_an_nvidia_gpu_with_each_expert_one_run_of_words(monkeypatch):
    stack = zero_stack()
    assert decode.l2_pieces(stack, CUDA) == 0  # off by default
    monkeypatch.setattr(decode, "ASK_L2_PIECES", 32)
    assert decode.l2_pieces(stack, CUDA) == 32
    assert decode.l2_pieces(stack, torch.device("cpu")) == 0  # the interpreter runs no inline PTX
    strided = replace(stack, w2_qweight=stack.w2_qweight.transpose(1, 2))  # an expert's words not one run
    assert decode.l2_pieces(strided, CUDA) == 0
    monkeypatch.setattr(torch.version, "hip", "6.2")  # a ROCm build's "cuda" device
    assert decode.l2_pieces(stack, CUDA) == 0


def _worker() -> None:
    """Subprocess entry (tests/support/sm90.py ``run_compile_worker``: the test session interprets): the prepare
    kernel for sm_90 with and without the asking programs, tokens or act-order pairs, ids given or routed; one JSON
    line each with its L2 requests, spills and what it does before the dependent-launch wait."""
    types = dict(x_ptr="*fp16", perm_ptr="*i32", topk_ids_ptr="*i32", xp_ptr="*fp32", scratch_ptr="*i32",
                 logits_ptr="*fp16", topk_weights_ptr="*fp32", w13_words_ptr="*i32", w2_words_ptr="*i32")  # fmt: skip
    for act_order in (False, True):
        for route in (False, True):
            for ask in (0, 32):
                flags = dict(TOP_K=8, BITS=4, HAS_PERM=act_order, MMA_ORDER=True, BLOCK_K=128, ZERO_BLOCK=256,
                             PREPARED="field_major", ROUTE=route, RENORMALIZE=True, BLOCK_E=128, ASK_L2=ask,
                             DEPENDENT=True)  # fmt: skip
                ptx = _compile(decode._prepare_kernel, types, flags, 1, 1).asm["ptx"]
                case = dict(act_order=act_order, route=route, ask=ask, before=before_dependency_wait(ptx))
                case.update(requests=len(re.findall(r"prefetch\.global\.L2", ptx)), spills=ptxas_spills(ptx))
                print(json.dumps(case), flush=True)


@pytest.mark.slow
def test_the_asking_programs_compile_for_sm90_and_touch_nothing_before_their_wait():
    """One L2 request a loop (w13's words, w2's), no spill, nothing read or written before the dependent-launch
    wait (the router logits come from the kernel before); without ASK_L2 none of it is compiled."""
    cases = run_compile_worker(__file__)
    assert len(cases) == 8
    for case in cases:
        assert case["requests"] == (2 if case["ask"] else 0), case
        assert case["spills"] == 0, case
        assert case["before"] == {"waits": 1, "loads": 0, "l2_loads": 0, "writes": 0}, case


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _hopper(), reason="inline PTX: an NVIDIA GPU of compute capability 9.0 or later only")
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "asym-act-order"])
def test_on_the_gpu_asking_l2_changes_no_number(monkeypatch, act_order):
    """The decode call from router logits with and without the asking programs: the same bits (a prefetch writes
    nothing), ids and weights too."""
    from repack.runtime.fused_moe import routed_moe

    stack = gpu_random_stack(act_order)  # act-order with asymmetric zeros
    config = dict(FAMILY="decode", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=1, num_stages=1, SPLIT_K=4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 3):
        x = torch.randn(m, 512, device="cuda", generator=gen).to(torch.float16)
        logits = torch.randn(m, 8, device="cuda", generator=gen)
        expected = routed_moe(x, stack, logits, 2, True, config=config)
        monkeypatch.setattr(decode, "ASK_L2_PIECES", 32)
        assert decode.l2_pieces(stack, x.device) == 32  # the asking programs run
        got = routed_moe(x, stack, logits, 2, True, config=config)
        monkeypatch.setattr(decode, "ASK_L2_PIECES", 0)
        assert torch.equal(got, expected), m


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
