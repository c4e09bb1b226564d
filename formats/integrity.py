"""Is an output folder what its manifest says? The torch-free checks ``repack verify`` and ``load`` share.

The manifest (formats/SPEC.md section 5) lists every output file with its sha256 and size, and every safetensors
file with the sha256 of its header; a folder whose files differ was corrupted or edited after conversion.

Two levels. :func:`check_structure` costs nothing (no data byte is read): the sizes, the small files (config.json,
the index) and every shard's header against the manifest, and one conversion id throughout; ``load`` runs it
always, so a truncated shard, an edited header or config, or a folder that mixes two conversions is refused
without ``verify=True``. :func:`check_output_files` hashes every byte (``repack verify``, ``load(verify=True)``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from repack.formats.constants import CARD_FILE, CONFIG_FILE, CONVERSION_ID_KEY, INDEX_FILE, MANIFEST_FILE
from repack.formats.errors import RepackError
from repack.formats.manifest import FileRecord, Manifest, check_file
from repack.formats.paths import contained_child


class HeadersRead(Protocol):
    """What :func:`check_structure` needs of a reader that parsed the shards' headers (formats.checkpoint's)."""

    files: list[str]
    file_sizes: dict[str, int]
    header_sha256: dict[str, str]
    metadata: dict[str, dict[str, str]]
    index_record: FileRecord | None


def output_bytes(out: Path, manifest: Manifest, skip: Collection[str] = ()) -> int:
    """Bytes of the listed output files present in ``out`` (what :func:`check_output_files` reads; a progress total)."""
    where = str(out / MANIFEST_FILE)
    paths = [contained_child(out, name, where) for name in manifest.checked_output_files if name not in skip]
    return sum(path.stat().st_size for path in paths if path.is_file())


def check_output_files(
    out: Path, manifest: Manifest, on_read: Callable[[int], object] | None = None, skip: Collection[str] = ()
) -> int:
    """Every output file's sha256 and size against the manifest, and no file it does not list; returns the count.

    ``skip``: files the caller hashes itself, as it reads them (counted, not read here). ``on_read(n)`` after each
    chunk hashed (progress)."""
    checked = 0
    listed = manifest.checked_output_files
    for name, record in listed.items():
        if name not in skip:
            check_file(out, name, record, on_read=on_read)  # a link out of the folder is refused before opening
        checked += 1
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() or _is_special(p)}
    extra = sorted(present - set(listed) - {MANIFEST_FILE, CARD_FILE})
    if extra:
        raise RepackError(f"{out / extra[0]}: not listed in {MANIFEST_FILE}; remove it or re-convert")
    return checked


def _is_special(path: Path) -> bool:
    return path.exists() and not path.is_dir()


def check_structure(
    out: Path, manifest: Manifest, config: dict, config_record: FileRecord, reader: HeadersRead
) -> None:
    """config.json (``config``, parsed from bytes whose record is ``config_record``), the index and every shard's size
    and header against the manifest, and the manifest's conversion id in config.json and every shard: no data read.

    Why ids and not inodes: a folder replaced twice while being read can hand out the old inode numbers again. The
    reader reads every shard through the descriptor its header came from, and that header names its conversion."""
    expected = manifest.conversion_id
    found = (config.get("quantization_config") or {}).get(CONVERSION_ID_KEY)
    if found != expected:
        raise RepackError(
            f"{out / CONFIG_FILE}: belongs to conversion {found!r} but {MANIFEST_FILE} to {expected!r}: the folder "
            "mixes two conversions (replaced while loading?); load it again, or re-convert"
        )
    for file in reader.files:  # ids first: a folder replaced meanwhile is named as such
        shard_id = reader.metadata[file].get(CONVERSION_ID_KEY)
        if shard_id != expected:
            raise RepackError(
                f"{out / file}: belongs to conversion {shard_id!r} but {MANIFEST_FILE} to {expected!r}: the folder "
                "mixes two conversions (replaced while loading?); load it again, or re-convert"
            )
    _check_small_file(out, CONFIG_FILE, config_record, manifest)
    if reader.index_record is not None:
        _check_small_file(out, INDEX_FILE, reader.index_record, manifest)
    for file in reader.files:
        path = out / file
        record = manifest.output_files.get(file)
        if record is None:
            raise RepackError(f"{path}: not listed in {MANIFEST_FILE}; remove it or re-convert")
        if reader.file_sizes[file] != record.size:
            raise RepackError(
                f"{path}: {reader.file_sizes[file]} bytes but {MANIFEST_FILE} records {record.size} (the file changed "
                "or is truncated); re-run `repack convert`"
            )
        if record.header_sha256 is not None and reader.header_sha256[file] != record.header_sha256:
            raise RepackError(
                f"{path}: its safetensors header differs from the one {MANIFEST_FILE} records (tensor names, dtypes, "
                "shapes or offsets were edited); re-run `repack convert`"
            )


def _check_small_file(out: Path, name: str, read: FileRecord, manifest: Manifest) -> None:
    """A file read whole (its record computed from the bytes parsed) is the one the manifest records."""
    path = out / name
    record = manifest.output_files.get(name)
    if record is None:
        raise RepackError(f"{path}: not listed in {MANIFEST_FILE}; re-run `repack convert`")
    if (read.sha256, read.size) != (record.sha256, record.size):
        raise RepackError(
            f"{path}: sha256 differs from {MANIFEST_FILE} (the output file changed or is corrupt); re-run "
            "`repack convert`"
        )
