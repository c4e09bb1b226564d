"""Publish a finished output folder as OUT: durable, atomic, never over someone else's output.

Why each step:
- fsync every file and folder before the rename that publishes them, and the parent after it: otherwise a power
  loss can leave a renamed OUT whose files never reached the disk.
- ``renameat2(RENAME_NOREPLACE)``: ``os.rename`` of a folder onto an existing *empty* folder succeeds, so two
  runs without ``--force`` could both "win"; with NOREPLACE the second one fails (EEXIST).
- ``renameat2(RENAME_EXCHANGE)`` for ``--force``: OUT is swapped with the new tree in one step, so a reader never
  finds OUT missing; the old tree then sits at the temp path and is deleted.
- Work folders are locked with ``flock`` while their run is alive: a stale folder is one nobody holds a lock on,
  which unlike a PID cannot be reused by an unrelated process.
- SIGINT/SIGTERM are held back during the swap, so an interrupt lands either before it (nothing published) or after
  it (OUT complete), and the message can say which.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _renameat2_function():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28 or another libc
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


_RENAMEAT2 = _renameat2_function()


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """True when done; False when this system has no renameat2 (or its filesystem refuses the flag)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(code, os.strerror(code), str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; FileExistsError if ``dst`` exists (even as an empty folder)."""
    if _renameat2(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):  # no atomic primitive here: a check, then the rename
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False when the system cannot (the caller falls back)."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file, then every folder (deepest first), of ``folder``."""
    folders = [folder]
    for root, dirs, files in os.walk(folder):
        for name in files:
            fsync_path(Path(root) / name)
        folders.extend(Path(root) / name for name in dirs)
    for path in reversed(folders):
        fsync_path(path)


class WorkFolder:
    """A folder next to OUT that one live run owns: created and ``flock``-ed together, unlocked when closed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        self._fd = os.open(path, os.O_RDONLY)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1


def is_abandoned(path: Path) -> bool:
    """Whether no live process holds ``path``'s lock (its run was killed); False if it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


@contextmanager
def signals_held() -> Iterator[None]:
    """Delay SIGINT/SIGTERM until the block is done, then raise KeyboardInterrupt (main thread; else a no-op).

    Python handlers, not a signal mask: the mask is per thread, and the kernel may deliver a process signal to
    any thread that does not block it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: arrived.append(signum)) for signum in _HELD_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if arrived:
        raise KeyboardInterrupt


def publish(temp: Path, out: Path, *, force: bool) -> Path | None:
    """Make the finished ``temp`` OUT; returns where the replaced old tree now lies (to delete), or None.

    Without ``force`` an OUT that appeared meanwhile (another run) is never replaced: FileExistsError. An empty OUT
    folder (allowed by the checks before the run) is removed first. Run it inside :func:`signals_held`.
    """
    fsync_tree(temp)
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        with suppress(OSError):  # gone or filled meanwhile: the rename below decides
            out.rmdir()
    if not force or not os.path.lexists(out):
        rename_noreplace(temp, out)
        old = None
    elif exchange(temp, out):
        old = temp
    else:  # no atomic swap here: two renames, the old tree parked (and locked) under a hidden name
        old = temp.parent / (temp.name.replace(".tmp-", ".old-", 1))
        parked = os.open(out, os.O_RDONLY)
        try:
            fcntl.flock(parked, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out.rename(old)
            temp.rename(out)
        finally:
            os.close(parked)
    fsync_path(out.parent)
    return old


def remove_tree(path: Path | None) -> None:
    """Delete a replaced or abandoned tree; a link (what ``--force`` over a symlinked OUT swaps out) is unlinked, and
    the folder it points to, which is not ours, is left alone."""
    if path is None:
        return
    if path.is_symlink():
        with suppress(OSError):
            path.unlink()
        return
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_temps(out: Path) -> bool:
    """Clean up after killed runs: delete their ``.OUT.tmp-<pid>`` folders, and put back a previous OUT that a
    ``--force`` run had moved to ``.OUT.old-<pid>`` but died before replacing. A folder is stale when no live run
    holds its lock (:class:`WorkFolder`), whatever its PID says (PIDs are reused). Returns whether a work folder
    was left because a lock still held it."""
    held = False
    for path in out.parent.glob(f".{out.name}.tmp-*"):
        if is_abandoned(path):
            remove_tree(path)
        else:
            held = True
    for path in out.parent.glob(f".{out.name}.old-*"):
        if not is_abandoned(path):
            held = True
        elif os.path.lexists(out):
            remove_tree(path)  # the new OUT was published; this is the leftover
        else:
            path.rename(out)
    return held


class Janitor:
    """A helper process that runs :func:`remove_stale_temps` for OUT once this process is gone, however it ends.

    Why: a run killed after the swap leaves the whole old output (gigabytes) in ``.OUT.tmp-<pid>``, and one killed
    while converting leaves its partial output there, until the next convert into the same OUT. The helper waits
    on a pipe that only this process holds open: a kill closes it as surely as a normal exit does. It starts in a
    session of its own, so the Ctrl-C that stops the converter does not stop it, and it inherits no descriptor (so
    no lock: the work folder's lock still tells it whether a run is alive)."""

    def __init__(self, out: Path) -> None:
        self._process: subprocess.Popen | None = None
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "repack.janitor", os.fsdecode(out)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:  # no interpreter to start: the next convert cleans up, as before
            self._process = None

    def finish(self) -> None:
        """This run is over (its locks released): let the helper clean what is left now, without waiting long."""
        if self._process is None:
            return
        process, self._process = self._process, None
        with suppress(OSError):
            process.stdin.close()
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=JANITOR_WAIT_SECONDS)


JANITOR_WAIT_SECONDS = 2.0  # a normal run leaves it nothing to do; after an interrupt it deletes the old tree alone
