"""Every bad input: exit != 0, one stderr line naming the file/tensor, no traceback, no output folder."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

import repack.convert
from repack.formats.gptq import GptqScheme
from repack.synthetic import write_synthetic_checkpoint
from tests.support.cli import assert_one_line_error, convert_fails, copy_checkpoint, edit_weights, run_cli
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"
EXPERT = "model.layers.1.mlp.experts.3"


@pytest.fixture
def src(tmp_path) -> Path:
    return copy_checkpoint(SYM, tmp_path / "src")


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def set_quant(**values):
    def edit(config):
        config["quantization_config"].update(values)

    return edit


@pytest.mark.parametrize(
    "method,expected",
    [
        ("awq", "AWQ version 'gptq' is not supported"),  # the GPTQ config's format: gptq read as AWQ's version
        ("compressed-tensors", "compressed-tensors config has no config_groups"),
        ("fp8", "quant_method is 'fp8'; supported source formats: gptq, awq, compressed-tensors"),
    ],
)
def test_gptq_tensors_under_another_quant_method(src, tmp_path, method, expected):
    edit_config(src, set_quant(quant_method=method))
    convert_fails(src, tmp_path, "config.json", expected)


def test_fp16_model_without_quantization_config(src, tmp_path):
    edit_config(src, lambda c: c.pop("quantization_config"))
    (src / "quantize_config.json").unlink()
    convert_fails(src, tmp_path, "not a quantized checkpoint")


@pytest.mark.parametrize("bits", [2, 3, 16])
def test_unsupported_bits(src, tmp_path, bits):
    edit_config(src, set_quant(bits=bits))
    convert_fails(src, tmp_path, f"{bits}-bit", "supported bits: 4, 8", "config.json")


def test_unsupported_architecture_lists_supported(src, tmp_path):
    edit_config(src, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]))
    convert_fails(src, tmp_path, "llama", "qwen2_moe, qwen3_moe, mixtral, deepseek_v2, deepseek_v3")


def test_dense_model(src, tmp_path):
    edit_config(src, lambda c: c.update(num_experts=0))
    convert_fails(src, tmp_path, "dense model")


def test_missing_expert_tensor(src, tmp_path):
    edit_weights(src, lambda t: t.pop(f"{EXPERT}.up_proj.scales"))
    convert_fails(src, tmp_path, f"{EXPERT}.up_proj.scales", "missing")


def test_missing_whole_expert(src, tmp_path):
    edit_weights(src, lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.0.mlp.experts.7.")])
    convert_fails(src, tmp_path, "model.layers.0.mlp.experts.7.gate_proj")


def test_extra_expert_tensor(src, tmp_path):
    def add_ninth_expert(t):
        t["model.layers.0.mlp.experts.8.gate_proj.qweight"] = t[
            "model.layers.0.mlp.experts.0.gate_proj.qweight"
        ].clone()

    edit_weights(src, add_ninth_expert)
    convert_fails(src, tmp_path, "model.layers.0.mlp.experts.8.gate_proj.qweight", "extra")


def test_misshapen_expert_tensor(src, tmp_path):
    edit_weights(src, lambda t: t.update({f"{EXPERT}.down_proj.qweight": torch.zeros(40, 256, dtype=torch.int32)}))
    convert_fails(src, tmp_path, f"{EXPERT}.down_proj")


def test_misshapen_scales(src, tmp_path):
    edit_weights(src, lambda t: t.update({f"{EXPERT}.gate_proj.scales": torch.zeros(3, 384, dtype=torch.float16)}))
    convert_fails(src, tmp_path, f"{EXPERT}.gate_proj.scales")


def test_g_idx_wrong_length(src, tmp_path):
    edit_weights(src, lambda t: t.update({f"{EXPERT}.gate_proj.g_idx": torch.zeros(200, dtype=torch.int32)}))
    convert_fails(src, tmp_path, f"{EXPERT}.gate_proj.g_idx", "256")


def test_g_idx_out_of_range(src, tmp_path):
    def bump(t):
        t[f"{EXPERT}.down_proj.g_idx"] = t[f"{EXPERT}.down_proj.g_idx"].clone()
        t[f"{EXPERT}.down_proj.g_idx"][5] = 99

    edit_weights(src, bump)
    convert_fails(src, tmp_path, f"{EXPERT}.down_proj.g_idx", "99")


def test_zeros_contradict_checkpoint_format(src, tmp_path):
    edit_config(src, set_quant(checkpoint_format="gptq_v2", format="gptq_v2"))
    convert_fails(src, tmp_path, "qzeros", "gptq_v2")


def test_asym_zeros_under_sym_config(src, tmp_path):
    edit_weights(
        src, lambda t: t.update({f"{EXPERT}.up_proj.qzeros": torch.full((2, 48), 0x66666666, dtype=torch.int32)})
    )
    convert_fails(src, tmp_path, f"{EXPERT}.up_proj.qzeros")


def test_missing_config(src, tmp_path):
    (src / "config.json").unlink()
    convert_fails(src, tmp_path, "config.json", str(src))


@pytest.fixture
def sharded(tmp_path) -> Path:
    return write_synthetic_checkpoint(
        tmp_path / "sharded", family="qwen3_moe", scheme=GptqScheme(4, 32, True, "gptq"), shard_size=100_000
    )


def test_missing_index(sharded, tmp_path):
    (sharded / "model.safetensors.index.json").unlink()
    convert_fails(sharded, tmp_path, "model.safetensors.index.json", str(sharded))


def test_index_names_missing_shard(sharded, tmp_path):
    shard = sorted(sharded.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    convert_fails(sharded, tmp_path, shard.name, "index")


def test_truncated_safetensors(src, tmp_path):
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    convert_fails(src, tmp_path, str(path), "truncated")


def test_source_truncated_after_its_header_was_read(src, tmp_path, monkeypatch):
    """A shard cut short while converting (after planning read its header) ends in the one line, not a SIGBUS or a
    short output: the converter reads source bytes with pread (its read-once stream too), which reports the end of
    the file."""
    path = src / "model.safetensors"
    plan = repack.convert.build_plan

    def plan_then_truncate(*args, **kwargs):
        result = plan(*args, **kwargs)
        os.truncate(path, path.stat().st_size // 2)
        return result

    monkeypatch.setattr(repack.convert, "build_plan", plan_then_truncate)
    convert_fails(src, tmp_path, str(path), "truncated while reading")


def test_corrupt_safetensors_header(src, tmp_path):
    path = src / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))
    convert_fails(src, tmp_path, str(path), "corrupt")


def test_source_folder_does_not_exist(tmp_path):
    convert_fails(tmp_path / "nope", tmp_path, "nope", "no such folder")


def test_out_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run_cli("convert", SYM, blocker / "out", "--quiet")
    assert_one_line_error(result, str(blocker), "not a folder")


def test_out_parent_permission_denied(tmp_path, monkeypatch):
    def deny(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", deny)
    result = run_cli("convert", SYM, tmp_path / "out", "--quiet")
    assert_one_line_error(result, str(tmp_path / "out"), "Permission denied")


def test_disk_full_up_front(tmp_path, monkeypatch):
    import repack.convert as convert_module

    monkeypatch.setattr(convert_module.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    convert_fails(SYM, tmp_path, "not enough disk space", "need ~")


def test_disk_full_while_writing(tmp_path, monkeypatch):
    from repack.formats import checkpoint

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.HashingFile, "write", full)
    line = convert_fails(SYM, tmp_path, "disk full writing", "free", "need ~")
    assert "shard" in line


def test_existing_nonempty_out_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(run_cli("convert", SYM, out, "--quiet"), str(out), "--force")
    assert (out / "keep.txt").read_text() == "mine"


def test_output_overlapping_the_source_is_refused_even_with_force(tmp_path):
    """`--force` replaces OUT: it must never be the source, a folder holding it, or a folder inside it."""
    src = copy_checkpoint(Path(SYM), tmp_path / "models" / "qwen")
    (tmp_path / "models" / "other").mkdir()
    (tmp_path / "models" / "other" / "data.txt").write_text("keep me")
    for out in (src, src.parent, src / "out"):
        result = run_cli("convert", src, out, "--force", "--quiet")
        assert_one_line_error(result, "must not be, contain or lie inside the source")
    assert (src / "model.safetensors").exists() and (tmp_path / "models" / "other" / "data.txt").exists()


def test_killed_force_run_gets_the_previous_output_back(tmp_path):
    """A --force run killed between moving OUT aside and publishing leaves `.OUT.old-<pid>`: put back next run."""
    out = tmp_path / "out"
    assert run_cli("convert", SYM, out, "--quiet").exit_code == 0
    out.rename(tmp_path / ".out.old-999999")  # a pid that does not exist
    result = run_cli("convert", SYM, out, "--quiet")
    assert_one_line_error(result, "exists and is not empty")  # OUT is back: refused without --force
    assert (out / "repack_manifest.json").exists() and not (tmp_path / ".out.old-999999").exists()


def test_format_key_alone_sets_the_zero_point_convention(tmp_path):
    """A config with only `format: gptq_v2` is v2 (GPTQModel's synonym); format and checkpoint_format disagreeing
    is refused."""
    from repack.formats.quant_config import parse_quant_config

    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    assert parse_quant_config(dict(base, format="gptq_v2"), "config.json").base.checkpoint_format == "gptq_v2"
    with pytest.raises(Exception, match="disagree"):
        parse_quant_config(dict(base, format="gptq_v2", checkpoint_format="gptq"), "config.json")
