"""Hostile or odd inputs found by trying to break the tool (issue 22, items 11, 13, 15, 19, 21 and 22): each one
through the real `repack` entry point in a subprocess, refused in one line before it costs memory, or (valid
input) converted."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from repack.convert import SLOW_LAYER_ENV, convert
from repack.formats.constants import INDEX_FILE, MANIFEST_FILE
from repack.formats.manifest import MAX_FILES, SELF_CHECKSUM, self_checksum
from tests.support.cli import assert_one_line_error, copy_checkpoint, edit_weights, run_cli
from tests.support.entry_point import REPACK, error_line, run_repack
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"


@pytest.fixture
def src(tmp_path) -> Path:
    return copy_checkpoint(SYM, tmp_path / "src")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """A good output the read-only commands (verify, push --dry-run) are pointed at after a local edit."""
    folder = tmp_path_factory.mktemp("hostile") / "out"
    convert(str(SYM), folder, quiet=True)
    return folder


@pytest.fixture
def out_copy(out, tmp_path) -> Path:
    return copy_checkpoint(out, tmp_path / "out")


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def rewrite_manifest(folder: Path, edit) -> None:
    """Edit the manifest as a tool that knows the format would, keeping its own checksum right."""

    def resealed(data: dict) -> None:
        edit(data)
        data.pop(SELF_CHECKSUM, None)
        data[SELF_CHECKSUM] = self_checksum(data)

    edit_json(folder / MANIFEST_FILE, resealed)


def convert_refused(src: Path, tmp_path: Path, *must_contain: str) -> str:
    out = tmp_path / "out"
    line = error_line(run_repack("convert", src, out, "--quiet"), *must_contain)
    assert not out.exists()
    return line


def write_raw_safetensors(path: Path, header: dict, data: bytes, encoding: str = "utf-8") -> None:
    encoded = json.dumps(header).encode(encoding)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


# ------------------------------------------------------------------------------------------ item 11: memory


def test_a_dynamic_regex_that_takes_gigabytes_to_compile_is_refused_uncompiled(src, tmp_path):
    edit_json(
        src / "config.json",
        lambda c: c["quantization_config"].update(dynamic={"+:(?:(?:a{1000}){1000}){1000}": {"bits": 4}}),
    )
    start = time.monotonic()
    convert_refused(src, tmp_path, "dynamic rule", "too large to compile", "simplify the regex")
    assert time.monotonic() - start < 60  # 4 GB and 19 s of compiling before


def test_a_zero_size_tensor_of_layer_999999999_backs_no_layer_count(src, tmp_path):
    edit_weights(src, lambda t: t.update({"model.layers.999999999.pad": torch.zeros(0, dtype=torch.float16)}))
    edit_json(src / "config.json", lambda c: c.update(num_hidden_layers=1_000_000_000))
    convert_refused(src, tmp_path, "num_hidden_layers is 1000000000", "no tensor of layer 2")


# ------------------------------------------------------------------------------ item 15: unreadable shapes


@pytest.mark.parametrize(("dtype", "shape"), [("F16", [0, 2**64]), ("F32", [0, 2**62, 4]), ("U8", [2**40, 0, 2**30])])
def test_shapes_torch_or_safetensors_cannot_hold_are_refused(src, tmp_path, dtype, shape):
    path = src / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    end = max(meta["data_offsets"][1] for name, meta in header.items() if name != "__metadata__")
    header["model.pad"] = {"dtype": dtype, "shape": shape, "data_offsets": [end, end]}
    write_raw_safetensors(path, header, data[8 + length :])
    assert_one_line_error(run_cli("convert", src, tmp_path / "out", "--quiet"), "model.pad", "larger than torch")
    if shape[1] == 2**64:
        convert_refused(src, tmp_path, "model.pad", "larger than torch and safetensors can hold")


# ---------------------------------------------------------------------------------- item 19: huge manifests


def test_a_million_entry_manifest_is_refused_before_it_is_parsed(out_copy):
    entry = {"sha256": "0" * 64, "size": 1}
    manifest = json.loads((out_copy / MANIFEST_FILE).read_text())
    manifest["output_files"].update({f"f{i}": entry for i in range(1_000_000)})
    (out_copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    start = time.monotonic()
    error_line(run_repack("verify", out_copy), MANIFEST_FILE, "MB a repack_manifest.json may have")
    assert time.monotonic() - start < 60  # 266 s and 1.17 GB before


def test_a_manifest_under_the_size_bound_with_too_many_entries_is_refused(out_copy):
    entry = {"sha256": "0" * 64, "size": 1}
    rewrite_manifest(out_copy, lambda m: m["output_files"].update({str(i): entry for i in range(MAX_FILES + 1)}))
    assert (out_copy / MANIFEST_FILE).stat().st_size < 16 << 20
    assert_one_line_error(run_cli("verify", out_copy), "output_files lists", "more than the 65536")


# ------------------------------------------------------------------------ item 21: accepted where it should not


def test_a_utf16_safetensors_header_is_refused(src, tmp_path):
    header = {"model.embed_tokens.weight": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]}}
    write_raw_safetensors(src / "model.safetensors", header, bytes(32), "utf-16-le")  # Python's json would read it
    convert_refused(src, tmp_path, "model.safetensors", "not UTF-8", "UTF-16")


def test_nan_in_the_source_config_is_refused_not_copied(src, tmp_path):
    edit_json(src / "config.json", lambda c: c.update(rms_norm_eps=float("nan")))  # Python's json writes NaN
    assert "NaN" in (src / "config.json").read_text()
    convert_refused(src, tmp_path, "config.json", "rms_norm_eps is NaN or Infinity")


def test_a_tensor_the_index_does_not_list_is_refused(src, tmp_path):
    with safe_open(src / "model.safetensors", "pt") as handle:
        index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in handle.keys()}}
    hidden = "model.norm.weight"
    assert index["weight_map"].pop(hidden)
    (src / INDEX_FILE).write_text(json.dumps(index))
    convert_refused(src, tmp_path, hidden, f"which {INDEX_FILE} does not list")


def test_mixtral_model_type_on_a_qwen2_moe_checkpoint_is_refused(src, tmp_path):
    edit_json(src / "config.json", lambda c: c.update(model_type="mixtral", num_local_experts=c["num_experts"]))
    convert_refused(src, tmp_path, "shared_expert", "a mixtral block has no", "model_type")


def test_a_fifo_in_place_of_tokenizer_json_is_refused(src, tmp_path):
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")
    convert_refused(src, tmp_path, "tokenizer.json", "is a FIFO, not a regular file")


def test_a_source_written_to_while_converting_is_not_published(src, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, **{SLOW_LAYER_ENV: "1"})
    command = [str(REPACK), "convert", str(src), str(out), "--quiet", "--shard-size", "100kB"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.tmp-*/model-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    with (src / "model.safetensors").open("r+b") as handle:  # one byte, rewritten with its own value
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(byte)
    _, stderr = proc.communicate(timeout=180)
    result = subprocess.CompletedProcess(command, proc.returncode, "", stderr)
    error_line(result, "the source changed while converting", "model.safetensors was written to")
    assert not out.exists()


def test_the_valid_dtype_u16_converts_and_verifies(src, tmp_path):
    extra = {"model.u16_buffer": torch.arange(6, dtype=torch.int32).to(torch.uint16).reshape(2, 3)}
    edit_weights(src, lambda tensors: tensors.update(extra))
    out = tmp_path / "out"
    result = run_repack("convert", src, out, "--quiet")
    assert result.returncode == 0, result.stderr
    assert run_cli("verify", out, "--source", src).exit_code == 0


# ------------------------------------------------------------------------------ items 13 and 22: integrity


def test_push_refuses_a_link_out_of_out_that_verify_refuses(out_copy, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (out_copy / "tokenizer.json").unlink()
    (out_copy / "tokenizer.json").symlink_to(secret)
    pushed = error_line(
        run_repack("push", "me/tiny", out_copy, "--dry-run", "--quiet"), "tokenizer.json", "is a link to"
    )
    verified = assert_one_line_error(run_cli("verify", out_copy), "tokenizer.json", "is a link to")
    assert pushed.split(":", 2)[-1] == verified.split(":", 2)[-1]  # one rule for both, word for word
    assert "not for the Hub" not in pushed


def test_push_refuses_a_model_card_that_is_a_link(out_copy, tmp_path):
    target = tmp_path / "elsewhere.md"
    target.write_text("# someone's notes\n")
    (out_copy / "README.md").symlink_to(target)
    assert_one_line_error(run_cli("push", "me/tiny", out_copy, "--dry-run", "--force", "-q"), "README.md", "is a link")
    assert target.read_text() == "# someone's notes\n"


def test_a_manifest_without_its_own_checksum_fails_verify(out_copy):
    edit_json(out_copy / MANIFEST_FILE, lambda m: m.pop(SELF_CHECKSUM))
    error_line(run_repack("verify", out_copy), MANIFEST_FILE, "has no manifest_sha256")


def test_urls_in_architectures_never_reach_the_card(tmp_path, src):
    edit_json(src / "config.json", lambda c: c.update(architectures=["https://evil.example/x", "www.evil.example"]))
    out = tmp_path / "out"
    convert(str(src), out, quiet=True)
    result = run_repack("push", "me/tiny", out, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "evil" not in result.stdout
    assert "| architecture | qwen2\\_moe |" in result.stdout  # the model_type stands in for names left out


def test_escaped_text_leaves_no_autolink():
    from repack.card import escape_text

    text = escape_text("see https://evil.example, www.evil.example or me@evil.example")
    assert "://" not in text and "www." not in text and "@" not in text.replace("\\@", "")
