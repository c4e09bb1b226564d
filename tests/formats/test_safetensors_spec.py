"""Headers are held to the safetensors spec; zero-element tensors are valid (issue 13, items 4, 10 and 11)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import repack.formats.checkpoint as checkpoint
from repack.formats.checkpoint import CheckpointReader, PlannedTensor, ShardedWriter, parse_safetensors_header
from repack.formats.errors import RepackError, printable


def raw_file(path: Path, header: dict, data: bytes) -> Path:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


def entry(offsets, shape=(2,), dtype="F32") -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_a_valid_file_parses(tmp_path):
    header = parse_safetensors_header(
        raw_file(tmp_path / "a.safetensors", {"a": entry([0, 8]), "b": entry([8, 16])}, bytes(16))
    )
    assert sorted(header.entries) == ["a", "b"]


@pytest.mark.parametrize(
    "header,data,message",
    [
        ({"a": entry([0, 8]), "b": entry([4, 12])}, 12, "overlaps"),
        ({"a": entry([0, 8]), "b": entry([0, 8])}, 8, "overlaps"),
        ({"a": entry([0, 8]), "b": entry([12, 20])}, 20, "hole"),
        ({"a": entry([0, 8])}, 12, "bytes after the last tensor"),
        ({"a": entry([0.0, 8.0])}, 8, "integers"),
        ({"a": entry([0, 8], shape=(-2, -1))}, 8, "non-negative"),
        ({"a": entry([0, 8], shape=(2.0,))}, 8, "non-negative"),
        ({"a": entry([8, 0])}, 8, "ordered"),
        ({"a": {"dtype": "F32"}}, 8, "corrupt"),
        ({"a": [1, 2]}, 8, "corrupt"),
        ({"\ud800": entry([0, 8])}, 8, "UTF-8"),
    ],
)
def test_headers_looser_than_the_spec_are_refused(tmp_path, header, data, message):
    path = raw_file(tmp_path / "bad.safetensors", header, bytes(data))
    with pytest.raises(RepackError, match=message):
        parse_safetensors_header(path)


def test_deeply_nested_header_is_one_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    encoded = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded)
    with pytest.raises(RepackError, match="corrupt safetensors header"):
        parse_safetensors_header(path)


def test_the_header_cap_is_for_the_whole_checkpoint(tmp_path, monkeypatch):
    """Each shard's header is under the cap but all of them together are not: refused."""
    weight_map = {}
    for i in range(4):
        name = f"model-{i + 1:05d}-of-00004.safetensors"
        save_file({f"t{i}": torch.zeros(4)}, tmp_path / name)
        weight_map[f"t{i}"] = name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    one_header = parse_safetensors_header(tmp_path / "model-00001-of-00004.safetensors").header_bytes
    assert len(CheckpointReader(tmp_path).names()) == 4
    monkeypatch.setattr(checkpoint, "_MAX_HEADER_BYTES", 3 * one_header)
    with pytest.raises(RepackError, match="allowed for all headers of a checkpoint"):
        CheckpointReader(tmp_path)


def test_printable_escapes_terminal_codes_and_lone_surrogates():
    assert printable("a\x1b[2Jb\ud800") == "a\\x1b[2Jb\\ud800"
    assert printable("gate_proj é") == "gate_proj é"


def test_zero_element_tensors_are_written_in_plan_order(tmp_path):
    tensors = [
        PlannedTensor("a", "F32", (2,)),
        PlannedTensor("empty", "F32", (0, 4)),
        PlannedTensor("b", "F32", (2,)),
        PlannedTensor("last_empty", "F32", (0,)),
    ]
    writer = ShardedWriter(tmp_path, tensors, 1 << 20)
    writer.add("a", torch.ones(2))
    writer.add("b", torch.ones(2))  # "empty" has no bytes to write
    writer.close()
    reader = CheckpointReader(tmp_path)
    assert reader.read("empty").shape == (0, 4) and reader.read("last_empty").shape == (0,)
    assert torch.equal(reader.read("b"), torch.ones(2))
