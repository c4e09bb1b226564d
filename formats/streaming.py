"""Read a checkpoint's weight files once, front to back, hash them, and serve the reader's reads from what was read.

Why: a converter must hash every source byte (the manifest records each file's sha256) and read every byte it
converts. Read twice through the page cache (a hashing pass, then the converter's ``pread`` of the same pages),
each byte costs two kernel copies and the cache's own bookkeeping: about 0.8 CPU-s per GB on this project's build
machines, a third of a conversion. Here each file is read once with ``O_DIRECT`` (no page cache: the disk writes
into our buffers) in ``BLOCK_BYTES`` blocks by an I/O thread, a second thread hashes the blocks in order, and the
reader copies tensors out of the blocks still held (:meth:`ReadOnceStream.read_into`).

Memory is a fixed ring of ``capacity`` bytes. The consumer says which bytes it will never ask for again
(:meth:`~ReadOnceStream.release_before`); the I/O thread never reads more than ``capacity`` past the oldest byte
not yet released, so a read that lies behind the ring (released) or beyond it (too far ahead) is answered with
``False`` and the caller reads those bytes itself (``pread``): slower, never wrong, never a wait that cannot end.

Torch-free: only ``os``, ``mmap``, ``hashlib``, ``numpy`` (its copies run without the GIL).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import RepackError

BLOCK_BYTES = 16 << 20  # one O_DIRECT read; a multiple of every block size O_DIRECT asks for
_ALIGN = 4096


@dataclass(frozen=True)
class StreamedFile:
    """One file of the stream: its name (for results and messages), the descriptor it is read through, its size."""

    name: str
    fd: int
    size: int
    path: str = ""  # for messages (default: the name)


@dataclass(frozen=True)
class _Block:
    file: int  # index into the stream's files
    offset: int  # in the file; a multiple of BLOCK_BYTES
    length: int


class ReadOnceStream:
    """The files, in order, read once into a ring of ``capacity`` bytes and hashed; see the module docstring."""

    def __init__(
        self,
        files: list[StreamedFile],
        capacity: int,
        *,
        block_bytes: int = BLOCK_BYTES,
        on_hashed: Callable[[int], object] | None = None,
    ) -> None:
        self.files = files
        self._on_hashed = on_hashed  # called from the hashing thread with each block's length (progress)
        self._index = {file.name: i for i, file in enumerate(files)}
        self._block_bytes = block_bytes
        self._blocks: list[_Block] = []
        self._first_block: list[int] = []  # file index -> index of its first block
        for i, file in enumerate(files):
            self._first_block.append(len(self._blocks))
            self._blocks += [_Block(i, o, min(block_bytes, file.size - o)) for o in range(0, file.size, block_bytes)]
        self._first_block.append(len(self._blocks))
        self._slots = max(2, min(len(self._blocks), -(-capacity // block_bytes)))
        self._buffers = [mmap.mmap(-1, block_bytes) for _ in range(self._slots)]
        self._arrays = [np.frombuffer(buffer, dtype=np.uint8) for buffer in self._buffers]
        self._slot_of: dict[int, int] = {}  # block -> slot, while the block is held
        self._free = list(range(self._slots))
        self._read = 0  # blocks read (in order)
        self._hashed = 0  # blocks hashed (in order)
        self._low = 0  # blocks before this one are released by the consumer
        self._error: BaseException | None = None
        self._stopping = False
        self.results: dict[str, dict] = {}
        self._direct = [_direct_fd(file.fd) for file in files]
        self._cond = threading.Condition()
        self._io = threading.Thread(target=self._run_io, name="source-io", daemon=True)
        self._hasher = threading.Thread(target=self._run_hash, name="source-hash", daemon=True)
        self._io.start()
        self._hasher.start()

    # ----------------------------------------------------------------------------------------------- threads

    def _run_io(self) -> None:
        try:
            for number, block in enumerate(self._blocks):
                with self._cond:
                    while not self._free and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    slot = self._free.pop()
                self._fill(block, self._buffers[slot])
                with self._cond:
                    self._slot_of[number] = slot
                    self._read = number + 1
                    self._cond.notify_all()
        except BaseException as error:  # re-raised on the consumer's thread
            self._fail(error)

    def _fill(self, block: _Block, buffer: mmap.mmap) -> None:
        """Read one block into ``buffer``: O_DIRECT where the file allows it, else through the page cache."""
        file = self.files[block.file]
        view = memoryview(buffer)
        try:
            self._fill_view(block, file, view)
        except OSError as error:  # a read error is the source's, never the output's (the writer names its own)
            raise RepackError(
                f"{file.path or file.name}: cannot read it ({error.strerror or error}); check the source disk or "
                "re-download the file"
            ) from None
        finally:
            view.release()

    def _fill_view(self, block: _Block, file: StreamedFile, view: memoryview) -> None:
        done = 0
        direct = self._direct[block.file]
        while done < block.length:
            if direct is not None:
                want = -(-(block.length - done) // _ALIGN) * _ALIGN  # O_DIRECT lengths are whole sectors
                try:
                    count = os.preadv(direct, [view[done : done + want]], block.offset + done)
                except OSError as error:
                    if error.errno != errno.EINVAL:
                        raise
                    direct = self._direct[block.file] = None  # this file refuses it after all
                    continue
            else:
                count = os.preadv(file.fd, [view[done : block.length]], block.offset + done)
            if count <= 0:
                raise RepackError(
                    f"{file.path or file.name}: truncated while reading (at byte {block.offset + done} of "
                    f"{file.size}); re-download it"
                )
            done += count

    def _run_hash(self) -> None:
        try:
            digest = None
            for number, block in enumerate(self._blocks):
                with self._cond:
                    while self._read <= number and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    slot = self._slot_of[number]
                if block.offset == 0:
                    digest = hashlib.sha256()
                view = memoryview(self._buffers[slot])
                digest.update(view[: block.length])
                view.release()
                file = self.files[block.file]
                if block.offset + block.length == file.size:
                    self.results[file.name] = {"sha256": digest.hexdigest(), "size": file.size}
                with self._cond:
                    self._hashed = number + 1
                    self._recycle()
                    self._cond.notify_all()
                if self._on_hashed is not None:
                    self._on_hashed(block.length)
            for file in self.files:  # empty files have no block
                self.results.setdefault(file.name, {"sha256": hashlib.sha256().hexdigest(), "size": 0})
        except BaseException as error:
            self._fail(error)

    def _recycle(self) -> None:
        """Free the slots of blocks both hashed and released (call with the lock held)."""
        for number in [n for n in self._slot_of if n < self._hashed and n < self._low]:
            self._free.append(self._slot_of.pop(number))

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._stopping = True
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------------------- consumer

    def read_into(self, name: str, offset: int, target: memoryview) -> bool:
        """Copy bytes ``offset ..`` of file ``name`` into ``target``, waiting for the I/O thread if need be; False at
        once when they lie behind the ring (released) or beyond it (the caller reads them itself)."""
        pieces = self._held(name, offset, len(target))
        if pieces is None:
            return False
        out = np.frombuffer(target, dtype=np.uint8)
        for done, array in pieces:
            np.copyto(out[done : done + len(array)], array)
        return True

    @property
    def block_bytes(self) -> int:
        """The stream reads and holds its files in blocks of this many bytes (the last of each file shorter)."""
        return self._block_bytes

    def view(self, name: str, offset: int, count: int) -> np.ndarray | None:
        """Bytes ``offset .. offset + count`` of file ``name`` as a view of the ring (no copy) when one block holds
        them all, waiting for the I/O thread if need be; None otherwise (the caller copies them out). The view is
        valid until the consumer releases those bytes (:meth:`release_before`)."""
        pieces = self._held(name, offset, count)
        return pieces[0][1] if pieces is not None and len(pieces) == 1 else None

    def compare(self, name: str, offset: int, data: memoryview) -> bool | None:
        """Whether ``data`` equals bytes ``offset ..`` of file ``name``, compared in the ring (no copy); None when
        the ring does not hold them (as for :meth:`read_into`)."""
        pieces = self._held(name, offset, len(data))
        if pieces is None:
            return None
        mine = np.frombuffer(data, dtype=np.uint8)
        return all(same_memory(mine[done : done + len(array)], array) for done, array in pieces)

    def _held(self, name: str, offset: int, count: int) -> list[tuple[int, np.ndarray]] | None:
        """Views of the ring holding bytes ``offset .. offset + count`` of file ``name`` (position in the range,
        bytes), once read; None when they lie behind or beyond the ring. The views are valid until released."""
        if not count:
            return []
        index = self._index.get(name)
        if index is None:
            return None
        first = self._first_block[index] + offset // self._block_bytes
        last = self._first_block[index] + (offset + count - 1) // self._block_bytes
        with self._cond:
            if first < self._low or last >= self._low + self._slots:
                return None
            while self._read <= last and self._error is None:
                self._cond.wait()
            self._raise_error()
            slots = [self._slot_of[number] for number in range(first, last + 1)]
        pieces, done = [], 0
        for number, slot in zip(range(first, last + 1), slots, strict=True):
            block = self._blocks[number]
            start = max(offset + done - block.offset, 0)
            length = min(block.length - start, count - done)
            pieces.append((done, self._arrays[slot][start : start + length]))
            done += length
        return pieces

    def release_before(self, name: str, offset: int) -> None:
        """The consumer will never read bytes of the files before ``name``, nor of ``name`` before ``offset``."""
        index = self._index.get(name)
        if index is None:
            return
        number = min(self._first_block[index] + offset // self._block_bytes, self._first_block[index + 1])
        self._release_blocks(number)

    def _release_blocks(self, number: int) -> None:
        with self._cond:
            if number > self._low:
                self._low = number
                self._recycle()
                self._cond.notify_all()

    def finish(self) -> dict[str, dict]:
        """Release the rest, wait until every byte is read and hashed; ``{name: {sha256, size}}`` of every file."""
        self._release_blocks(len(self._blocks))
        self._io.join()
        self._hasher.join()
        with self._cond:
            self._raise_error()
        self._close_direct()
        return self.results

    def stop(self) -> None:
        """Abandon the stream (after an error or Ctrl-C): the threads end at their next block."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._io.join()
        self._hasher.join()
        self._close_direct()

    def _close_direct(self) -> None:
        for fd in self._direct:
            if fd is not None:
                os.close(fd)
        self._direct = [None] * len(self._direct)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error


def _memcmp():
    try:
        function = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return function


_MEMCMP = _memcmp()  # ten times numpy's or torch's equality on bytes, and ctypes lets other threads run meanwhile


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two contiguous uint8 arrays hold the same bytes."""
    if a.nbytes != b.nbytes:
        return False
    if not a.nbytes:
        return True
    if _MEMCMP is not None:
        return _MEMCMP(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
    return bool(np.array_equal(a, b))


def _direct_fd(fd: int) -> int | None:
    """A second descriptor of the very file ``fd`` is open on (not of its path: /proc/self/fd reopens the inode),
    with O_DIRECT; None where the system or the filesystem (tmpfs) has none."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
