"""``repack.runtime.load``: tensors arrive exactly as stored, and bad checkpoints are refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqScheme
from repack.formats.stacks import INDEX_FILE, joinable
from repack.runtime import load
from repack.synthetic import write_synthetic_checkpoint
from tests.support.checkpoints import convert_fixture
from tests.support.fixtures import FIXTURES_DIR
from tests.support.tensor_ops import ALLOWED_OPS, OpRecorder


@pytest.fixture(scope="module", params=["qwen2moe-g32-actorder", "synthetic-joined"])
def sharded(request, tmp_path_factory) -> Path:
    """A checkpoint converted into several small shards (sharded path + index): the act-order Qwen2-MoE fixture,
    and a synthetic Qwen2-MoE whose shared chunks the converter joins to the routed stacks (SPEC section 5)."""
    folder = tmp_path_factory.mktemp("sharded")
    if request.param != "synthetic-joined":
        return convert_fixture(FIXTURES_DIR / request.param, folder / "out", shard_size=1 << 20)
    source = write_synthetic_checkpoint(
        folder / "src", family="qwen2_moe", scheme=GptqScheme(4, 32, True, "gptq"), act_order=True, num_experts=8,
        intermediate_size=64, shared_intermediate_size=128,
    )  # fmt: skip
    return convert_fixture(source, folder / "out", shard_size=40_000)


def shard_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """shard file name -> its tensors, read by the safetensors library itself."""
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    return {name: load_file(folder / name) for name in sorted(set(weight_map.values()))}


def test_bytes_on_device_equal_file_bytes(sharded):
    shards = shard_tensors(sharded)
    assert len(shards) > 1
    ckpt = load(sharded, device="cpu")
    expected_names = {name for tensors in shards.values() for name in tensors}
    assert set(ckpt.tensors) == expected_names
    for tensors in shards.values():
        storages = set()
        for name, expected in tensors.items():
            actual = ckpt.tensors[name]
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
            assert torch.equal(actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
            storages.add(actual.untyped_storage().data_ptr())
        assert len(storages) == 1, "every tensor of a shard must be a view of the shard's one buffer"
    for layer in ckpt.moe_layers:  # a joinable layer's stacks stay one view after the byte-exact load
        routed, shared = ckpt.stack_info(layer, "routed"), ckpt.stack_info(layer, "shared")
        expected = shared is not None and joinable(routed, shared)
        assert (ckpt.joined_moe_weights(layer) is not None) == expected, layer


def test_load_performs_no_tensor_op_but_allocation_and_views(sharded):
    with OpRecorder() as recorder:
        ckpt = load(sharded, device="cpu")
    assert recorder.ops <= ALLOWED_OPS, f"unexpected tensor ops during load: {recorder.ops - ALLOWED_OPS}"
    assert len(ckpt.tensors) > 0


def test_packed_stack_tensors_keep_their_format_dtypes(sharded):
    ckpt = load(sharded, device="cpu")
    weights = ckpt.moe_weights(0)
    assert weights.w13_qweight.dtype == torch.int32 and weights.w2_qweight.dtype == torch.int32
    assert weights.w13_scales.dtype == torch.float16 and weights.w2_scales.dtype == torch.float16
    assert weights.w13_perm is not None and weights.w13_perm.dtype == torch.int32
    shared = ckpt.moe_weights(0, "shared")
    assert shared is not None and shared.hidden_size == weights.hidden_size
    joined = ckpt.joined_moe_weights(0)  # views, so they keep the stored dtypes too
    assert joined is None or (joined.w13_qweight.dtype == torch.int32 and joined.w13_scales.dtype == torch.float16)


def test_checkpoint_layers_and_blocks(sharded):
    ckpt = load(sharded, device="cpu")
    assert ckpt.num_layers == 2
    assert ckpt.moe_layers == [0, 1]
    assert ckpt.moe_block(1) is ckpt.moe_block(1)
    with pytest.raises(RepackError, match="layer 5 has no sparse-MoE block"):
        ckpt.moe_block(5)


def assert_one_line_error(path: Path, match: str, **kwargs) -> None:
    with pytest.raises(RepackError, match=match) as info:
        load(path, device="cpu", **kwargs)
    assert "\n" not in str(info.value)


def test_refuses_a_gptq_source_checkpoint():
    assert_one_line_error(FIXTURES_DIR / "qwen3moe-g128-sym", "not a repack-moe checkpoint")


def test_refuses_an_unknown_format_version(sharded, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["format_version"] = 99
    (copy / "config.json").write_text(json.dumps(config))
    assert_one_line_error(copy, "format_version 99 is not supported")


def test_refuses_a_missing_shard(sharded, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    (copy / f"model-00002-of-{len(shard_tensors(sharded)):05d}.safetensors").unlink()
    assert_one_line_error(copy, "missing")


def test_refuses_a_truncated_shard(sharded, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert_one_line_error(copy, "truncated safetensors file")


def test_refuses_a_missing_folder_and_float32_activations(tmp_path, sharded):
    assert_one_line_error(tmp_path / "nowhere", "no such folder")
    assert_one_line_error(sharded, "not supported for activations", dtype=torch.float32)


def test_import_is_cheap_and_never_imports_the_cli():
    code = (
        "import sys, repack.runtime as r; from repack.runtime import load, MoeWeights; "
        "assert 'triton' not in sys.modules, 'triton'; assert 'repack.cli' not in sys.modules, 'cli'; "
        "from repack.runtime import fused_moe, route; assert 'repack.cli' not in sys.modules, 'cli'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, double-buffered path needs a CUDA GPU")
def test_gpu_staged_load_equals_file_bytes(sharded):
    """Tiny staging chunks force many alternating pinned buffers per shard: the bytes must still match."""
    reference = load(sharded, device="cpu")
    ckpt = load(sharded, device="cuda", chunk_bytes=4096 + 8)
    for name, expected in reference.tensors.items():
        actual = ckpt.tensors[name]
        assert actual.device.type == "cuda" and actual.dtype == expected.dtype, name
        assert torch.equal(actual.cpu().reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
