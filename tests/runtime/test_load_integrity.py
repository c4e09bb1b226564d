"""What ``load()`` checks without ``verify=True`` (issue 22, items 12 and 22): sizes, config.json, the index and every
shard's header against the manifest, and one conversion id, all without hashing data; and that a folder replaced
while it loads is never returned as a mix of two conversions, even when inode numbers are reused."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import repack.runtime.loader as loader
from repack.convert import convert
from repack.formats.constants import CONVERSION_ID_KEY, INDEX_FILE, MANIFEST_FILE
from repack.formats.errors import RepackError
from repack.formats.manifest import SELF_CHECKSUM, Manifest
from repack.runtime import load
from tests.support.fixtures import FIXTURES_DIR

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"


def converted(out: Path, force: bool = False) -> Path:
    convert(str(SYM), out, shard_size="100kB", quiet=True, force=force)
    return out


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return converted(tmp_path_factory.mktemp("integrity") / "out")


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*-of-*.safetensors"))


def edit_header(path: Path, edit) -> None:
    """Rewrite a shard's JSON header in place, padded to its old length (the data stays where it was)."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length, "the edit must not lengthen the header"
    data[8 : 8 + length] = encoded + b" " * (length - len(encoded))
    path.write_bytes(bytes(data))


def two_tensors_of_one_size(header: dict) -> tuple[str, str]:
    sizes: dict[int, str] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        size = meta["data_offsets"][1] - meta["data_offsets"][0]
        if size in sizes:
            return sizes[size], name
        sizes[size] = name
    raise LookupError("no two tensors of one size in this shard")


def swap_offsets(header: dict) -> None:
    a, b = two_tensors_of_one_size(header)
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]


def retype_fp16(header: dict) -> None:
    name = next(n for n, meta in header.items() if n != "__metadata__" and meta["dtype"] == "F16")
    header[name]["dtype"] = "BF16"


def reshape_2d(header: dict) -> None:
    name = next(
        n for n, m in header.items() if n != "__metadata__" and len(m["shape"]) == 2 and len(set(m["shape"])) == 2
    )
    header[name]["shape"] = header[name]["shape"][::-1]


def set_id(header: dict) -> None:
    header["__metadata__"][CONVERSION_ID_KEY] = "f" * 32


def edit_json(name: str, edit):
    def apply(folder: Path) -> None:
        path = folder / name
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data, indent=2) + "\n")

    return apply


def header_edit(edit):
    """Apply ``edit`` to the header of the first shard it fits (it raises LookupError where it does not)."""

    def apply(folder: Path) -> None:
        for shard in shards(folder):
            try:
                return edit_header(shard, edit)
            except (LookupError, StopIteration):
                continue
        raise AssertionError("no shard to edit")

    return apply


def first_stack_gptq(config: dict) -> None:
    stack = config["quantization_config"]["stacks"][0]
    stack["word_order"] = "gptq" if stack.get("word_order") != "gptq" else "mma128"


def swap_index_files(index: dict) -> None:
    names = sorted(index["weight_map"])
    first, last = names[0], names[-1]
    index["weight_map"][first], index["weight_map"][last] = index["weight_map"][last], index["weight_map"][first]


def truncate(folder: Path) -> None:
    path = shards(folder)[-1]
    path.write_bytes(path.read_bytes()[:-1])


def append(folder: Path) -> None:
    path = shards(folder)[0]
    path.write_bytes(path.read_bytes() + b"\0" * 8)


def foreign_shard(folder: Path) -> None:
    other = converted(folder.parent / "other")
    shutil.copy(shards(other)[1], shards(folder)[1])  # same layout, another conversion


def drop_manifest_checksum(folder: Path) -> None:
    edit_json(MANIFEST_FILE, lambda data: data.pop(SELF_CHECKSUM))(folder)


CORRUPTIONS = {
    "shard truncated": (truncate, "truncated"),
    "bytes appended": (append, "after the last tensor"),
    "offsets swapped": (header_edit(swap_offsets), "header differs"),
    "dtype changed": (header_edit(retype_fp16), "header differs"),
    "shape transposed": (header_edit(reshape_2d), "header differs"),
    "shard id changed": (header_edit(set_id), "mixes two conversions"),
    "shard of another conversion": (foreign_shard, "mixes two conversions"),
    "config value": (edit_json("config.json", lambda c: c.update(rope_theta=1.0)), "config.json: sha256 differs"),
    "config word order": (edit_json("config.json", first_stack_gptq), "config.json: sha256 differs"),
    "index entries swapped": (edit_json(INDEX_FILE, swap_index_files), "(index|does not hold)"),
    "shard deleted": (lambda folder: shards(folder)[1].unlink(), "missing"),
    "manifest deleted": (lambda folder: (folder / MANIFEST_FILE).unlink(), "not found"),
    "manifest checksum deleted": (drop_manifest_checksum, "has no manifest_sha256"),
    "manifest size edited": (
        edit_json(MANIFEST_FILE, lambda m: m["output_files"]["config.json"].update(size=1)),
        "edited after conversion",
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_plain_load_refuses_what_costs_nothing_to_check(out, tmp_path, corruption):
    folder = shutil.copytree(out, tmp_path / "corrupt")
    corrupt, message = CORRUPTIONS[corruption]
    corrupt(folder)
    with pytest.raises(RepackError, match=message):
        load(folder, "cpu")


def test_a_changed_data_byte_loads_without_verify_and_is_refused_with_it(out, tmp_path):
    folder = shutil.copytree(out, tmp_path / "byte")
    shard = shards(folder)[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert load(folder, "cpu").tensors  # data bytes are hashed only with verify=True (a full read)
    with pytest.raises(RepackError, match="sha256 differs"):
        load(folder, "cpu", verify=True)
    assert load(out, "cpu", verify=True).tensors


def test_verify_hashes_each_shard_as_it_loads_it(out, monkeypatch):
    """verify=True reads the checkpoint once: the shards are not hashed by a pass of their own."""
    import repack.formats.manifest as manifest_module

    hashed = []
    real = manifest_module.hash_file
    monkeypatch.setattr(
        manifest_module, "hash_file", lambda path, *a, **k: hashed.append(path.name) or real(path, *a, **k)
    )
    assert load(out, "cpu", verify=True).tensors
    assert hashed and not [name for name in hashed if name.endswith(".safetensors")], hashed


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for shard in shards(folder) for name, tensor in load_file(shard).items()}


def test_out_replaced_twice_before_the_shards_are_opened_is_refused(tmp_path, monkeypatch):
    """Config of conversion A read, then OUT replaced by B and by C (whose files may get A's freed inode numbers):
    the shards' headers name C, the manifest A."""
    out = converted(tmp_path / "out")
    real = loader.CheckpointReader

    def replaced_twice_then_opened(folder):
        converted(out, force=True)
        converted(out, force=True)
        return real(folder)

    monkeypatch.setattr(loader, "CheckpointReader", replaced_twice_then_opened)
    with pytest.raises(RepackError, match="mixes two conversions"):
        load(out, "cpu")


def test_out_replaced_twice_while_the_shards_are_read_loads_the_first_conversion_whole(tmp_path, monkeypatch):
    """Headers parsed, then OUT replaced twice before a data byte is read: every byte comes from the files whose
    headers were checked (read through their descriptors), so the load is conversion A, whole."""
    out = converted(tmp_path / "out")
    first = file_tensors(out)
    real = loader.load_tensors

    def replaced_twice_then_read(reader, *args, **kwargs):
        converted(out, force=True)
        converted(out, force=True)
        return real(reader, *args, **kwargs)

    monkeypatch.setattr(loader, "load_tensors", replaced_twice_then_read)
    tensors = load(out, "cpu").tensors
    assert tensors.keys() == first.keys()
    for name, expected in first.items():
        assert torch.equal(tensors[name].reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name


def test_out_replaced_between_config_and_manifest_is_refused(tmp_path, monkeypatch):
    out = converted(tmp_path / "out")

    class ReplacedThenRead:
        @staticmethod
        def read(folder):
            converted(out, force=True)
            return Manifest.read(folder)

    monkeypatch.setattr(loader, "Manifest", ReplacedThenRead)
    with pytest.raises(RepackError, match="mixes two conversions"):
        load(out, "cpu")
