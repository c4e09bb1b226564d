"""A checkpoint's tensor reads served from one read-once stream of its weight files, in the order a job needs them.

The stream (:mod:`repack.formats.streaming`) reads every weight file once, front to back, hashes it and keeps a ring
of recent blocks. :class:`StreamedReads` serves the reader's reads (``CheckpointReader.serve_from``) from that ring
and moves it along: after every read it releases the bytes no tensor still to be read needs. The job says in which
order it reads (a list of steps, each the tensor names it reads): the converter's plan steps over the source, or
``repack verify``'s checks over the output and over the source.

Why it keeps some tensors aside: a job may read a tensor after others that lie behind it in the files. A stack
step of the converter reads each expert's gate and up weights and only then every down weight (the output's
order), while the files hold each expert's three together; verify reads an expert's w13 rows and then its w2 rows,
two thirds of a stack apart. Holding the ring back at the first tensor still needed could take a whole layer in
memory; instead each large tensor a read passes over is copied aside (at most ``KEEP_BYTES``) and the ring moves on,
and one that does not fit is read from the file when its turn comes. Small tensors (scales, zeros, ``g_idx``,
perms: read for every expert of a stack first, or row by row) never hold the ring; the kernel fetches them ahead
(``POSIX_FADV_WILLNEED``) and they are read from the page cache where the ring has passed them.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from repack.formats.checkpoint import CheckpointReader, TensorEntry
from repack.formats.streaming import BLOCK_BYTES, ReadOnceStream, StreamedFile, same_memory

# Module constants, read when a conversion starts (tests shrink them).
RING_BYTES = 256 << 20  # how far the stream may read ahead of the oldest byte still needed
KEEP_BYTES = 512 << 20  # most bytes of passed-over tensors kept aside (beyond: read again from the file)
LARGE_BYTES = 1 << 20  # tensors at least this large hold the ring until read; smaller ones come from the page cache
Position = tuple[int, int]  # (index of the file in the reader's order, byte offset)


@dataclass
class _Unread:
    """A large source tensor not yet read whole, and how many of its bytes, from its start, have been read."""

    entry: TensorEntry
    done: int = 0


class StreamedReads:
    """The stream of ``reader``'s files, serving its reads (see the module docstring). ``steps``: the tensor names
    each step of the job reads, steps in the order they run.

    The ring is held at the first byte still needed by any large tensor of any step (plans write a layer's copies
    before its stacks, and files need not agree: a shared expert may lie before the attention tensors); a large
    tensor passed over by a read is kept aside, while ``KEEP_BYTES`` allow, so the ring moves on."""

    def __init__(
        self,
        reader: CheckpointReader,
        steps: Sequence[Sequence[str]],
        *,
        ring: int | None = None,
        keep: int | None = None,
        block: int | None = None,
        on_hashed: Callable[[int], object] | None = None,
    ) -> None:
        self.reader = reader
        self.steps = steps
        self._rank = {file: index for index, file in enumerate(reader.files)}
        self._end: Position = (len(reader.files), 0)
        entries = [reader.entry(name) for step in steps for name in step]
        self._unread = {entry.name: _Unread(entry) for entry in entries if entry.nbytes >= LARGE_BYTES}
        self._heap = [(self._position(u.entry), name) for name, u in self._unread.items()]  # lazily pruned
        heapq.heapify(self._heap)
        self._kept: dict[str, np.ndarray] = {}
        self._kept_bytes = 0
        self._keep = KEEP_BYTES if keep is None else keep
        self.served = {"ring": 0, "kept": 0, "file": 0, "viewed": 0}  # bytes served from each (tests, benchmarks)
        self._pins: list[Position] = []  # where views handed out and not yet released start: the ring stays there
        files = [
            StreamedFile(file, reader.fd(file), reader.file_sizes[file], str(reader.folder / file))
            for file in reader.files
        ]
        ring = RING_BYTES if ring is None else ring
        block = BLOCK_BYTES if block is None else block
        self.stream = ReadOnceStream(files, ring, block_bytes=block, on_hashed=on_hashed)
        reader.serve_from(self)

    def _position(self, entry: TensorEntry, skip: int = 0) -> Position:
        return self._rank[entry.file], entry.offset + skip

    # ------------------------------------------------------------------------------------------ the schedule

    def before(self, k: int) -> None:
        """Step ``k`` starts: the kernel fetches the small tensors of this step and the next (a stack reads those of
        every expert first, across its whole span)."""
        for step in self.steps[k : k + 2] if k == 0 else self.steps[k + 1 : k + 2]:
            self._advise(step, os.POSIX_FADV_WILLNEED)

    def after(self, k: int) -> None:
        """Step ``k`` is done: nothing of it is needed any more (what it kept aside, a tensor it named but did not
        read, which must not hold the ring), and its small tensors leave the page cache."""
        for name in self.steps[k]:
            kept = self._kept.pop(name, None)
            if kept is not None:
                self._kept_bytes -= kept.nbytes
            self._unread.pop(name, None)
        self._release()
        self._advise(self.steps[k], os.POSIX_FADV_DONTNEED)

    def _advise(self, step: Sequence[str], advice: int) -> None:
        for name in step:
            entry = self.reader.entry(name)
            if entry.nbytes < LARGE_BYTES:
                os.posix_fadvise(self.reader.fd(entry.file), entry.offset, entry.nbytes, advice)

    def _first_needed(self) -> Position:
        """The first byte a large tensor still to be read occupies (the end when none is left)."""
        while self._heap:
            position, name = self._heap[0]
            unread = self._unread.get(name)
            if unread is not None and position == self._position(unread.entry, unread.done):
                return position
            heapq.heappop(self._heap)
        return self._end

    def _release(self) -> None:
        rank, offset = min(self._first_needed(), *self._pins) if self._pins else self._first_needed()
        if rank < len(self.reader.files):
            self.stream.release_before(self.reader.files[rank], offset)
        else:
            last = self.reader.files[-1]
            self.stream.release_before(last, self.reader.file_sizes[last])

    # ----------------------------------------------------------------------------------- serving the reader

    def read_into(self, entry: TensorEntry, offset: int, target: memoryview) -> bool:
        """Bytes ``offset ..`` of ``entry`` into ``target`` from what is kept aside or from the ring; False when
        neither holds them (the reader then reads the file)."""
        kept = self._kept.get(entry.name)
        if kept is not None:
            start = offset - entry.offset
            np.copyto(np.frombuffer(target, dtype=np.uint8), kept[start : start + len(target)])
            if start + len(target) == entry.nbytes:  # its last byte: it is not needed again
                del self._kept[entry.name]
                self._kept_bytes -= kept.nbytes
            served = True
        else:
            served = self.stream.read_into(entry.file, offset, target)
        self.served["kept" if kept is not None else "ring" if served else "file"] += len(target)
        self._account(entry, offset, len(target))
        return served

    def view(self, entry: TensorEntry, offset: int, count: int) -> np.ndarray | None:
        """Bytes ``offset .. offset + count`` of ``entry`` as a view of the ring (no copy) when one block holds them,
        else None (the caller reads them: :meth:`read_into`). They count as read, but the ring stays at them, whatever
        else is read meanwhile, until :meth:`release_views`."""
        if entry.name in self._kept:
            return None
        array = self.stream.view(entry.file, offset, count)
        if array is not None:
            self.served["viewed"] += count
            self._pins.append((self._rank[entry.file], offset))
            self._account(entry, offset, count)
        return array

    def release_views(self) -> None:
        """No view handed out so far is used any more: the ring may move past their bytes."""
        self._pins.clear()
        self._release()

    def compare(self, entry: TensorEntry, data: memoryview, offset: int | None = None) -> bool | None:
        """Whether ``data`` equals tensor ``entry``'s bytes (all of them, or those from file offset ``offset`` on: a
        piece, the pieces compared in file order), compared where they are held (kept aside or in the ring) without
        copying them out; None when neither holds them (the caller reads them and compares)."""
        start = entry.offset if offset is None else offset
        if offset is None and len(data) != entry.nbytes:
            return None
        kept = self._kept.get(entry.name)
        if kept is not None:
            at = start - entry.offset
            same = same_memory(np.frombuffer(data, dtype=np.uint8), kept[at : at + len(data)])
            if at + len(data) == entry.nbytes:  # its last byte: it is not needed again
                del self._kept[entry.name]
                self._kept_bytes -= kept.nbytes
        else:
            same = self.stream.compare(entry.file, start, data)
        if same is not None:
            self.served["kept" if kept is not None else "ring"] += len(data)
            self._account(entry, start, len(data))
        return same

    def _account(self, entry: TensorEntry, offset: int, count: int) -> None:
        """Bytes ``offset .. offset + count`` of ``entry`` are read: move the ring on past what is no longer needed."""
        unread = self._unread.get(entry.name)
        if unread is not None and offset - entry.offset == unread.done:
            unread.done += count
            if unread.done >= entry.nbytes:
                del self._unread[entry.name]
                self._keep_passed(self._position(entry, entry.nbytes))
            else:
                heapq.heappush(self._heap, (self._position(entry, unread.done), entry.name))
            self._release()

    def _keep_passed(self, end: Position) -> None:
        """Copy aside the large tensors still to be read that lie wholly before ``end`` (a read passed over them),
        so the ring need not wait for them. One that does not fit (``KEEP_BYTES``, or larger than the ring: a
        1 GB lm_head stored before the layers it is converted after) stops holding the ring too: it is read from
        the file when its turn comes, once more from the disk, rather than every byte after it."""
        reading: list[tuple[Position, str]] = []
        while self._first_needed() < end:
            name = self._heap[0][1]
            if self._unread[name].done:  # being read piece by piece (rows of a stack tensor): its reads go on
                reading.append(heapq.heappop(self._heap))
                continue
            heapq.heappop(self._heap)
            entry = self._unread.pop(name).entry
            if self._kept_bytes + entry.nbytes > self._keep:
                continue
            buffer = np.empty(entry.nbytes, dtype=np.uint8)
            if self.stream.read_into(entry.file, entry.offset, memoryview(buffer)):
                self._kept[name] = buffer
                self._kept_bytes += entry.nbytes
        for item in reading:
            heapq.heappush(self._heap, item)

    def finish(self) -> dict[str, dict]:
        """Every weight file's {sha256, size}, once the stream has read and hashed all of it."""
        return self.stream.finish()

    def stop(self) -> None:
        self.reader.serve_from(None)
        self._kept.clear()
        self.stream.stop()
