"""route() against torch softmax/topk, and align_pairs() invariants, in the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from repack.formats.errors import RepackError
from repack.runtime.kernels.align import align_pairs, max_aligned_blocks
from repack.runtime.kernels.routing import route


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize"), [(5, 64, 8, False), (37, 60, 4, True), (3, 8, 1, True)]
)
def test_route_matches_torch(device, tokens, experts, top_k, renormalize):
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(torch.float16)
    weights, ids = route(logits.to(device), top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    ids, weights = ids.cpu().long(), weights.cpu()
    # fp16 logits can tie, and torch.topk breaks ties arbitrarily: check the selection, not the order.
    chosen = probs.gather(1, ids)
    unchosen = probs.scatter(1, ids, -1.0)
    assert bool((chosen.min(1).values >= unchosen.max(1).values).all())
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())  # descending
    assert all(len(set(row)) == top_k for row in ids.tolist())
    ref_w = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_route_rejects_bad_top_k():
    with pytest.raises(RepackError, match="top_k=9"):
        route(torch.zeros(2, 8), 9, False)


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), [(5, 8, 64, 16), (300, 4, 60, 64), (3, 1, 8, 64)])
def test_align_sorts_pairs_into_single_expert_blocks(device, tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    used = torch.randperm(experts, generator=gen)[: max(1, experts // 3)]  # the others get no tokens
    ids = used[torch.randint(0, len(used), (tokens, top_k), generator=gen)].to(torch.int32)
    a = align_pairs(ids.to(device), experts, block_m)
    num_pairs = tokens * top_k
    num_blocks = int(a.num_blocks.cpu())
    counts = torch.bincount(ids.flatten().long(), minlength=experts)
    assert num_blocks == int(((counts + block_m - 1) // block_m).sum())
    assert a.max_blocks == max_aligned_blocks(num_pairs, experts, block_m) >= num_blocks
    pairs = a.sorted_pairs.cpu().long().view(-1, block_m)
    block_experts = a.block_experts.cpu().long()
    flat = ids.flatten().long()
    seen = []
    for b in range(num_blocks):
        real = pairs[b][pairs[b] < num_pairs]
        assert len(real) > 0 and bool((flat[real] == block_experts[b]).all())
        seen += real.tolist()
    assert sorted(seen) == list(range(num_pairs))
    assert bool((block_experts[num_blocks:] == -1).all()) and bool((pairs[num_blocks:] == num_pairs).all())
    assert list(block_experts[:num_blocks]) == sorted(block_experts[:num_blocks].tolist())


def test_nan_logits_still_give_expert_ids_in_range(device):
    """A NaN router row (a broken request) must not produce ids past the stack: those would read other memory."""
    logits = torch.tensor([[float("nan"), 1.0, 2.0, 3.0], [float("nan")] * 4, [0.5, 0.1, 0.2, 0.3]], device=device)
    _, ids = route(logits, 2, True)
    assert int(ids.min()) >= 0 and int(ids.max()) < 4
    assert ids[2].tolist() == [0, 3]


def reference_alignment(ids: torch.Tensor, experts: int, block_m: int) -> tuple[list[list[int]], list[int]]:
    """A plain Python alignment: per used expert in id order, its pairs padded with the sentinel to whole blocks
    (as rows of block_m), and each block's expert."""
    flat = ids.flatten().tolist()
    sentinel = len(flat)
    blocks, owners = [], []
    for e in range(experts):
        pairs = [p for p, i in enumerate(flat) if i == e]
        pairs += [sentinel] * (-len(pairs) % block_m)
        for b in range(0, len(pairs), block_m):
            blocks.append(pairs[b : b + block_m])
            owners.append(e)
    return blocks, owners


def routing(kind: str, tokens: int, top_k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens, top_k] ids of one kind: uniform, a third of the experts unused, or one expert taking every pair."""
    if kind == "uniform":
        return torch.randint(0, experts, (tokens, top_k), generator=gen)
    if kind == "third":
        used = torch.randperm(experts, generator=gen)[: max(1, experts // 3)]
        return used[torch.randint(0, len(used), (tokens, top_k), generator=gen)]
    return torch.full((tokens, top_k), experts - 1)  # "one": every pair on the last expert


ALIGN_CASES = [  # tokens, top_k, experts, block_m, routing: pairs from 1 to 32768, E from 8 to 256
    (1, 1, 8, 16, "uniform"),
    (4, 8, 256, 16, "uniform"),
    (128, 8, 128, 16, "third"),
    (1000, 2, 8, 128, "one"),
    (4096, 8, 128, 128, "uniform"),
    (4096, 8, 256, 64, "third"),
    (3000, 6, 64, 32, "one"),
    (2500, 4, 60, 64, "uniform"),
]


def assert_aligned(a, ids: torch.Tensor, experts: int, block_m: int) -> None:
    """``a`` against the reference: the same blocks and owners, each expert's segment exactly its pairs, then
    sentinels (the order inside a segment is not part of the contract: atomics place the pairs on a GPU)."""
    blocks, owners = reference_alignment(ids.cpu(), experts, block_m)
    sentinel = ids.numel()
    num_blocks = int(a.num_blocks.cpu())
    assert num_blocks == len(blocks)
    assert a.block_experts.cpu()[:num_blocks].tolist() == owners
    assert bool((a.block_experts.cpu()[num_blocks:] == -1).all())
    got = a.sorted_pairs.cpu().view(-1, block_m)
    for e in set(owners):
        rows = [b for b, owner in enumerate(owners) if owner == e]
        segment = got[rows].flatten().tolist()
        assert sorted(segment) == sorted(p for b in rows for p in blocks[b])
        real = [p for p in segment if p != sentinel]
        assert segment[: len(real)] == real  # the padding comes last
    assert bool((got[num_blocks:] == sentinel).all())


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m", "kind"), ALIGN_CASES)
def test_align_matches_a_python_reference(device, tokens, top_k, experts, block_m, kind):
    """Single-chunk and multi-chunk alignments against the reference."""
    gen = torch.Generator().manual_seed(tokens * experts + block_m)
    ids = routing(kind, tokens, top_k, experts, gen).to(torch.int32)
    assert_aligned(align_pairs(ids.to(device), experts, block_m), ids, experts, block_m)


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m", "kind"), [ALIGN_CASES[4], ALIGN_CASES[6]])
def test_align_with_the_scan_launch(device, monkeypatch, tokens, top_k, experts, block_m, kind):
    """The scan in a launch of its own (taken past one tile of per-chunk counts) gives the same alignment."""
    from repack.runtime.kernels import align

    monkeypatch.setattr(align, "SCAN_IN_SCATTER", False)
    gen = torch.Generator().manual_seed(tokens * experts + block_m)
    ids = routing(kind, tokens, top_k, experts, gen).to(torch.int32)
    assert_aligned(align_pairs(ids.to(device), experts, block_m), ids, experts, block_m)


def test_align_skips_ids_outside_the_stack(device):
    """An id outside [0, E) (a caller's bug) has no segment: it is not placed, and nothing else is overwritten."""
    ids = torch.tensor([[0, 5], [-1, 1], [1, 0]], dtype=torch.int32)
    a = align_pairs(ids.to(device), 4, 16)
    assert int(a.num_blocks.cpu()) == 2
    got = a.sorted_pairs.cpu().view(-1, 16)
    assert sorted(got[0][got[0] < 6].tolist()) == [0, 5] and sorted(got[1][got[1] < 6].tolist()) == [3, 4]


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m", "renormalize"),
    [
        (3, 8, 2, 16, True),
        (16, 256, 8, 16, True),
        (16, 128, 8, 16, True),
        (65, 128, 8, 16, True),
        (128, 128, 8, 16, True),
        (300, 64, 6, 64, False),
        (1100, 60, 4, 128, False),
        (1200, 128, 8, 16, True),
    ],  # fmt: skip
)
def test_route_and_align_is_route_then_align(device, tokens, experts, top_k, block_m, renormalize):
    """The routed alignment (the one program up to 16 tokens at 128 experts; past it the count programs route
    their own chunks and the scatter programs scan the counts; past one tile of counts the routing kernel routes
    first) gives route()'s weights and ids and their alignment."""
    from repack.runtime.kernels.align import SCAN_TILE, one_program_tokens, route_and_align
    from repack.runtime.kernels.routing import token_block

    assert one_program_tokens(128, 8) == 16 and one_program_tokens(256, 8) == 8 and one_program_tokens(8, 2) == 64
    if tokens == 1200:
        assert -(-tokens // token_block(experts)) * 128 > SCAN_TILE  # the case routed by the routing kernel first
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(torch.float16)
    weights, ids, a = route_and_align(logits.to(device), top_k, renormalize, block_m)
    ref_w, ref_ids = route(logits.to(device), top_k, renormalize)
    assert torch.equal(ids.cpu(), ref_ids.cpu()) and torch.equal(weights.cpu(), ref_w.cpu())
    assert_aligned(a, ref_ids, experts, block_m)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "program_tokens"),
    [(16, 256, 8, 0), (16, 256, 8, 2), (128, 128, 8, 0), (40, 60, 4, 0)],
)
def test_the_last_count_program_places_every_pair(device, monkeypatch, tokens, experts, top_k, program_tokens):
    """Over several count programs, the last one to finish places every pair (shipped up to 128 pairs, here up to
    1024): no scatter launch, the same alignment as with it with each segment in pair order
    (no atomics decide it), and the ticket back at zero so the next call (twice here) finds it so; also with count
    programs of 2 tokens (probe_align's ``half-step-places``: 8 programs at DeepSeek-V3 M = 16)."""
    from repack.runtime.kernels import align

    assert align.LAST_COUNT_PLACES_MAX_PAIRS == 128
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)).to(torch.float16)
    ref_w, ref_ids = route(logits.to(device), top_k, True)
    with monkeypatch.context() as patch:
        patch.setattr(align, "LAST_COUNT_PLACES_MAX_PAIRS", align.MAX_CHUNK)
        patch.setattr(align, "_scatter_kernel", None)  # launching it would fail: the count programs must place
        if program_tokens:  # a routing step of twice that, which the alignment halves
            patch.setattr(align, "token_block", lambda experts: 2 * program_tokens)
        for _ in range(2):
            weights, ids, a = align.route_and_align(logits.to(device), top_k, True, 16)
            assert torch.equal(ids.cpu(), ref_ids.cpu()) and torch.equal(weights.cpu(), ref_w.cpu())
            assert_aligned(a, ref_ids, experts, 16)
            assert [int(t.cpu()) for t in align._TICKETS.values()] == [0] * len(align._TICKETS)
            real = a.sorted_pairs.cpu()[a.sorted_pairs.cpu() < ids.numel()].tolist()
            assert real == sorted(range(ids.numel()), key=lambda p: (int(ids.view(-1)[p]), p))  # pair order
    monkeypatch.setattr(align, "LAST_COUNT_PLACES_MAX_PAIRS", 0)
    assert_aligned(align.route_and_align(logits.to(device), top_k, True, 16)[2], ref_ids, experts, 16)
