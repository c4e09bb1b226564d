"""Resolve SRC (a local folder or a Hugging Face Hub repo id) to a checkpoint folder on disk.

Hub ids go through ``huggingface_hub.snapshot_download`` with patterns for weights, config and tokenizer
files only, so it also works from the local cache with ``HF_HUB_OFFLINE=1``; the snapshot folder's name
is the resolved commit hash, which the manifest records as the revision.
"""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from repack.formats.config_files import read_config_record
from repack.formats.errors import RepackError
from repack.formats.hub import download_snapshot
from repack.formats.manifest import FileRecord
from repack.formats.paths import check_inside, tree_root
from repack.preflight import local_source
from repack.source_config import read_quantization_config

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class SourceCheckpoint:
    """A GPTQ checkpoint folder on disk plus where it came from."""

    path: Path
    config: dict
    quantization_config: dict | None
    quantization_config_file: str | None  # "config.json" or "quantize_config.json"
    repo_id: str | None = None  # Hub id, or None for a local folder
    revision: str | None = None  # resolved commit hash (Hub only)
    files: list[str] = field(default_factory=list)  # every regular file, relative, sorted
    config_record: FileRecord | None = None  # sha256 and size of the config.json bytes that ``config`` was parsed from

    @property
    def label(self) -> str:
        return self.repo_id or str(self.path)


def list_files(folder: Path) -> list[str]:
    """Every regular file under ``folder``, skipping hidden entries; a link out of the folder is refused, and so is
    anything that is neither a file nor a folder (a FIFO, socket or device in place of tokenizer.json would block
    the copy or be left out without a word).

    A Hub cache snapshot's links into its own blobs are fine (formats.paths.tree_root)."""
    root = tree_root(folder)
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.is_symlink() or any(parent.is_symlink() for parent in relative.parents if parent.parts):
            check_inside(folder, path, root)
        if path.is_file():
            files.append(relative.as_posix())
        elif path.exists() and not path.is_dir():
            raise RepackError(
                f"{path}: is a {_special_kind(path)}, not a regular file; replace it with the file, or remove it"
            )
    return files


def _special_kind(path: Path) -> str:
    mode = path.stat().st_mode
    kinds = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"))
    return next((name for test, name in kinds if test(mode)), "special file")


def resolve_source(src: str, revision: str | None = None) -> SourceCheckpoint:
    """Local folder or Hub repo id -> :class:`SourceCheckpoint` (config read, files listed)."""
    local = local_source(src, revision)
    if local is not None:
        folder, repo_id, commit = local, None, None
    else:
        folder = download_snapshot(src, revision)
        repo_id = src
        commit = folder.name if _COMMIT.match(folder.name) else revision
    config, config_record = read_config_record(folder)
    quant, quant_file = read_quantization_config(folder, config)
    return SourceCheckpoint(
        path=folder,
        config=config,
        quantization_config=quant,
        quantization_config_file=quant_file,
        repo_id=repo_id,
        revision=commit,
        files=list_files(folder),
        config_record=config_record,
    )
