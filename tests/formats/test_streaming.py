"""The read-once stream (formats/streaming.py): every file read once and hashed exactly, reads served from the ring
byte for byte, refused (False, never a wait) behind or beyond it, and read errors named as the source's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from repack.formats.errors import RepackError
from repack.formats.streaming import ReadOnceStream, StreamedFile

BLOCK = 64 << 10


def make_files(folder: Path, sizes: list[int]) -> list[Path]:
    paths = []
    for index, size in enumerate(sizes):
        path = folder / f"f{index}"
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def open_stream(paths: list[Path], capacity: int) -> tuple[ReadOnceStream, list[int]]:
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    files = [StreamedFile(path.name, fd, path.stat().st_size, str(path)) for path, fd in zip(paths, fds, strict=True)]
    return ReadOnceStream(files, capacity, block_bytes=BLOCK), fds


@pytest.fixture
def paths(tmp_path) -> list[Path]:
    return make_files(tmp_path, [5 * BLOCK + 123, 0, BLOCK, 3 * BLOCK - 7])


def test_every_file_is_hashed_exactly_whatever_is_read(paths):
    stream, fds = open_stream(paths, 2 * BLOCK)
    results = stream.finish()
    stream.stop()
    for path in paths:
        data = path.read_bytes()
        assert results[path.name] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    for fd in fds:
        os.close(fd)


def test_reads_inside_the_ring_are_the_files_bytes_and_released_bytes_are_refused(paths):
    stream, fds = open_stream(paths, 3 * BLOCK)
    data = paths[0].read_bytes()
    target = bytearray(BLOCK + 100)
    assert stream.read_into("f0", BLOCK - 50, memoryview(target))  # across two blocks
    assert bytes(target) == data[BLOCK - 50 : 2 * BLOCK + 50]
    assert not stream.read_into("f0", 4 * BLOCK, memoryview(bytearray(10)))  # beyond the ring: no wait, False
    stream.release_before("f0", 2 * BLOCK)
    assert not stream.read_into("f0", 0, memoryview(bytearray(10)))  # released
    assert stream.read_into("f0", 4 * BLOCK, memoryview(target)[:10])  # the ring moved on
    assert bytes(target[:10]) == data[4 * BLOCK : 4 * BLOCK + 10]
    tail = bytearray(123)
    stream.release_before("f0", 5 * BLOCK)
    assert stream.read_into("f0", 5 * BLOCK, memoryview(tail)) and bytes(tail) == data[5 * BLOCK :]
    last = paths[3].read_bytes()
    stream.release_before("f3", 0)
    whole = bytearray(len(last))
    assert stream.read_into("f3", 0, memoryview(whole)) and bytes(whole) == last
    assert stream.finish()["f3"]["sha256"] == hashlib.sha256(last).hexdigest()
    stream.stop()
    for fd in fds:
        os.close(fd)


def test_a_file_truncated_under_the_stream_is_one_named_error(paths):
    stream, fds = open_stream(paths[:1], 2 * BLOCK)
    os.truncate(paths[0], BLOCK)
    with pytest.raises(RepackError, match="f0: truncated while reading"):
        stream.finish()
    stream.stop()
    os.close(fds[0])


def test_stop_ends_a_stream_whose_ring_is_full(paths):
    stream, fds = open_stream(paths, 2 * BLOCK)  # nothing released: the I/O thread waits for room
    stream.stop()
    assert not stream._io.is_alive() and not stream._hasher.is_alive()
    for fd in fds:
        os.close(fd)


def test_tmpfs_without_o_direct_is_read_through_the_page_cache():
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm here")
    folder = shm / f"repack-stream-{os.getpid()}"
    folder.mkdir()
    try:
        paths = make_files(folder, [2 * BLOCK + 5])
        stream, fds = open_stream(paths, 4 * BLOCK)
        target = bytearray(2 * BLOCK + 5)
        assert stream.read_into("f0", 0, memoryview(target)) and bytes(target) == paths[0].read_bytes()
        stream.finish()
        stream.stop()
        os.close(fds[0])
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
