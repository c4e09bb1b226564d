"""Is an output folder what its manifest says? The torch-free checks ``repack verify`` and ``load(verify=True)`` share.

The manifest (formats/SPEC.md section 5) lists every output file with its sha256 and size; a folder whose files
differ was corrupted or edited after conversion.
"""

from __future__ import annotations

import json
from pathlib import Path

from repack.formats.errors import RepackError
from repack.formats.hashing import hash_file
from repack.formats.paths import contained_child
from repack.formats.stacks import CARD_FILE, MANIFEST_FILE


def read_manifest(out: Path) -> dict:
    """The manifest, checked for the shape verify relies on (an object whose file tables map names to objects)."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        raise RepackError(f"{out}: no {MANIFEST_FILE}; not a complete repack output (re-run repack convert)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise RepackError(f"{path}: not valid JSON; re-run repack convert") from None
    if not isinstance(manifest, dict):
        raise RepackError(f"{path}: not a JSON object; re-run repack convert")
    for table in ("output_files", "source_files"):
        files = manifest.get(table) or {}
        if not isinstance(files, dict) or not all(isinstance(entry, dict) for entry in files.values()):
            raise RepackError(f"{path}: {table} must map file names to {{sha256, size}} objects; re-run repack convert")
    if not isinstance(manifest.get("source") or {}, dict):
        raise RepackError(f"{path}: source must be an object; re-run repack convert")
    return manifest


def check_output_files(out: Path, manifest: dict) -> int:
    """Every output file's sha256 and size against the manifest, and no file it does not list; returns the count."""
    checked = 0
    listed = {name: meta for name, meta in (manifest.get("output_files") or {}).items() if name != CARD_FILE}
    for name, expected in listed.items():
        path = contained_child(out, name, str(out / MANIFEST_FILE))
        if not path.is_file():
            raise RepackError(f"{path}: listed in {MANIFEST_FILE} but missing; re-run repack convert")
        sha, size = hash_file(path)
        if sha != expected.get("sha256") or size != expected.get("size"):
            raise RepackError(f"{path}: sha256 differs from {MANIFEST_FILE} (file changed or corrupt); re-convert")
        checked += 1
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    extra = sorted(present - set(listed) - {MANIFEST_FILE, CARD_FILE})
    if extra:
        raise RepackError(f"{out / extra[0]}: not listed in {MANIFEST_FILE}; remove it or re-convert")
    return checked
