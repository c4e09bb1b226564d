"""Is an output folder what its manifest says? The torch-free checks ``repack verify`` and ``load(verify=True)`` share.

The manifest (formats/SPEC.md section 5) lists every output file with its sha256 and size; a folder whose files
differ was corrupted or edited after conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from repack.formats.constants import CARD_FILE, MANIFEST_FILE
from repack.formats.errors import RepackError
from repack.formats.manifest import Manifest, check_file
from repack.formats.paths import contained_child


def output_bytes(out: Path, manifest: Manifest) -> int:
    """Bytes of the listed output files present in ``out`` (what :func:`check_output_files` reads; a progress total)."""
    paths = [contained_child(out, name, str(out / MANIFEST_FILE)) for name in manifest.checked_output_files]
    return sum(path.stat().st_size for path in paths if path.is_file())


def check_output_files(out: Path, manifest: Manifest, on_read: Callable[[int], object] | None = None) -> int:
    """Every output file's sha256 and size against the manifest, and no file it does not list; returns the count.
    ``on_read(n)`` after each chunk hashed (progress)."""
    checked = 0
    listed = manifest.checked_output_files
    for name, record in listed.items():
        contained_child(out, name, str(out / MANIFEST_FILE))  # a link out of the folder is refused before opening
        check_file(out, name, record, on_read=on_read)
        checked += 1
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    extra = sorted(present - set(listed) - {MANIFEST_FILE, CARD_FILE})
    if extra:
        raise RepackError(f"{out / extra[0]}: not listed in {MANIFEST_FILE}; remove it or re-convert")
    return checked
