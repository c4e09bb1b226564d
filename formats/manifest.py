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
from .json_files import MANIFEST_MAX_BYTES, parse_json, read_bounded
from .paths import contained_child

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
SELF_CHECKSUM = "manifest_sha256"  # the manifest's own checksum, over every other field
HEADER_CHECKSUM = "header_sha256"  # of a safetensors file's 8-byte length and JSON header (SafetensorsHeader.sha256)
# Files a manifest may list per section: a conversion lists its shards and a dozen other files (DeepSeek-V3: 163
# shards). A hostile manifest of a million entries would cost minutes and a GB before any file is looked at.
MAX_FILES = 65_536


@dataclass(frozen=True)
class FileRecord:
    """One file's sha256 (hex) and size in bytes; for a safetensors output file also its header's sha256, which lets a
    loader check every tensor's name, dtype, shape and place without hashing the data (formats/SPEC.md section 5)."""

    sha256: str
    size: int
    header_sha256: str | None = None

    def to_json(self) -> dict:
        data = {"sha256": self.sha256, "size": self.size}
        if self.header_sha256 is not None:
            data[HEADER_CHECKSUM] = self.header_sha256
        return data


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
        return cls.parse(read_bounded(path, MANIFEST_MAX_BYTES, MANIFEST_FILE), path)

    @classmethod
    def parse(cls, raw: bytes, path: Path | str = MANIFEST_FILE) -> Manifest:
        data = parse_json(raw, path, "re-run `repack convert`")
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
        manifest = cls(
            format_version=version,
            converter_version=str(data.get("converter_version", "unknown")),
            source=_source_record(data.get("source"), path),
            source_files=sources,
            output_files=outputs,
            created=data.get("created") if isinstance(data.get("created"), str) else None,
            conversion_id=_optional_string(data, CONVERSION_ID_KEY, path),
            raw=bytes(raw),
        )
        # Last, so a misshapen field is named as such. Required: every manifest repack writes carries it, and one
        # without is one whose edits nothing would show.
        recorded = data.get(SELF_CHECKSUM)
        if recorded is None:
            raise RepackError(
                f"{path}: has no {SELF_CHECKSUM} (the manifest's own checksum, which every `repack convert` writes): "
                "it was edited or not written by repack; re-run `repack convert`"
            )
        if recorded != self_checksum(data):
            raise RepackError(
                f"{path}: the manifest was edited after conversion (its {SELF_CHECKSUM} no longer matches its "
                "content); restore it or re-run `repack convert`"
            )
        return manifest

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
        data[SELF_CHECKSUM] = self_checksum(data)
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
    own checksum was checked when it was read, so it is the file that changed.

    A name that is, or passes through, a link out of ``folder`` is refused before anything opens it: ``verify``,
    ``load`` and ``push`` share this one rule, so nothing outside the folder is ever read or uploaded."""
    path = contained_child(folder, name, str(folder / MANIFEST_FILE))
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


def self_checksum(data: dict) -> str:
    """The ``manifest_sha256`` of a manifest's fields: sha256 of the others as compact JSON with sorted keys."""
    rest = {key: value for key, value in data.items() if key != SELF_CHECKSUM}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _file_records(data: dict, key: str, path: Path | str) -> dict[str, FileRecord]:
    entries = data.get(key, {})
    if not isinstance(entries, dict):
        raise RepackError(f"{path}: {key} is not an object of file name -> sha256 and size; re-run `repack convert`")
    if len(entries) > MAX_FILES:
        raise RepackError(
            f"{path}: {key} lists {len(entries)} files, more than the {MAX_FILES} a conversion writes; the manifest is "
            "corrupt, re-run `repack convert`"
        )
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
        header = entry.get(HEADER_CHECKSUM)
        if header is not None and (not isinstance(header, str) or not _SHA256.match(header)):
            raise RepackError(f"{path}: {key} entry {name!r} has an invalid {HEADER_CHECKSUM}; re-convert")
        records[name] = FileRecord(sha256, size, header)
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
