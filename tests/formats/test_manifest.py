"""formats.manifest: one typed reader that refuses every defect in one line and knows which side changed."""

from __future__ import annotations

import json

import pytest

from repack.formats.constants import SUPPORTED_FORMAT_VERSIONS
from repack.formats.errors import RepackError
from repack.formats.gptq import GptqFormatError
from repack.formats.manifest import FileRecord, Manifest, SourceRecord, new_manifest
from repack.formats.stacks import StackInfo, StackInfoError

RECORD = {"sha256": "a" * 64, "size": 3}


def written() -> Manifest:
    return new_manifest(
        SourceRecord(repo_id="org/model", revision="f" * 40, base_model="org/model"),
        {"model.safetensors": RECORD},
        {"config.json": RECORD, "model.safetensors": RECORD},
        converter_version="0.1.0",
        created="2026-01-01T00:00:00+00:00",
    )


def test_written_manifest_reads_back_typed_and_signed():
    raw = json.dumps(written().to_json()).encode()
    manifest = Manifest.parse(raw)
    assert manifest.output_files["config.json"] == FileRecord("a" * 64, 3)
    assert manifest.source.base_model == "org/model" and manifest.output_bytes == 6
    assert manifest.format_version in SUPPORTED_FORMAT_VERSIONS
    assert "manifest_sha256" in json.loads(raw)


def test_an_edited_signed_manifest_is_refused_as_edited():
    data = written().to_json()
    data["output_files"]["config.json"]["size"] = 4
    with pytest.raises(RepackError, match="edited after conversion"):
        Manifest.parse(json.dumps(data).encode())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"format": "gguf"}', "is not 'repack-moe'"),
        (b'{"format": "repack-moe", "format_version": 99}', "format_version 99 is not supported"),
        (b'{"format": "repack-moe", "format_version": true}', "format_version True is not supported"),
        (b'{"format": "repack-moe", "format_version": 2, "output_files": {}}', "output_files is empty"),
        (b'{"format": "repack-moe", "format_version": 2, "output_files": {"a": 1}}', "not an object"),
        (b'{"format": "repack-moe", "format_version": 2, "output_files": {"a": {"sha256": "x", "size": 1}}}', "sha256"),
        (b'{"format": "repack-moe", "format_version": 2, "output_files": {"../a": {}}}', "outside the folder"),
    ],
)
def test_every_defect_is_one_line(data: bytes, message: str):
    with pytest.raises(RepackError, match=message) as error:
        Manifest.parse(data, "OUT/repack_manifest.json")
    assert "\n" not in str(error.value) and str(error.value).startswith("OUT/repack_manifest.json")


def test_format_errors_share_one_base_that_library_callers_catch_as_value_error():
    assert issubclass(GptqFormatError, RepackError) and issubclass(StackInfoError, RepackError)
    assert not issubclass(StackInfoError, TypeError)
    with pytest.raises(StackInfoError, match="unexpected keyword argument 'colour'"):
        StackInfo.from_json({"prefix": "p", "colour": "red"})
    with pytest.raises(ValueError, match="is not an object"):
        StackInfo.from_json(["p"])
