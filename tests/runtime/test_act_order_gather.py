"""The act-order gather (runtime/kernels/act_order.py) against torch indexing, in the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from repack.runtime.kernels import act_order
from repack.runtime.kernels.act_order import BLOCK_H, SHARED_COLUMNS, gather_act_order


@pytest.mark.parametrize("in_shared", [False, True], ids=["column-loads", "shared-row"])
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "hidden"),
    [(3, 2, 4, 256), (5, 3, 6, BLOCK_H + 128), (2, 2, 3, SHARED_COLUMNS + 128)],
)
def test_gather_gives_each_pair_its_experts_column_order(monkeypatch, device, in_shared, tokens, top_k, experts,
                                                         hidden):  # fmt: skip
    """Row p is token p // k in expert ids[p]'s order, for H spanning more than one program or step (a masked tail),
    by either kernel."""
    monkeypatch.setattr(act_order, "GATHER_IN_SHARED", in_shared)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.float16)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(torch.int32)
    perm = torch.stack([torch.randperm(hidden, generator=gen) for _ in range(experts)]).to(torch.int32)
    got = gather_act_order(x.to(device), ids.to(device), perm.to(device)).cpu()
    flat = ids.flatten().long()
    want = torch.stack([x[p // top_k, perm[flat[p]].long()] for p in range(tokens * top_k)])
    assert torch.equal(got, want)


def test_gather_of_no_tokens_is_empty(device):
    x = torch.zeros(0, 128, dtype=torch.float16, device=device)
    ids = torch.zeros(0, 2, dtype=torch.int32, device=device)
    perm = torch.arange(128, dtype=torch.int32, device=device).expand(4, -1).contiguous()
    assert gather_act_order(x, ids, perm).shape == (0, 128)
