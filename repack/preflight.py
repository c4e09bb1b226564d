"""What a command can check before it starts its work: arguments, folders, where the output may go.

Why a module of its own, free of torch: a mistyped path, an existing output folder or a config that rules the
folder out (repack.source_config for a source; a folder not converted, or of a newer format version) must answer
at once (not after seconds of importing torch and planning a conversion), and an output that can never be
published (a mount point, a link, an unwritable parent) must be refused before the work, not after it. The CLI
runs these checks before it imports anything heavy; :func:`repack.convert.convert` runs the output checks again
right before it creates its work folder (the folder may have changed meanwhile).
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from repack.formats.config_files import check_repack_config
from repack.formats.errors import RepackError, printable
from repack.formats.hub import looks_like_repo_id
from repack.formats.manifest import Manifest
from repack.source_config import check_source_config

CONFIG_FILE = "config.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '500MiB' -> 500 * 2**20, '1000' -> 1000."""
    match = _SIZE.match(text)
    if not match:
        raise RepackError(f"--shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    unit = (match[2] or "").lower().rstrip("b")
    binary = unit.endswith("i")
    unit = unit.rstrip("i")
    scale = 1024 ** " kmgt".index(unit or " ") if binary else _UNITS[unit]
    size = int(float(match[1]) * scale)
    if size <= 0:
        raise RepackError(f"--shard-size {text!r}: must be more than 0 bytes")
    return size


def shown(path: Path | str) -> str:
    """A path as an error line prints it: control characters and undecodable bytes escaped."""
    return printable(str(path))


def check_converted_folder(out: Path, needs: str) -> None:
    """``out`` is an existing folder holding ``needs`` (config.json, the manifest): the argument of inspect, verify,
    push and tune, which all say the same when it is not."""
    if not out.exists():
        raise RepackError(f"{shown(out)}: no such folder; pass the output folder of `repack convert`")
    if not out.is_dir():
        raise RepackError(f"{shown(out)}: is a file, not a folder; pass the output folder of `repack convert`")
    if not (out / needs).is_file():
        raise RepackError(f"{shown(out)}: has no {needs}; pass the output folder of `repack convert`")


def check_converted_config(out: Path, *, manifest: bool) -> None:
    """What a converted folder's manifest (when the command reads one) and config.json say, refused before torch is
    imported and in the order the command itself reads them: a folder not converted yet, a newer format version, a
    manifest that is malformed, unbounded or edited."""
    if manifest:
        Manifest.read(out)
    check_repack_config(out)


def check_demo_folder(out_dir: Path, force: bool) -> None:
    """``repack demo``'s folder: new, empty, or (with --force) holding an earlier demo's files."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RepackError(f"{shown(out_dir)}: exists and is not a folder; pass a new folder for the demo")
    if out_dir.is_dir() and not force and any(out_dir.iterdir()):
        raise RepackError(f"{shown(out_dir)}: folder is not empty; pass --force to replace the demo files in it")


def local_source(src: str, revision: str | None) -> Path | None:
    """The source folder when SRC names one (checked: a folder with config.json), None for a Hub repo id."""
    local = Path(src).expanduser()
    if local.exists():
        if not local.is_dir():
            raise RepackError(f"{shown(src)}: is a file; pass the checkpoint folder that holds config.json")
        if revision:
            raise RepackError(f"{shown(src)}: --revision only applies to Hub repo ids, not local folders")
        if not (local / CONFIG_FILE).is_file():
            raise RepackError(f"{shown(src)}: no {CONFIG_FILE}; is this a Hugging Face model folder?")
        return local
    if os.path.islink(local):
        raise RepackError(f"{shown(src)}: is a link to {shown(os.readlink(local))}, which does not exist; fix the link")
    if not looks_like_repo_id(src):
        raise RepackError(f"{shown(src)}: no such folder, and not a Hub repo id (org/name); check the path")
    return None


def check_readable(folder: Path, names: list[str]) -> None:
    """Every file ``names`` (relative to ``folder``) that the conversion will read can be read: an unreadable one is
    named before the work, not after the weights are written."""
    for name in names:
        if not os.access(folder / name, os.R_OK):
            raise RepackError(
                f"cannot read {shown(folder / name)}: {os.strerror(errno.EACCES)}; make the source readable (or "
                "--exclude the file)"
            )


def _first_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def missing_parents(out: Path) -> list[Path]:
    """The folders above ``out`` that do not exist yet (deepest first): what creating OUT creates, and what a run
    that fails must remove again."""
    missing = []
    parent = out.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return missing


def remove_created(folders: list[Path]) -> None:
    """Remove the folders a failed run created for OUT (deepest first), each only while it is still empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _unwritable_reason(folder: Path) -> str | None:
    """Why files cannot be created in ``folder``, or None when they can."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return os.strerror(errno.EROFS).lower()
    except OSError as error:
        return (error.strerror or str(error)).lower()
    if not os.access(folder, os.W_OK | os.X_OK):
        return os.strerror(errno.EACCES).lower()
    return None


def check_output_target(out: Path, force: bool, source: Path | None = None) -> None:
    """OUT may be created, or (with --force) replaced, by renaming a finished folder next to it into place.

    Refused before any work: OUT is, holds or lies inside the source; OUT is a file, a link or a mount point (a
    rename can replace none of them with a folder, so the run would end in an error after all its work); OUT is a
    non-empty folder without --force; OUT's folder cannot be written."""
    if source is not None:
        src, dst = source.resolve(), out.resolve()
        if dst == src or dst in src.parents or src in dst.parents:
            raise RepackError(
                f"{shown(out)}: the output folder must not be, contain or lie inside the source {shown(source)}; "
                "choose a separate output folder"
            )
    if os.path.islink(out):
        target = shown(os.readlink(out))
        what = "an existing folder" if out.is_dir() else "nothing" if not out.exists() else "a file"
        raise RepackError(
            f"{shown(out)}: is a link (to {target}, {what}); the output is renamed into place and would replace the "
            "link, not fill its target: pass the target folder itself, or remove the link"
        )
    if out.exists() and not out.is_dir():
        raise RepackError(f"{shown(out)}: exists and is a file; choose another output folder")
    if out.is_dir() and os.path.ismount(out):
        raise RepackError(
            f"{shown(out)}: is a mount point; the output is renamed into place, which cannot replace a mount point: "
            f"write into a folder inside it ({shown(out / 'NAME')})"
        )
    if out.is_dir() and not force and any(out.iterdir()):
        raise RepackError(f"{shown(out)}: output folder exists and is not empty; pass --force to replace it")
    parent = _first_existing(out.parent)
    if not parent.is_dir():
        raise RepackError(
            f"{shown(out)}: cannot create it, {shown(parent)} is not a folder; choose another output path"
        )
    reason = _unwritable_reason(parent)
    if reason is not None:
        raise RepackError(
            f"{shown(out)}: cannot be written, {shown(parent)} is not writable ({reason}); choose a writable location"
        )


def check_convert_arguments(
    src: str, out: Path, *, revision: str | None, force: bool, dry_run: bool, shard_size: str
) -> None:
    """Everything ``repack convert`` can refuse without reading a tensor: the source argument, the shard size, what
    a local source's config says (repack.source_config) and, unless it is a dry run, the output folder. In the
    conversion's own order: the source's verdicts before the output's."""
    source = local_source(src, revision)
    parse_size(shard_size)
    if source is not None:
        check_source_config(source)
    if not dry_run:
        check_output_target(Path(out).expanduser().absolute(), force, source)
