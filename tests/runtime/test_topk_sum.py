"""kernels/topk_sum.py against a float64 sum, in the Triton interpreter on CPU (the GPU when present)."""

from __future__ import annotations

import pytest
import torch

from repack.runtime.kernels.topk_sum import topk_sum


@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 8, 2048), (37, 4, 1408), (300, 6, 3584), (5, 1, 96)])
def test_topk_sum_adds_each_tokens_rows(device, tokens, top_k, hidden):
    gen = torch.Generator().manual_seed(tokens)
    rows = torch.randn(tokens * top_k, hidden, generator=gen).half()
    out = torch.full((tokens, hidden), float("nan"), dtype=torch.float16, device=device)  # every element written
    topk_sum(rows.to(device), top_k, out)
    ref = rows.double().view(tokens, top_k, hidden).sum(1)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-3, atol=1e-3)  # one fp16 rounding of an fp32 sum


def test_topk_sum_writes_a_strided_output(device):
    rows = torch.randn(6, 64).half()
    wide = torch.zeros(3, 128, dtype=torch.float16, device=device)
    topk_sum(rows.to(device), 2, wide[:, :64])
    assert torch.equal(wide[:, :64].cpu(), rows.float().view(3, 2, 64).sum(1).half())  # fp32 sum, one rounding
    assert bool((wide[:, 64:] == 0).all())  # the columns past the view untouched


def test_topk_sum_writes_an_output_strided_along_h(device):
    """Every other column of a wider buffer (a caller's ``out`` view): the kernel follows both strides."""
    rows = torch.randn(6, 64).half()
    wide = torch.zeros(3, 128, dtype=torch.float16, device=device)
    topk_sum(rows.to(device), 2, wide[:, ::2])
    assert torch.equal(wide[:, ::2].cpu(), rows.float().view(3, 2, 64).sum(1).half())
    assert bool((wide[:, 1::2] == 0).all())
