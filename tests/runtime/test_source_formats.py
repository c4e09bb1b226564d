"""AWQ and compressed-tensors checkpoints made by the tools themselves convert, verify bit for bit, and run.

Each fixture (tests/fixtures/make_source_fixtures.py: llm-compressor's compressed-tensors W4A16 with group 128 and
channel-wise scales, symmetric and not, one with float attention left by ``ignore``; GPTQModel's AWQ GEMM) is
converted with the converter's Python API, verified against its source (every stack and converted linear turned
back into the source format's tensors), then run through the runtime's MoE blocks and the transformers door and
compared with the tool's own float32 reference (its decompression of the saved checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from repack.formats.manifest import Manifest
from tests.support.checkpoints import convert_fixture, relative_error
from tests.support.fixtures import FIXTURES_DIR, SOURCE_FIXTURES, assert_logits_match_reference

BLOCK_TOLERANCE = 5e-3  # relative, fp16 kernels against the tool's float32 block output


@pytest.fixture(scope="module", params=SOURCE_FIXTURES, ids=lambda p: p.name)
def converted(request, tmp_path_factory) -> tuple[Path, Path]:
    source = request.param
    return source, convert_fixture(source, tmp_path_factory.mktemp(source.name) / "out")


def source_method(source: Path) -> str:
    return json.loads((source / "config.json").read_text())["quantization_config"]["quant_method"]


def test_verify_rebuilds_every_source_tensor(converted):
    from repack.verify import verify

    source, out = converted
    report = verify(out, str(source), quiet=True)
    assert report.stacks_checked >= 2
    # every source tensor is accounted for (verify raises otherwise), each compared once
    from safetensors import safe_open

    with safe_open(source / "model.safetensors", "pt") as handle:
        assert report.tensors_compared == len(list(handle.keys()))


def test_config_card_and_manifest_name_the_source_format(converted):
    from repack.card import render_model_card

    source, out = converted
    method = source_method(source)
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["source_format"] == method
    assert quant["linear_quantization_config"]["checkpoint_format"] == "gptq_v2"
    assert {stack["checkpoint_format"] for stack in quant["stacks"]} == {"awq" if method == "awq" else "pack-quantized"}
    manifest = Manifest.read(out)
    assert manifest.source.quant_format == method
    card = render_model_card(manifest, config, repo_id="me/x", speed_table=None)
    assert f"A local {'AWQ' if method == 'awq' else 'compressed-tensors'} checkpoint" in card


def test_moe_blocks_match_the_tools_reference(converted, device):
    from repack.runtime import load

    source, out = converted
    reference = load_file(source / "reference.safetensors")
    ckpt = load(out, device=device, dtype=torch.float16)
    assert ckpt.moe_layers == list(range(ckpt.num_layers))
    for layer in ckpt.moe_layers:
        block = ckpt.moe_block(layer)
        expected = reference[f"fp32.layers.{layer}.moe.output"]
        actual = block(reference[f"fp32.layers.{layer}.moe.input"].to(device, torch.float16)).cpu()
        error = relative_error(actual, expected)
        assert error <= BLOCK_TOLERANCE, f"{source.name} layer {layer}: relative error {error:.2e}"


def test_transformers_door_matches_the_tools_logits(converted, device):
    from repack.runtime import load_hf_model

    source, out = converted
    model = load_hf_model(out, device=device, dtype=torch.float16)
    assert_logits_match_reference(model, source.name, device, key="fp32.logits")


@pytest.mark.parametrize("name", ["ct-qwen3moe-channel-sym-mixed", "awq-qwen3moe-g64-sym"])
def test_from_pretrained_door_matches_the_tools_logits(name, tmp_path):
    """The quantizer door reads the converted linears' GPTQ config (linear_quantization_config) like load_hf_model."""
    from transformers import AutoModelForCausalLM

    import repack.runtime  # noqa: F401  (registers quant_method "repack" with transformers)

    out = convert_fixture(FIXTURES_DIR / name, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float16)
    assert_logits_match_reference(model, name, next(model.parameters()).device, key="fp32.logits")
