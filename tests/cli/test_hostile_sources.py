"""Hostile or odd sources end in one line (or convert, when valid), never a traceback, a hang or a memory blow-up
(issue 13, items 4, 9, 10 and 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from repack.formats.manifest import SELF_CHECKSUM
from tests.support.cli import assert_one_line_error, convert_fails, copy_checkpoint, edit_weights, run_cli
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"


@pytest.fixture
def src(tmp_path) -> Path:
    return copy_checkpoint(SYM, tmp_path / "src")


def test_zero_element_tensor_converts_and_verifies(src, tmp_path):
    edit_weights(src, lambda tensors: tensors.update({"model.empty_buffer": torch.zeros(0, 8, dtype=torch.float16)}))
    out = tmp_path / "out"
    result = run_cli("convert", src, out, "--quiet")
    assert result.exit_code == 0, result.output
    verified = run_cli("verify", out, "--source", src)
    assert verified.exit_code == 0, verified.output


def test_terminal_escape_codes_in_a_tensor_name_are_escaped(src, tmp_path):
    edit_weights(src, lambda tensors: tensors.update({"model.\x1b[2J\x1b]0;pwned\x07.weight": torch.zeros(2)}))
    path = src / "model.safetensors"
    data = path.read_bytes().replace(b'"F32"', b'"F99"', 1)  # an unsupported dtype names the tensor
    path.write_bytes(data)
    line = convert_fails(src, tmp_path, "F99")
    assert "\x1b" not in line and "\x07" not in line and "\\x1b[2J" in line


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def set_key(key, value):
    return lambda config: config.update({key: value})


def set_quant(key, value):
    return lambda config: config["quantization_config"].update({key: value})


@pytest.mark.parametrize(
    "edit,must_contain",
    [
        (set_key("num_experts", "60"), "num_experts must be a non-negative integer"),
        (set_key("num_experts", -1), "num_experts must be a non-negative integer"),
        (set_key("num_hidden_layers", [2]), "num_hidden_layers must be a non-negative integer"),
        (set_key("decoder_sparse_step", 1.5), "decoder_sparse_step"),
        (set_key("mlp_only_layers", 1), "mlp_only_layers must be a list"),
        (set_key("mlp_only_layers", ["1"]), "mlp_only_layers must be a list"),
        (set_quant("dynamic", ["-:.*"]), "dynamic must be an object"),
        (set_quant("dynamic", {"+:.*experts.*": 4}), "must map to an object of overrides"),
        (set_quant("dynamic", {"+:(unclosed": {"bits": 4}}), "not a valid regex"),
        (set_quant("modules_in_block_to_quantize", 7), "modules_in_block_to_quantize must be a list"),
        (set_quant("modules_in_block_to_quantize", [["mlp.experts.#.gate_proj", 3]]), "must be a list of module"),
    ],
)
def test_mistyped_config_keys_are_one_line(src, tmp_path, edit, must_contain):
    edit_config(src, edit)
    convert_fails(src, tmp_path, must_contain)


def test_deeply_nested_config_is_one_line(src, tmp_path):
    (src / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    convert_fails(src, tmp_path, "config.json", "not valid JSON")


def test_negative_expert_shape_is_one_line(src, tmp_path):
    path = src / "model.safetensors"
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    name = "model.layers.1.mlp.experts.3.up_proj.scales"
    header[name]["shape"] = [-header[name]["shape"][0], -header[name]["shape"][1]]
    encoded = json.dumps(header, separators=(",", ":")).encode().ljust(header_len)
    assert len(encoded) == header_len
    path.write_bytes(data[:8] + encoded + data[8 + header_len :])
    convert_fails(src, tmp_path, name, "non-negative")


def test_a_billion_layers_in_config_is_refused_at_once(src, tmp_path):
    """Counts come from the tensors present; the config's count is only checked against them."""
    edit_config(src, set_key("num_hidden_layers", 1_000_000_000))
    convert_fails(src, tmp_path, "num_hidden_layers is 1000000000", "no tensor of layer 2")


def test_catastrophic_dynamic_regex_is_stopped(src, tmp_path, monkeypatch):
    import repack.formats.quant_config as quant_config

    monkeypatch.setattr(quant_config, "REGEX_SECONDS", 0.5)
    edit_config(src, set_quant("dynamic", {r"+:((.)(?=.)|.)*\d{5}": {"bits": 4}}))
    convert_fails(src, tmp_path, "takes too long", "simplify the regex")


@pytest.mark.parametrize(
    "fields,must_contain",
    [
        (None, "not a JSON object"),
        ({"output_files": ["model.safetensors"]}, "output_files is not an object"),
        ({"output_files": {"config.json": "abc"}}, "output_files entry 'config.json' is not an object"),
        ({"source_files": {"config.json": 5}}, "source_files entry 'config.json' is not an object"),
        ({"source": "org/name"}, "source is not an object"),
    ],
)
def test_verify_on_a_misshapen_manifest_is_one_line(tmp_path, fields, must_contain):
    """A real manifest with one field misshapen (its own checksum dropped, as older manifests have none)."""
    out = tmp_path / "out"
    assert run_cli("convert", SYM, out, "--quiet").exit_code == 0
    manifest = json.loads((out / "repack_manifest.json").read_text())
    manifest.pop(SELF_CHECKSUM)
    (out / "repack_manifest.json").write_text(json.dumps([1, 2] if fields is None else {**manifest, **fields}))
    assert_one_line_error(run_cli("verify", out), "repack_manifest.json", must_contain)
