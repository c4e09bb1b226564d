"""Edit an output folder as someone who also updates its manifest would: for tests of what comes after the integrity
checks (a config the loader must refuse on its own merits, not because its checksum changed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from repack.formats.constants import MANIFEST_FILE
from repack.formats.manifest import SELF_CHECKSUM, self_checksum


def restamp(folder: Path, *names: str) -> None:
    """Record the current sha256 and size of the files ``names`` in ``folder``'s manifest, and its own checksum."""
    path = folder / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    for name in names:
        data = (folder / name).read_bytes()
        manifest["output_files"][name].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    manifest.pop(SELF_CHECKSUM, None)
    manifest[SELF_CHECKSUM] = self_checksum(manifest)
    path.write_text(json.dumps(manifest, indent=2) + "\n")
