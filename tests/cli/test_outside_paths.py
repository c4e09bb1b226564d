"""Nothing outside the folder is read, copied or hashed: links out of a source, index and manifest entries that
leave their folder (issue 13, items 1 and 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repack.formats.stacks import MANIFEST_FILE
from repack.synthetic import write_synthetic_checkpoint
from tests.support.cli import assert_one_line_error, copy_checkpoint, run_cli
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"
SECRET = "top-secret-do-not-copy"


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "elsewhere" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET * 100)
    return path


def test_symlink_out_of_the_source_is_refused_and_never_copied(tmp_path, secret):
    src = copy_checkpoint(SYM, tmp_path / "src")
    (src / "notes.txt").symlink_to(secret)
    out = tmp_path / "out"
    line = assert_one_line_error(run_cli("convert", src, out, "--quiet"), "notes.txt", "is a link to", "outside")
    assert SECRET not in line and not out.exists()


def test_symlinked_folder_out_of_the_source_is_refused(tmp_path, secret):
    src = copy_checkpoint(SYM, tmp_path / "src")
    (src / "extra").symlink_to(secret.parent, target_is_directory=True)
    (src / "docs").mkdir()
    (src / "docs" / "more").symlink_to(secret.parent, target_is_directory=True)
    result = run_cli("convert", src, tmp_path / "out", "--quiet")
    if result.exit_code == 0:  # folders behind links are not walked; then nothing of them may be copied
        assert not list((tmp_path / "out").rglob("secret.txt"))
    else:
        assert_one_line_error(result, "outside")


def test_symlink_inside_the_source_is_fine(tmp_path):
    src = copy_checkpoint(SYM, tmp_path / "src")
    (src / "README.txt").rename(src / "readme-original.txt")
    (src / "README.txt").symlink_to("readme-original.txt")
    result = run_cli("convert", src, tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output


@pytest.fixture
def sharded(tmp_path) -> Path:
    from repack.formats.gptq import GptqScheme

    return write_synthetic_checkpoint(
        tmp_path / "sharded", family="qwen3_moe", scheme=GptqScheme(4, 32, True, "gptq"), shard_size=100_000
    )


@pytest.mark.parametrize("outside", ["../elsewhere/secret.txt", "ABSOLUTE"])
def test_index_entry_leaving_the_folder_is_refused_before_it_is_opened(sharded, tmp_path, secret, outside):
    name = str(secret) if outside == "ABSOLUTE" else outside
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = name
    index_path.write_text(json.dumps(index))
    line = assert_one_line_error(run_cli("convert", sharded, tmp_path / "out", "--quiet"), "lies outside", "index")
    assert SECRET not in line and "bytes" not in line


@pytest.fixture
def converted(tmp_path) -> Path:
    out = tmp_path / "out"
    assert run_cli("convert", SYM, out, "--quiet").exit_code == 0
    return out


@pytest.mark.parametrize("section", ["output_files", "source_files"])
@pytest.mark.parametrize("outside", ["../elsewhere/secret.txt", "ABSOLUTE"])
def test_verify_never_hashes_files_outside_the_folder(converted, secret, section, outside, monkeypatch):
    import repack.formats.manifest
    import repack.verify

    hashed: list[Path] = []
    real_hash = repack.verify.hash_file
    for module in (repack.verify, repack.formats.manifest):  # every place that hashes a named file
        monkeypatch.setattr(module, "hash_file", lambda path, *rest: hashed.append(Path(path)) or real_hash(path))
    name = str(secret) if outside == "ABSOLUTE" else outside
    manifest_path = converted / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest[section] = {name: {"sha256": "0" * 64, "size": 1}, **manifest[section]}
    manifest_path.write_text(json.dumps(manifest))
    args = ["verify", converted] + (["--source", SYM] if section == "source_files" else [])
    assert_one_line_error(run_cli(*args), "outside the folder")  # refused when the manifest is read
    assert secret not in hashed and secret.resolve() not in [p.resolve() for p in hashed]
