"""Bad AWQ and compressed-tensors inputs: exit != 0, one stderr line naming the tensor or config key, no output.

Each case edits a real fixture (tests/fixtures/make_source_fixtures.py) the way a broken export or a scheme we do not
take would look; the good cases next to them (bfloat16 scales, 8-bit layers) convert and verify bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.cli import convert_fails, copy_checkpoint, edit_weights, run_cli
from tests.support.fixtures import FIXTURES_DIR

CT_ASYM = FIXTURES_DIR / "ct-qwen2moe-g128-asym"
CT_SYM = FIXTURES_DIR / "ct-qwen3moe-g128-sym"
AWQ = FIXTURES_DIR / "awq-qwen2moe-g128-asym"
EXPERT = "model.layers.1.mlp.experts.3"


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"])
    path.write_text(json.dumps(config))


def weights(config: dict) -> dict:
    return config["config_groups"]["group_0"]["weights"]


def converts_and_verifies(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--quiet")
    assert result.exit_code == 0, result.output
    result = run_cli("verify", out, "--source", src, "--quiet")
    assert result.exit_code == 0 and "bit-exact" in result.stdout, result.output
    return out


@pytest.fixture
def ct(tmp_path) -> Path:
    return copy_checkpoint(CT_ASYM, tmp_path / "src")


@pytest.fixture
def awq(tmp_path) -> Path:
    return copy_checkpoint(AWQ, tmp_path / "src")


def test_ct_wrong_packing_dtype(ct, tmp_path):
    edit_weights(
        ct, lambda t: t.update({f"{EXPERT}.up_proj.weight_packed": t[f"{EXPERT}.up_proj.weight_packed"].long()})
    )
    convert_fails(ct, tmp_path, f"{EXPERT}.up_proj.weight_packed", "expected a 2-D int32 tensor")


def test_ct_packed_words_disagree_with_weight_shape(ct, tmp_path):
    edit_weights(ct, lambda t: t.update({f"{EXPERT}.gate_proj.weight_shape": torch.tensor([256, 512])}))
    convert_fails(ct, tmp_path, f"{EXPERT}.gate_proj.weight_shape", "says 256x512")


def test_ct_missing_scale(ct, tmp_path):
    edit_weights(ct, lambda t: t.pop(f"{EXPERT}.down_proj.weight_scale"))
    convert_fails(ct, tmp_path, f"missing expert tensor {EXPERT}.down_proj.weight_scale")


def test_ct_scale_of_the_wrong_shape(ct, tmp_path):
    edit_weights(
        ct,
        lambda t: t.update(
            {f"{EXPERT}.down_proj.weight_scale": t[f"{EXPERT}.down_proj.weight_scale"].repeat(1, 2).contiguous()}
        ),
    )  # one group more than the 128 inputs hold
    convert_fails(ct, tmp_path, f"{EXPERT}.down_proj.weight_scale", "expected float16 or bfloat16 or float32 [128, 1]")


def test_ct_asymmetric_without_zero_points(ct, tmp_path):
    edit_weights(ct, lambda t: t.pop(f"{EXPERT}.up_proj.weight_zero_point"))
    convert_fails(ct, tmp_path, f"{EXPERT}.up_proj.weight_zero_point: missing, but the config says asymmetric")


def test_ct_zero_points_on_a_symmetric_scheme(tmp_path):
    src = copy_checkpoint(CT_SYM, tmp_path / "src")
    edit_weights(
        src, lambda t: t.update({f"{EXPERT}.up_proj.weight_zero_point": torch.zeros(16, 1, dtype=torch.int32)})
    )
    convert_fails(src, tmp_path, f"{EXPERT}.up_proj.weight_zero_point: present, but the config says symmetric")


@pytest.mark.parametrize("strategy", ["tensor", "block", "token"])
def test_ct_unknown_strategy(ct, tmp_path, strategy):
    edit_config(ct, lambda q: weights(q).update(strategy=strategy))
    convert_fails(ct, tmp_path, f"weight strategy {strategy!r} is not supported", "config_groups.group_0")


def test_ct_activation_quantization_is_refused(ct, tmp_path):
    edit_config(ct, lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}))
    convert_fails(ct, tmp_path, "also quantizes activations")


@pytest.mark.parametrize("fmt", ["float-quantized", "naive-quantized", "marlin-24"])
def test_ct_other_compression_formats(ct, tmp_path, fmt):
    edit_config(ct, lambda q: (q.update(format=fmt), q["config_groups"]["group_0"].update(format=fmt)))
    convert_fails(ct, tmp_path, f"format {fmt!r} is not supported", "pack-quantized")


@pytest.mark.parametrize(
    "key,value",
    [("sparsity_config", {"format": "sparse-24-bitmask"}), ("transform_config", {"config_groups": {"R1": {}}})],
)
def test_ct_sparsity_and_transforms_are_refused(ct, tmp_path, key, value):
    edit_config(ct, lambda q: q.update({key: value}))
    convert_fails(ct, tmp_path, f"{key} is set", "dense pack-quantized weights only")


def test_ct_backtracking_regex_is_stopped(ct, tmp_path, monkeypatch):
    """The regexes come from the checkpoint: all matching of one config shares a time budget."""
    import repack.formats.source_configs as source_configs

    monkeypatch.setattr(source_configs, "REGEX_SECONDS", 0.5)
    edit_config(ct, lambda q: q.update(ignore=[r"re:((.)(?=.)|.)*\d{5}"]))
    convert_fails(ct, tmp_path, "takes too long to match", "simplify it")


def test_ct_not_compressed(ct, tmp_path):
    edit_config(ct, lambda q: q.update(quantization_status="frozen"))
    convert_fails(ct, tmp_path, "quantization_status is 'frozen'", "save_compressed=True")


def test_ct_quantized_router_is_refused(ct, tmp_path):
    def quantize_router(tensors):
        tensors.pop("model.layers.0.mlp.gate.weight")
        tensors["model.layers.0.mlp.gate.weight_packed"] = torch.zeros(8, 16, dtype=torch.int32)
        tensors["model.layers.0.mlp.gate.weight_scale"] = torch.ones(8, 1, dtype=torch.float16)
        tensors["model.layers.0.mlp.gate.weight_shape"] = torch.tensor([8, 128])

    edit_weights(ct, quantize_router)
    edit_config(ct, lambda q: q.update(ignore=["lm_head"]))
    convert_fails(ct, tmp_path, "model.layers.0.mlp.gate is a MoE router", "ignore")


def test_ct_bf16_scales_that_fp16_holds_convert_and_verify(ct, tmp_path):
    """llm-compressor on a bf16 model saves bf16 scales: taken where every value is a float16 exactly, written back
    as bf16 by the inverse."""
    edit_weights(ct, lambda t: t.update({n: v.bfloat16() for n, v in t.items() if n.endswith("weight_scale")}))
    out = converts_and_verifies(ct, tmp_path)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["source_format"] == "compressed-tensors"


def test_ct_bf16_scales_below_fp16_range_are_refused(ct, tmp_path):
    def tiny(tensors):
        scale = tensors[f"{EXPERT}.gate_proj.weight_scale"].bfloat16()
        scale[0, 0] = 1e-12
        tensors[f"{EXPERT}.gate_proj.weight_scale"] = scale

    edit_weights(ct, tiny)
    convert_fails(ct, tmp_path, f"{EXPERT}.gate_proj.weight_scale", "float16 cannot hold exactly")


def test_ct_8bit_layers_convert_and_verify(tmp_path):
    """A mixed scheme: 8-bit attention through a second config group (as llm-compressor writes it); the 8-bit
    linears become 8-bit GPTQ tensors, described per module in linear_quantization_config."""
    from repack.formats.gptq import pack_along_rows, unpack_along_rows
    from repack.formats.sources.words import pack_last, unpack_last

    src = copy_checkpoint(CT_ASYM, tmp_path / "src")
    attention = "model.layers.1.self_attn.o_proj"

    def widen(tensors):  # the same 4-bit values and zeros, stored as 8-bit fields (4 per word)
        packed = tensors[f"{attention}.weight_packed"]
        values = unpack_along_rows(packed.t().contiguous(), 4).t()
        tensors[f"{attention}.weight_packed"] = pack_along_rows(values.t().contiguous() + 120, 8).t().contiguous()
        zeros = unpack_last(tensors[f"{attention}.weight_zero_point"].t().contiguous(), 4)
        tensors[f"{attention}.weight_zero_point"] = pack_last(zeros + 120, 8).t().contiguous()

    edit_weights(src, widen)

    def second_group(quant):
        eight = json.loads(json.dumps(quant["config_groups"]["group_0"]))
        eight["weights"]["num_bits"] = 8
        eight["targets"] = [attention]
        quant["config_groups"]["group_8bit"] = eight  # after group_0 ("Linear"): the exact name wins

    edit_config(src, second_group)
    out = converts_and_verifies(src, tmp_path)
    dense = json.loads((out / "config.json").read_text())["quantization_config"]["linear_quantization_config"]
    assert dense["bits"] == 4
    assert dense["dynamic"] == {f"+:^{attention.replace('.', chr(92) + '.')}$": {"bits": 8, "group_size": 128,
                                                                                   "sym": False}}  # fmt: skip


def test_awq_wrong_packing_shape(awq, tmp_path):
    edit_weights(
        awq, lambda t: t.update({f"{EXPERT}.up_proj.qweight": t[f"{EXPERT}.up_proj.qweight"][:, :8].contiguous()})
    )  # half the output words: the qzeros no longer match
    convert_fails(awq, tmp_path, f"{EXPERT}.up_proj.qzeros", "expected int32 [1, 8]")


def test_awq_wrong_packing_dtype(awq, tmp_path):
    edit_weights(awq, lambda t: t.update({f"{EXPERT}.up_proj.qweight": t[f"{EXPERT}.up_proj.qweight"].long()}))
    convert_fails(awq, tmp_path, f"{EXPERT}.up_proj.qweight", "expected a 2-D int32 tensor (AWQ GEMM, [K, N/8])")


@pytest.mark.parametrize("group_size", [48, 256])
def test_awq_unknown_group_size(awq, tmp_path, group_size):
    """AWQ's scheme is its group size (no strategy key): one it does not take is named with the ones it does."""
    edit_config(awq, lambda q: q.update(group_size=group_size))
    convert_fails(awq, tmp_path, f"AWQ group_size {group_size} is not supported", "32, 64, 128, -1")


def test_awq_missing_scales(awq, tmp_path):
    edit_weights(awq, lambda t: t.pop(f"{EXPERT}.gate_proj.scales"))
    convert_fails(awq, tmp_path, f"missing expert tensor {EXPERT}.gate_proj.scales")


def test_awq_scales_of_the_wrong_dtype(awq, tmp_path):
    edit_weights(awq, lambda t: t.update({f"{EXPERT}.down_proj.scales": t[f"{EXPERT}.down_proj.scales"].float()}))
    convert_fails(awq, tmp_path, f"{EXPERT}.down_proj.scales", "expected float16 [1, 128]")


@pytest.mark.parametrize("version", ["gemv", "gemv_fast", "marlin", "exllama"])
def test_awq_other_packings_are_refused(awq, tmp_path, version):
    edit_config(awq, lambda q: q.update(version=version, format=version, checkpoint_format=version))
    convert_fails(awq, tmp_path, f"AWQ version {version!r} is not supported", "gemm")


def test_awq_symmetric_config_with_real_zero_points(awq, tmp_path):
    edit_config(awq, lambda q: q.update(zero_point=False))
    convert_fails(awq, tmp_path, ".qzeros: config says zero_point=False (symmetric)")


def test_awq_modules_to_not_convert_are_copied(tmp_path):
    """A float layer named in modules_to_not_convert is copied through as is (a mixed checkpoint)."""
    src = copy_checkpoint(AWQ, tmp_path / "src")
    module = "model.layers.0.self_attn.q_proj"

    def dequantize(tensors):
        for suffix in ("qweight", "qzeros", "scales"):
            tensors.pop(f"{module}.{suffix}")
        tensors[f"{module}.weight"] = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).half()

    edit_weights(src, dequantize)
    edit_config(src, lambda q: q.update(modules_to_not_convert=[module]))
    out = converts_and_verifies(src, tmp_path)
    from repack.formats.checkpoint import CheckpointReader

    names = CheckpointReader(out).names()
    assert f"{module}.weight" in names and f"{module}.qweight" not in names
    assert "model.layers.0.self_attn.k_proj.qweight" in names
