"""sha256 of whole files, as the manifest records them (torch-free: `repack push` checks files with it)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

HASH_CHUNK = 16 << 20  # bytes per read: large sequential reads


def hash_file(path: Path, on_read: Callable[[int], object] | None = None) -> tuple[str, int]:
    """sha256 hex and size of a file, read in large sequential chunks; ``on_read(n)`` after each chunk (progress)."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
            if on_read is not None:
                on_read(len(chunk))
    return digest.hexdigest(), size
