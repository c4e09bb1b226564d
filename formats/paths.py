"""Paths that files name (an index's shards, a manifest's entries, a source folder's files) stay inside their folder.

Why: such names come from files a stranger can write. ``../../etc/passwd``, ``/etc/passwd`` or a symlink out of
the folder must be refused *before* anything opens them, or a convert copies (and a push uploads) someone's
file, and an error line prints its first bytes. A Hugging Face cache snapshot is the one place whose files are
links out of their folder by design: into the same repo's ``blobs/``, so its root is the repo's cache folder.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from repack.formats.errors import RepackError


def tree_root(folder: Path) -> Path:
    """The folder links may resolve into: ``folder`` itself, or for a Hub cache snapshot the repo's cache folder."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith(("models--", "datasets--")):
        return resolved.parent.parent
    return resolved


def child_path(folder: Path, name: object, where: str) -> Path:
    """``folder / name`` for a relative name that stays inside ``folder``; checked on the name alone (nothing opened).

    ``where`` says which file named it (for the message)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise RepackError(f"{where}: names the file {name!r}, which is not a plain relative path; fix or re-create it")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts:
        raise RepackError(
            f"{where}: names the file {name!r}, which lies outside {folder}; refusing to read it (fix or re-create "
            f"{Path(where).name})"
        )
    return folder / name


def check_inside(folder: Path, path: Path, root: Path | None = None) -> Path:
    """``path`` after following links, refused when it leaves ``root`` (default: :func:`tree_root` of ``folder``)."""
    root = tree_root(folder) if root is None else root
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise RepackError(
            f"{path}: is a link to {resolved}, outside {folder}; refusing to read it (copy the file into the folder "
            "or remove the link)"
        )
    return resolved


def contained_child(folder: Path, name: object, where: str) -> Path:
    """:func:`child_path`, then :func:`check_inside` for links: a name from a file, safe to open."""
    path = child_path(folder, name, where)
    check_inside(folder, path)
    return path
