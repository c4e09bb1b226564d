"""The runtime's MoE blocks agree with GPTQModel's own outputs on the real fixtures.

Each fixture is converted with the converter's Python API (``repack.convert.convert``), loaded with
``repack.runtime.load``, and every MoE layer's ``block(fp16.layers.{i}.moe.input)`` is compared with
GPTQModel's ``fp16.layers.{i}.moe.output``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.checkpoints import convert_fixture, relative_error
from tests.support.fixtures import FIXTURES

RELATIVE_TOLERANCE = 5e-3


@pytest.fixture(scope="module", params=FIXTURES, ids=lambda p: p.name)
def converted(request, tmp_path_factory) -> tuple[Path, Path]:
    source = request.param
    return source, convert_fixture(source, tmp_path_factory.mktemp(source.name) / "out")


def test_every_moe_layer_matches_gptqmodel(converted, device):
    from repack.runtime import load

    source, out = converted
    reference = load_file(source / "reference.safetensors")
    ckpt = load(out, device=device, dtype=torch.float16)
    assert ckpt.moe_layers == list(range(ckpt.num_layers))
    for layer in ckpt.moe_layers:
        # The "joined" mode, explicitly: these shared experts (I_s = 512, routed I = 384) cannot be chunks of the
        # routed size, so the converter keeps two stacks and the block falls back to its two-call path, which is
        # also all that "separate" runs. Joined stacks are checked on synthetic checkpoints (test_moe_block.py).
        block = ckpt.moe_block(layer, shared_mode="joined")
        assert block.joined is None
        moe_input = reference[f"fp16.layers.{layer}.moe.input"].to(device)
        expected = reference[f"fp16.layers.{layer}.moe.output"]
        actual = block(moe_input).cpu()
        assert actual.shape == expected.shape and actual.dtype == torch.float16
        error = relative_error(actual, expected)
        assert error <= RELATIVE_TOLERANCE, f"{source.name} layer {layer}: relative error {error:.2e}"


def test_router_picks_gptqmodels_experts(converted, device):
    """The block's routing reproduces GPTQModel's chosen experts and (fp16-rounded) weights."""
    from repack.runtime import load

    source, out = converted
    reference = load_file(source / "reference.safetensors")
    ckpt = load(out, device=device, dtype=torch.float16)
    for layer in ckpt.moe_layers:
        x = reference[f"fp16.layers.{layer}.moe.input"].reshape(-1, ckpt.moe_weights(layer).hidden_size)
        weights, ids = ckpt.moe_block(layer).route(x.to(device))
        expected_ids = reference[f"fp16.layers.{layer}.router.topk_indices"]
        expected_weights = reference[f"fp16.layers.{layer}.router.topk_weights"].float()
        order, expected_order = ids.long().cpu().argsort(dim=1), expected_ids.argsort(dim=1)
        assert torch.equal(ids.long().cpu().gather(1, order), expected_ids.gather(1, expected_order))
        torch.testing.assert_close(
            weights.cpu().gather(1, order), expected_weights.gather(1, expected_order), rtol=2e-3, atol=1e-3
        )
