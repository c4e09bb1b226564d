"""repack verify: passes on a fresh conversion, fails with one line on every kind of tampering."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from repack.convert import convert
from repack.formats.hashing import hash_file
from repack.formats.manifest import FileRecord, Manifest
from tests.support.cli import assert_one_line_error, copy_checkpoint, run_cli
from tests.support.fixtures import FIXTURES_DIR

ACT = FIXTURES_DIR / "qwen2moe-g32-actorder"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "out"
    convert(str(ACT), out, shard_size="1MB", quiet=True)
    return out


@pytest.fixture
def out(converted, tmp_path):
    return copy_checkpoint(converted, tmp_path / "out")


def test_verify_ok_with_and_without_source(out):
    result = run_cli("verify", out)
    assert result.exit_code == 0 and "ok:" in result.stdout
    result = run_cli("verify", out, "--source", ACT)
    assert result.exit_code == 0 and "bit-exact" in result.stdout, result.output


def test_changed_output_file_fails_checksum(out):
    (out / "tokenizer.json").write_text("{}")
    assert_one_line_error(run_cli("verify", out), "tokenizer.json", "truncated")
    data = bytearray((out / "generation_config.json").read_bytes())
    data[-2] ^= 1  # same size, other bytes
    (out / "generation_config.json").write_bytes(bytes(data))
    assert_one_line_error(run_cli("verify", out), "generation_config.json", "sha256 differs")


def test_missing_output_file(out):
    shard = sorted(out.glob("model-*.safetensors"))[0]
    shard.unlink()
    assert_one_line_error(run_cli("verify", out), shard.name, "missing")


def test_no_manifest_means_incomplete(out):
    (out / "repack_manifest.json").unlink()
    assert_one_line_error(run_cli("verify", out), "repack_manifest.json")


def _rewrite_stack_tensor(out, name, change):
    """Change one tensor inside its shard and re-sign the manifest, so only the inverse can catch it."""
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard = out / index[name]
    tensors = load_file(shard)
    with safe_open(shard, "pt") as handle:
        metadata = handle.metadata()  # the shard keeps its conversion id
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, shard, metadata=metadata)
    sha, size = hash_file(shard)
    manifest = Manifest.read(out).with_output_file(shard.name, FileRecord(sha, size))
    (out / "repack_manifest.json").write_text(json.dumps(manifest.to_json()))


def test_flipped_bit_in_stack_caught_by_inverse(out):
    def flip(t):
        t.view(-1)[17] ^= 1
        return t

    _rewrite_stack_tensor(out, "model.layers.1.mlp.experts.w13_qweight", flip)
    assert run_cli("verify", out).exit_code == 0  # checksums were re-signed
    assert_one_line_error(run_cli("verify", out, "--source", ACT), "model.layers.1.mlp.experts", "bit for bit")


def test_changed_copied_tensor_caught(out):
    _rewrite_stack_tensor(out, "model.norm.weight", lambda t: t + 1)
    assert_one_line_error(run_cli("verify", out, "--source", ACT), "model.norm.weight", "differs")


def test_changed_scale_sign_caught(out):
    def negate_first(t):
        t.view(-1)[0] = -t.view(-1)[0]
        return t

    _rewrite_stack_tensor(out, "model.layers.0.mlp.experts.w2_scales", negate_first)
    assert_one_line_error(run_cli("verify", out, "--source", ACT), "model.layers.0.mlp.experts")


def test_changed_source_file_fails(out, tmp_path):
    src = copy_checkpoint(ACT, tmp_path / "src")
    (src / "generation_config.json").write_text("{}")
    assert_one_line_error(run_cli("verify", out, "--source", src), "generation_config.json", "source changed")


def test_wrong_source_fails(out, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(FIXTURES_DIR / "qwen2moe-g128-sym", other)
    line = assert_one_line_error(run_cli("verify", out, "--source", other))
    assert str(other) in line


def test_extra_file_in_output_fails(out):
    (out / "stray.bin").write_bytes(b"x")
    assert_one_line_error(run_cli("verify", out), "stray.bin", "not listed")


def test_verify_passes_after_push_wrote_the_model_card(tmp_path):
    """`repack push` writes README.md after the manifest; verify must not call the pushed folder corrupt."""
    from repack.convert import convert
    from repack.push import plan_push
    from repack.verify import verify
    from tests.support.fixtures import FIXTURES_DIR

    src = FIXTURES_DIR / "qwen3moe-g128-sym"
    out = tmp_path / "out"
    convert(str(src), out, quiet=True)
    (out / "README.md").write_text(plan_push(out, "myorg/model").card)
    report = verify(out, str(src))
    assert report.files_checked >= 1 and report.stacks_checked >= 1


def _edit_manifest(out, edit) -> None:
    """Change repack_manifest.json as a person or a bad tool would: without updating its own checksum."""
    path = out / "repack_manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(edit(data)))


def test_a_flipped_hash_in_the_manifest_blames_the_manifest(out):
    def flip(data):
        record = data["output_files"]["tokenizer.json"]
        record["sha256"] = ("0" if record["sha256"][0] != "0" else "1") + record["sha256"][1:]
        return data

    _edit_manifest(out, flip)
    line = assert_one_line_error(run_cli("verify", out), "repack_manifest.json", "edited after conversion")
    assert "tokenizer.json" not in line


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda data: [data], "not a JSON object"),
        (lambda data: dict(data, output_files={"config.json": "abc"}), "is not an object with sha256 and size"),
        (lambda data: dict(data, output_files=["config.json"]), "output_files is not an object"),
        (lambda data: dict(data, output_files={"/etc/passwd": {"sha256": "0" * 64, "size": 1}}), "outside the folder"),
        (lambda data: dict(data, format_version=99), "format_version 99 is not supported"),
        (lambda data: dict(data, source="here"), "source is not an object"),
    ],
)
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_every_manifest_defect_is_one_line_in_every_command(out, edit, message, command):
    _edit_manifest(out, lambda data: edit({k: v for k, v in data.items() if k != "manifest_sha256"}))
    assert_one_line_error(run_cli(command, out), "repack_manifest.json", message)


def test_verify_shows_progress_of_each_pass(out, monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws its live bar as on a terminal
    result = run_cli("verify", out, "--source", ACT)
    assert result.exit_code == 0, result.output
    for task in ("hashing output", "hashing source", "checking tensors"):
        assert task in result.stderr, result.stderr
    quiet = run_cli("verify", out, "--source", ACT, "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr


def test_verify_streams_copied_tensors_and_a_difference_in_a_later_piece_is_caught(out, monkeypatch):
    """Copied tensors (embeddings, lm_head: over a GB each at full size) are compared piece by piece, never
    loaded whole; a change past the first piece is still found."""
    from repack.formats.checkpoint import CheckpointReader

    iter_raw = CheckpointReader.iter_raw
    monkeypatch.setattr(CheckpointReader, "iter_raw", lambda self, name, chunk_bytes=64: iter_raw(self, name, 64))
    loaded_whole = []
    read = CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read", lambda self, name: loaded_whole.append(name) or read(self, name))
    assert run_cli("verify", out, "--source", ACT).exit_code == 0
    copied = [name for name in loaded_whole if ".experts." not in name and "shared_expert" not in name]
    assert copied == [], copied

    def change_last(t):
        t.view(-1)[-1] += 1
        return t

    _rewrite_stack_tensor(out, "model.embed_tokens.weight", change_last)
    assert_one_line_error(run_cli("verify", out, "--source", ACT), "model.embed_tokens.weight", "differs")
