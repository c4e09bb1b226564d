"""The CPU-runnable parts of benchmarks/bench_moe.py: its blocks of both shared modes over one [E + C] allocation,
their correctness check, and the report table (the timings themselves need a GPU)."""

from __future__ import annotations

import torch

from benchmarks import bench_moe
from benchmarks.launch_profile import short_name
from repack.formats.stacks import choose_word_order, words_shape
from repack.runtime.moe_block import JOINED, SEPARATE
from repack.runtime.weights import MoeWeights
from tests.support.stacks import on_device

TINY = bench_moe.Case("tiny", experts=4, top_k=2, hidden=128, inter=128, shared_chunks=2)


def random_cpu_stack(case: bench_moe.Case, seed: int = 0) -> MoeWeights:
    """What runtime.tune.random_stack makes on the GPU, on the CPU: random int4 words, scales ~0.01, group 128."""
    gen = torch.Generator().manual_seed(seed)
    experts, h, i = case.experts + case.shared_chunks, case.hidden, case.inter
    order = choose_word_order(4, h, i, 128)
    words = lambda rows, k: torch.randint(  # noqa: E731
        -(2**31), 2**31 - 1, words_shape(order, experts, rows, k // 8), generator=gen, dtype=torch.int32
    )
    scales = lambda *shape: (torch.rand(*shape, generator=gen) * 0.01 + 0.005).half()  # noqa: E731
    return MoeWeights(
        words(2 * i, h), scales(experts, h // 128, 2 * i), words(h, i), scales(experts, i // 128, h), bits=4,
        group_size=128, word_order=order,
    )  # fmt: skip


def test_blocks_of_both_modes_agree_with_the_float32_reference(device):
    torch.manual_seed(0)
    stack = random_cpu_stack(TINY)
    stack = on_device(stack, device)
    gate = (torch.randn(1, TINY.hidden) * 0.05).half().to(device)
    blocks = bench_moe.make_blocks(TINY, stack, gate)
    assert blocks[JOINED].joined.w13_qweight.data_ptr() == stack.w13_qweight.data_ptr()  # a view, as loaded
    assert blocks[SEPARATE].joined is None
    errors = bench_moe.check_block(TINY, torch.float16, blocks, ms=(3,))
    assert set(errors) == {JOINED, SEPARATE}
    assert all(error <= 5e-3 for error in errors.values()), errors


def test_report_has_a_column_per_shared_mode_and_the_launches():
    launches = [dict(name="_w13_kernel", us=6.0, launches=1.0), dict(name="_route_kernel", us=2.5, launches=1.0)]
    row = dict(
        case="tiny", dtype="float16", M=1, kernels="decode", ours_us=10.0, block_joined_us=12.0,
        block_separate_us=15.0, floor_us=5.0, ours_over_floor=2.0, cublas_fp16_us=30.0, launches=launches,
    )  # fmt: skip
    no_shared = dict(row, block_joined_us=None, block_separate_us=None, launches=[])
    meta = dict(date="today", gpu="none", torch="-", triton="-", command="-", copy_bw_GBs=1.0)
    table = bench_moe.markdown([row, no_shared], meta)
    header, _, line, line_no_shared = table.strip().splitlines()[-4:]
    assert "block joined" in header and "block separate" in header and "launches" in header
    assert "| 12.0 | 15.0 |" in line and header.count("|") == line.count("|") == line_no_shared.count("|")
    assert "_w13_kernel 6.0; _route_kernel 2.5" in line
    assert "| - | - |" in line_no_shared


def test_launch_names_are_short():
    assert short_name("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::Half>>(T1)") == (
        "at::native::reduce_kernel"
    )
    assert short_name("_w13_kernel") == "_w13_kernel"
    assert short_name("Memset (Device)") == "Memset"
