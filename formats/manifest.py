"""``repack_manifest.json`` as a typed value: read and validated once, then used by every command.

The manifest (formats/SPEC.md section 5) names every file of a conversion with its sha256 and size, the source
it came from and the source files' checksums. It carries its own checksum (``manifest_sha256``, over the rest
of the manifest), so a checksum that no longer matches a file can be blamed on the right side: an edited
manifest is refused as such, and only a manifest that is intact blames the data file.

Torch-free: ``repack push`` and ``repack inspect`` read manifests without paying for torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from .constants import (
    CARD_FILE,
    CONVERSION_ID_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    SUPPORTED_FORMAT_VERSIONS,
)
from .errors import RepackError
from .hashing import hash_file

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
SELF_CHECKSUM = "manifest_sha256"  # the manifest's own checksum, over every other field


@dataclass(frozen=True)
class FileRecord:
    """One file's sha256 (hex) and size in bytes."""

    sha256: str
    size: int

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class SourceRecord:
    """Where a conversion came from: a Hub repo at a commit, or a local folder.

    ``path`` is the local folder as the converter saw it: kept for ``verify``, never published (the card names
    the source by ``repo_id`` or ``base_model`` only). ``base_model`` is the Hub id of the model the source
    quantizes or is, when known (the Hub cache, the source's card, or ``--base-model``). ``quant_format`` is the
    source's quantization format ("gptq", "awq", "compressed-tensors"; absent in manifests written before it)."""

    repo_id: str | None = None
    revision: str | None = None
    path: str | None = None
    base_model: str | None = None
    quant_format: str | None = None

    def to_json(self) -> dict:
        data = {"repo_id": self.repo_id, "revision": self.revision, "path": self.path, "base_model": self.base_model,
                "quant_format": self.quant_format}  # fmt: skip
        return {key: value for key, value in data.items() if value is not None or key == "revision"}


@dataclass(frozen=True)
class Manifest:
    """What one conversion wrote, read with :meth:`read` (which refuses any defect in one line)."""

    format_version: int
    converter_version: str
    source: SourceRecord
    source_files: dict[str, FileRecord]
    output_files: dict[str, FileRecord]
    created: str | None = None
    conversion_id: str | None = None  # shared by config.json and every shard header of the same conversion
    format: str = FORMAT_NAME
    raw: bytes = field(default=b"", repr=False, compare=False)  # the bytes read (commit messages name their hash)

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        """The manifest of the output folder ``folder``, validated; one-line :class:`RepackError` otherwise."""
        folder = Path(folder)
        if not folder.is_dir():
            raise RepackError(f"{folder}: no such folder; pass the output folder of `repack convert`")
        path = folder / MANIFEST_FILE
        if not path.is_file():
            raise RepackError(f"{path} not found: {folder} is not a complete `repack convert` output; convert again")
        return cls.parse(path.read_bytes(), path)

    @classmethod
    def parse(cls, raw: bytes, path: Path | str = MANIFEST_FILE) -> Manifest:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise RepackError(f"{path}: not valid JSON; re-run `repack convert`") from None
        if not isinstance(data, dict):
            raise RepackError(f"{path}: not a JSON object; re-run `repack convert`")
        if data.get("format") != FORMAT_NAME:
            raise RepackError(f"{path}: format {data.get('format')!r} is not {FORMAT_NAME!r}; re-run `repack convert`")
        version = data.get("format_version")
        if version not in SUPPORTED_FORMAT_VERSIONS or isinstance(version, bool):
            raise RepackError(
                f"{path}: format_version {version!r} is not supported by this reader (knows "
                f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}); upgrade moe-repack or re-convert"
            )
        outputs = _file_records(data, "output_files", path)
        if not outputs:
            raise RepackError(f"{path}: output_files is empty; re-run `repack convert`")
        sources = _file_records(data, "source_files", path)
        recorded = data.get(SELF_CHECKSUM)
        if recorded is not None and recorded != _self_checksum(data):
            raise RepackError(
                f"{path}: the manifest was edited after conversion (its {SELF_CHECKSUM} no longer matches its "
                "content); restore it or re-run `repack convert`"
            )
        return cls(
            format_version=version,
            converter_version=str(data.get("converter_version", "unknown")),
            source=_source_record(data.get("source"), path),
            source_files=sources,
            output_files=outputs,
            created=data.get("created") if isinstance(data.get("created"), str) else None,
            conversion_id=_optional_string(data, CONVERSION_ID_KEY, path),
            raw=bytes(raw),
        )

    def to_json(self) -> dict:
        """The manifest as written, its own checksum last."""
        data = {
            "format": self.format,
            "format_version": self.format_version,
            "converter_version": self.converter_version,
            CONVERSION_ID_KEY: self.conversion_id,
            "source": self.source.to_json(),
            "source_files": {name: record.to_json() for name, record in sorted(self.source_files.items())},
            "output_files": {name: record.to_json() for name, record in sorted(self.output_files.items())},
            "created": self.created,
        }
        data[SELF_CHECKSUM] = _self_checksum(data)
        return data

    def with_output_file(self, name: str, record: FileRecord) -> Manifest:
        return replace(self, output_files={**self.output_files, name: record})

    @property
    def checked_output_files(self) -> dict[str, FileRecord]:
        """The output files a check covers: all but README.md, which `repack push` owns and may rewrite."""
        return {name: record for name, record in self.output_files.items() if name != CARD_FILE}

    @property
    def output_bytes(self) -> int:
        return sum(record.size for record in self.output_files.values())

    @property
    def digest(self) -> str:
        """sha256 of the manifest's bytes: names this exact conversion."""
        return hashlib.sha256(self.raw).hexdigest()


def new_manifest(
    source: SourceRecord,
    source_files: dict,
    output_files: dict,
    converter_version: str,
    created: str,
    conversion_id: str | None = None,
) -> Manifest:
    """The manifest a conversion writes (current :data:`FORMAT_VERSION`) from ``{name: {sha256, size}}`` dicts."""
    return Manifest(
        conversion_id=conversion_id,
        format_version=FORMAT_VERSION,
        converter_version=converter_version,
        source=source,
        source_files={name: FileRecord(**entry) for name, entry in source_files.items()},
        output_files={name: FileRecord(**entry) for name, entry in output_files.items()},
        created=created,
    )


def check_file(
    folder: Path,
    name: str,
    record: FileRecord,
    what: str = "output file",
    on_read: Callable[[int], object] | None = None,
) -> None:
    """``folder / name`` has the recorded size and sha256, else one line that blames the file: the manifest's
    own checksum was checked when it was read, so it is the file that changed."""
    path = folder / name
    if not path.is_file():
        raise RepackError(f"{path}: {what} listed in {MANIFEST_FILE} is missing; restore it or re-run `repack convert`")
    size = path.stat().st_size
    if size != record.size:
        raise RepackError(
            f"{path}: {size} bytes but {MANIFEST_FILE} records {record.size} (the {what} changed or is truncated); "
            "re-run `repack convert`"
        )
    if hash_file(path, on_read)[0] != record.sha256:
        raise RepackError(
            f"{path}: sha256 differs from {MANIFEST_FILE} (the {what} changed or is corrupt); re-run `repack convert`"
        )


def _optional_string(data: dict, key: str, path: Path | str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise RepackError(f"{path}: {key} is not a string; re-run `repack convert`")
    return value


def _self_checksum(data: dict) -> str:
    rest = {key: value for key, value in data.items() if key != SELF_CHECKSUM}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _file_records(data: dict, key: str, path: Path | str) -> dict[str, FileRecord]:
    entries = data.get(key, {})
    if not isinstance(entries, dict):
        raise RepackError(f"{path}: {key} is not an object of file name -> sha256 and size; re-run `repack convert`")
    records = {}
    for name, entry in entries.items():
        _check_relative_name(name, key, path)
        if not isinstance(entry, dict):
            raise RepackError(f"{path}: {key} entry {name!r} is not an object with sha256 and size; re-convert")
        sha256, size = entry.get("sha256"), entry.get("size")
        if not isinstance(sha256, str) or not _SHA256.match(sha256):
            raise RepackError(f"{path}: {key} entry {name!r} has no valid sha256 (64 hex digits); re-convert")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RepackError(f"{path}: {key} entry {name!r} has no valid size in bytes; re-convert")
        records[name] = FileRecord(sha256, size)
    return records


def _check_relative_name(name: str, key: str, path: Path | str) -> None:
    """A manifest names files inside its folder only: `..` or an absolute path would check or upload another."""
    parts = PurePosixPath(name).parts
    if not name or name.startswith(("/", "\\")) or ".." in parts or "\\" in name or "\x00" in name:
        raise RepackError(f"{path}: {key} names a file outside the folder ({name!r}); re-run `repack convert`")


def _source_record(source: object, path: Path | str) -> SourceRecord:
    if source is None:
        return SourceRecord()
    if not isinstance(source, dict):
        raise RepackError(f"{path}: source is not an object; re-run `repack convert`")
    values = {}
    for key in ("repo_id", "revision", "path", "base_model", "quant_format"):
        value = source.get(key)
        if value is not None and not isinstance(value, str):
            raise RepackError(f"{path}: source.{key} is not a string; re-run `repack convert`")
        values[key] = value
    return SourceRecord(**values)
