"""The plugin's tensor- and expert-parallel cuts of a stored stack against a Python reference (no vLLM, no GPU).

The reference is the full stack dequantized (formats.stacks.dequantize_stack): a tensor-parallel rank must hold
exactly its slice of every expert's gate, up and down weights (and the ranks' expert outputs must sum to the
full expert's), an expert-parallel rank exactly its experts. Cuts that would split a group or a 128-input block
of the mma128 word orders are refused with one line.
"""

from __future__ import annotations

import pytest
import torch

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqScheme
from repack.formats.stacks import GPTQ_ORDER, MMA128_ORDER, TILES_ORDER, dequantize_stack
from repack.runtime.integrations.vllm.sharding import ep_shard, ep_shard_info, tp_shard, tp_shard_info
from tests.support.stacks import pack_gptq, routed_stack_info, seeded_expert

CASES = [  # (word order, scheme, act-order, I, tensor-parallel sizes)
    (GPTQ_ORDER, GptqScheme(4, 32, False, "gptq"), True, 128, (2, 4)),
    (GPTQ_ORDER, GptqScheme(4, 32, True, "gptq"), False, 128, (2, 4)),
    (GPTQ_ORDER, GptqScheme(8, 64, True, "gptq"), True, 128, (2,)),
    (MMA128_ORDER, GptqScheme(4, 128, True, "gptq"), True, 256, (2,)),
    (MMA128_ORDER, GptqScheme(4, -1, False, "gptq"), False, 256, (2,)),
    (TILES_ORDER, GptqScheme(4, 128, True, "gptq"), True, 256, (2,)),
    (TILES_ORDER, GptqScheme(4, -1, False, "gptq"), False, 512, (2, 4)),
]
IDS = [
    f"{order}-{s.bits}b-g{s.group_size}-{'sym' if s.sym else 'asym'}-{'act' if a else 'plain'}"
    for order, s, a, *_ in CASES
]


def stack(word_order: str, scheme: GptqScheme, act_order: bool, inter: int, experts: int = 4, hidden: int = 256):
    gen = torch.Generator().manual_seed(7)
    sources = [seeded_expert(hidden, inter, scheme, act_order, gen) for _ in range(experts)]
    info = routed_stack_info(sources, scheme, experts=experts, hidden=hidden, inter=inter, word_order=word_order)
    return info, pack_gptq(info, sources)


@pytest.mark.parametrize(("word_order", "scheme", "act_order", "inter", "sizes"), CASES, ids=IDS)
def test_each_tensor_parallel_rank_holds_its_slice_and_the_ranks_sum_to_the_expert(
    word_order, scheme, act_order, inter, sizes
):
    info, tensors = stack(word_order, scheme, act_order, inter)
    w13, w2 = dequantize_stack(info, tensors, torch.float64)  # [E, 2I, H], [E, H, I]
    x = torch.randn(3, info.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expert = lambda a, b, n: (torch.nn.functional.silu(x @ a[:n].T) * (x @ a[n:].T)) @ b.T  # noqa: E731
    for size in sizes:
        part = inter // size
        total = torch.zeros(3, info.hidden_size, dtype=torch.float64)
        for rank in range(size):
            shard_info = tp_shard_info(info, rank, size)
            shard = tp_shard(info, tensors, rank, size)
            assert shard_info.intermediate_size == part
            s13, s2 = dequantize_stack(shard_info, shard, torch.float64)
            lo, hi = rank * part, (rank + 1) * part
            assert torch.equal(s13, torch.cat([w13[:, lo:hi], w13[:, inter + lo : inter + hi]], dim=1))
            assert torch.equal(s2, w2[..., lo:hi])
            total += expert(s13[1], s2[1], part)
        torch.testing.assert_close(total, expert(w13[1], w2[1], inter), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("word_order", [GPTQ_ORDER, MMA128_ORDER, TILES_ORDER])
def test_each_expert_parallel_rank_holds_its_whole_experts(word_order):
    info, tensors = stack(word_order, GptqScheme(4, 128, True, "gptq"), True, 128)
    w13, w2 = dequantize_stack(info, tensors)
    for rank in range(2):
        shard_info = ep_shard_info(info, rank, 2)
        s13, s2 = dequantize_stack(shard_info, ep_shard(info, tensors, rank, 2))
        assert shard_info.num_experts == 2 and shard_info.source_modules == info.source_modules[2 * rank : 2 * rank + 2]
        assert torch.equal(s13, w13[2 * rank : 2 * rank + 2]) and torch.equal(s2, w2[2 * rank : 2 * rank + 2])


@pytest.mark.parametrize(
    ("word_order", "scheme", "inter", "size", "fragment"),
    [
        (MMA128_ORDER, GptqScheme(4, 128, True, "gptq"), 128, 2, "multiple of 128 (mma128 word order)"),
        (TILES_ORDER, GptqScheme(4, 128, True, "gptq"), 384, 2, "multiple of 128 (mma128_tiles word order)"),
        (GPTQ_ORDER, GptqScheme(4, 128, True, "gptq"), 128, 2, "and of the group size 128"),
        (GPTQ_ORDER, GptqScheme(4, 32, True, "gptq"), 96, 4, "cannot cut I=96 into 4 tensor-parallel shards"),
    ],
)
def test_a_tensor_parallel_cut_through_a_block_or_group_is_one_line(word_order, scheme, inter, size, fragment):
    info, tensors = stack(word_order, scheme, False, inter)
    with pytest.raises(RepackError) as error:
        tp_shard(info, tensors, 0, size)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_uneven_expert_parallelism_and_a_missing_rank_are_one_line():
    info, tensors = stack(GPTQ_ORDER, GptqScheme(4, 32, True, "gptq"), False, 64, experts=3)
    with pytest.raises(RepackError, match="cannot give 2 expert-parallel ranks equal whole experts"):
        ep_shard(info, tensors, 0, 2)
    with pytest.raises(RepackError, match="rank 2 of 2 does not exist"):
        tp_shard(info, tensors, 2, 2)
