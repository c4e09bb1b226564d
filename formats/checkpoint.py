"""The file side of the format: read and write (sharded) safetensors checkpoints, and read our config.

Both the converter and the runtime loader use this module, so it imports nothing from the CLI. Errors
are :class:`repack.formats.errors.RepackError` with one line that names the file and says what to do.

- :class:`CheckpointReader` opens a single ``model.safetensors`` or an indexed sharded checkpoint lazily:
  it parses only the safetensors headers to list names, shapes, dtypes and file offsets, and
  :meth:`~CheckpointReader.read` / :meth:`~CheckpointReader.iter_raw` read one tensor's bytes with ``pread``
  into fresh memory. No file is memory-mapped, so streaming a 30 GB checkpoint leaves no mapped pages
  counted in the process's RSS.
- :class:`ShardedWriter` streams tensors into ``model-0000i-of-0000N.safetensors`` shards whose layout is
  fixed up front from the full list of output tensors (:func:`plan_shards`): each shard's header is
  written first, then tensor bytes in order, as they arrive, in pieces if need be. A background thread
  hashes and writes while the caller computes the next tensor; the bytes it may hold are bounded.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from repack.formats.config_files import check_repack_quant_config, read_config
from repack.formats.errors import RepackError
from repack.formats.json_files import INDEX_MAX_BYTES, parse_json, read_bounded
from repack.formats.manifest import FileRecord
from repack.formats.paths import check_inside, child_path

from .stacks import INDEX_FILE, StackInfo, StackInfoError

SINGLE_FILE = "model.safetensors"
from .constants import CONFIG_FILE, CONVERSION_ID_KEY  # noqa: E402, F401 - re-exported (loader, converter use them)

READ_CHUNK = 16 << 20  # pieces of a large copied tensor (embeddings, lm_head) read at a time
STAGING_BYTES = 16 << 20  # aligned write buffer of one output file (O_DIRECT writes of this size)
QUEUE_BYTES = 256 << 20  # most tensor bytes the writer thread may hold that are not yet on disk
_DIRECT_ALIGN = 4096

# safetensors dtype codes <-> torch dtypes (the subset checkpoints use).
_DTYPE_CODES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
}
if hasattr(torch, "float8_e8m0fnu"):  # torch >= 2.7
    _DTYPE_CODES["F8_E8M0"] = torch.float8_e8m0fnu
_CODE_OF_DTYPE = {dtype: code for code, dtype in _DTYPE_CODES.items()}
# Largest header we accept: real checkpoints have a few MB at most; more means a corrupt length field.
_MAX_HEADER_BYTES = 100 << 20
# torch keeps sizes, strides and byte counts in int64 and safetensors multiplies dims in usize: a shape whose
# elements (zero dims counted as one, as strides count them) times the item size pass this is unreadable by both.
_MAX_TENSOR_BYTES = (1 << 63) - 1


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives and what it is, read from a safetensors header (no data loaded)."""

    name: str
    file: str  # file name relative to the checkpoint folder
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "I32", "F16"
    offset: int = -1  # absolute byte offset of the data in the file (-1: unknown)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPE_CODES[self.dtype]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


def _nbytes(shape: Iterable[int], code: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _DTYPE_CODES[code].itemsize


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype ("F16" for torch.float16)."""
    if dtype not in _CODE_OF_DTYPE:
        raise RepackError(f"tensor dtype {dtype} has no safetensors code; convert it to a supported dtype first")
    return _CODE_OF_DTYPE[dtype]


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one file's header; a truncated or corrupt file raises a one-line error naming it."""
    return parse_safetensors_header(path).entries


@dataclass(frozen=True)
class SafetensorsHeader:
    """One file's parsed header: its tensors, its ``__metadata__``, the header's length and its sha256.

    ``sha256`` covers the 8-byte length and the JSON header as stored, which decide every tensor's name, dtype,
    shape and place: the manifest records it (formats/SPEC.md section 5), so a reader can check a file's structure
    without hashing its data."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    header_bytes: int
    sha256: str
    file_size: int


def parse_safetensors_header(path: Path, max_header_bytes: int = _MAX_HEADER_BYTES) -> SafetensorsHeader:
    """Parse and check one file's header to the safetensors spec, reading at most ``max_header_bytes`` of it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise RepackError(f"{path}: file not found; re-download the checkpoint") from None
    try:
        return read_safetensors_header_at(fd, path, max_header_bytes)
    finally:
        os.close(fd)


def read_safetensors_header_at(fd: int, path: Path, max_header_bytes: int = _MAX_HEADER_BYTES) -> SafetensorsHeader:
    """Parse and check the header of the open file ``fd`` (named ``path`` in messages) to the safetensors spec.

    Why so strict: a header a stranger wrote decides what is read and allocated. The JSON must be UTF-8 (the spec;
    Python's json would also take UTF-16), offsets integers, the tensors' byte ranges must tile the data region
    exactly (no overlap, no hole, nothing after), shapes non-negative integers that torch and safetensors can
    hold, names valid UTF-8 (what safetensors itself requires to open the file again).
    """
    size = os.fstat(fd).st_size
    raw_len = _pread_exactly(fd, 8, 0)
    if len(raw_len) < 8:
        raise RepackError(f"{path}: truncated safetensors file ({size} bytes); re-download or re-save it")
    (header_len,) = struct.unpack("<Q", raw_len)
    if header_len > max_header_bytes:
        raise RepackError(
            f"{path}: safetensors header of {header_len} bytes is over the {max_header_bytes} bytes left of "
            f"the {_MAX_HEADER_BYTES >> 20} MB allowed for all headers of a checkpoint; re-download or re-save it"
        )
    if header_len > size - 8:
        raise RepackError(
            f"{path}: corrupt or truncated safetensors header (header length {header_len}, file size {size}); "
            "re-download or re-save it"
        )
    raw = _pread_exactly(fd, header_len, 8)
    digest = hashlib.sha256(raw_len)
    digest.update(raw)
    try:
        if b"\0" in raw:  # valid UTF-8, but no JSON text holds a NUL: UTF-16 or UTF-32, which Python's json reads
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "NUL byte")
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise RepackError(
            f"{path}: safetensors header is not UTF-8 (UTF-16 or another encoding; the spec requires UTF-8); re-save "
            "the file"
        ) from None
    except (json.JSONDecodeError, ValueError, RecursionError) as error:
        raise RepackError(
            f"{path}: corrupt safetensors header ({_one_line(error)}); re-download or re-save it"
        ) from None
    if not isinstance(header, dict):
        raise RepackError(f"{path}: corrupt safetensors header (not a JSON object); re-download or re-save it")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise RepackError(f"{path}: corrupt safetensors header (__metadata__ is not an object); re-download it")
    data_bytes = size - 8 - header_len
    entries: dict[str, TensorEntry] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        dtype, shape, (start, end) = _header_entry(path, name, meta)
        if dtype not in _DTYPE_CODES:
            raise RepackError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        _check_shape(path, name, shape, dtype)
        if end > data_bytes:
            raise RepackError(
                f"{path}: truncated safetensors file (tensor {name} ends at byte {end} of {data_bytes} data "
                "bytes); re-download it"
            )
        if end - start != _nbytes(shape, dtype):
            raise RepackError(
                f"{path}: corrupt safetensors header entry for {name} ({end - start} bytes for {dtype} "
                f"{list(shape)}); re-download or re-save it"
            )
        entries[name] = TensorEntry(name, path.name, shape, dtype, 8 + header_len + start)
        ranges.append((start, end, name))
    _check_tiling(path, ranges, data_bytes)
    return SafetensorsHeader(entries, metadata, header_len, digest.hexdigest(), size)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _pread_exactly(fd: int, count: int, offset: int) -> bytes:
    """Up to ``count`` bytes at ``offset`` (fewer only at the end of the file)."""
    pieces, done = [], 0
    while done < count:
        piece = os.pread(fd, min(count - done, 1 << 30), offset + done)
        if not piece:
            break
        pieces.append(piece)
        done += len(piece)
    return b"".join(pieces)


def _check_shape(path: Path, name: str, shape: tuple[int, ...], dtype: str) -> None:
    """Refuse a shape whose strides or byte count overflow int64 (torch) or usize (safetensors), zero dims or not."""
    extent = _DTYPE_CODES[dtype].itemsize
    for dim in shape:
        extent *= max(dim, 1)
        if extent > _MAX_TENSOR_BYTES:
            raise RepackError(
                f"{path}: tensor {name} has shape {list(shape)}, larger than torch and safetensors can hold (its "
                "strides or bytes overflow 64 bits); re-save the file"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_entry(path: Path, name: str, meta: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (start, end)) of one header entry, each of the type the spec says."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise RepackError(f"{path}: tensor name {name!r} is not valid UTF-8; re-save the file") from None
    fields = (meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")) if isinstance(meta, dict) else None
    if (
        fields is None
        or not isinstance(fields[0], str)
        or not isinstance(fields[1], list)
        or not all(_is_int(dim) and dim >= 0 for dim in fields[1])
        or not isinstance(fields[2], list)
        or len(fields[2]) != 2
        or not all(_is_int(offset) and offset >= 0 for offset in fields[2])
        or fields[2][0] > fields[2][1]
    ):
        raise RepackError(
            f"{path}: corrupt safetensors header entry for {name} (dtype, shape and data_offsets must be a string, "
            "non-negative integers and two ordered integers); re-download or re-save it"
        )
    return fields[0], tuple(fields[1]), (fields[2][0], fields[2][1])


def _check_tiling(path: Path, ranges: list[tuple[int, int, str]], data_bytes: int) -> None:
    """The tensors' byte ranges, in order, cover the data region exactly once (the spec: no overlap, no hole)."""
    position = 0
    for start, end, name in sorted(ranges):
        if start != position:
            what = "overlaps the tensor before it" if start < position else f"leaves a hole at byte {position}"
            raise RepackError(
                f"{path}: corrupt safetensors header: tensor {name} (bytes {start}..{end}) {what}; re-download or "
                "re-save it"
            )
        position = end
    if position != data_bytes:
        raise RepackError(
            f"{path}: corrupt safetensors file: {data_bytes - position} bytes after the last tensor; re-download or "
            "re-save it"
        )


class CheckpointReader:
    """Lazy view of the tensors of a checkpoint folder (single file or sharded with an index).

    Each weight file is opened once, when its header is parsed, and every later read goes through that same
    descriptor: the bytes read are always those of the file whose header was checked, even if the folder is
    replaced meanwhile (a path can be renamed over, an open file cannot; inode numbers are reused, descriptors
    are not). :meth:`close` (or ``with``) releases them."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._fds: dict[str, int] = {}
        self._server = None  # serves reads before the files do (serve_from)
        self.entries: dict[str, TensorEntry] = {}
        self.metadata: dict[str, dict[str, str]] = {}  # file -> its header's __metadata__
        self.header_sha256: dict[str, str] = {}  # file -> sha256 of its header as read (SafetensorsHeader.sha256)
        self.file_sizes: dict[str, int] = {}  # file -> its size when opened
        self._opened: dict[str, tuple[int, ...]] = {}  # file -> what fstat said when it was opened (see changed())
        try:
            self.files = self._weight_files()
            header_budget = _MAX_HEADER_BYTES  # for all files together: many shards must not multiply it
            for file in self.files:
                header = read_safetensors_header_at(self._open(file), self.folder / file, header_budget)
                header_budget -= header.header_bytes
                self.metadata[file] = header.metadata
                self.header_sha256[file] = header.sha256
                self.file_sizes[file] = header.file_size
                for name, entry in header.entries.items():
                    if name in self.entries:
                        raise RepackError(
                            f"{self.folder / file}: tensor {name} also stored in {self.entries[name].file}; "
                            "remove the duplicate"
                        )
                    self.entries[name] = entry
            self._check_index_matches_headers()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _open(self, file: str) -> int:
        path = self.folder / file
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise RepackError(f"{path}: file not found; re-download the checkpoint") from None
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE):
                raise RepackError(
                    f"{path}: cannot open it, {len(self._fds)} weight files are open already (ulimit -n); raise the "
                    "limit of open files or merge shards"
                ) from None
            raise
        self._fds[file] = fd
        self._opened[file] = _file_state(os.fstat(fd))
        return fd

    def changed(self) -> str | None:
        """The first weight file that changed since it was opened (written to: its size, mtime or ctime moved), or
        whose path now names another file (replaced), with how; None when all are as they were.

        Why: a converter that reads a source being rewritten would publish a mix of two versions whose manifest
        matches neither; ctime cannot be set by a writer, so a write always shows."""
        for file, fd in self._fds.items():
            if _file_state(os.fstat(fd)) != self._opened[file]:
                return f"{self.folder / file} was written to"
            try:
                now = os.stat(self.folder / file)
            except FileNotFoundError:
                return f"{self.folder / file} was deleted"
            if (now.st_dev, now.st_ino) != self._opened[file][:2]:
                return f"{self.folder / file} was replaced by another file"
        return None

    def _weight_files(self) -> list[str]:
        """The safetensors files that hold the weights, from the index when there is one."""
        if not self.folder.is_dir():
            raise RepackError(f"{self.folder}: not a folder; pass a checkpoint folder")
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            self.weight_map, self.index_record = _read_index(index_path)
            for file in set(self.weight_map.values()):
                child_path(self.folder, file, str(index_path))  # before anything opens it
            files = sorted(set(self.weight_map.values()))
            for file in files:
                check_inside(self.folder, self.folder / file)
                if not (self.folder / file).is_file():
                    raise RepackError(
                        f"{index_path}: names shard {file}, which is missing from {self.folder}; re-download it"
                    )
            return files
        self.weight_map, self.index_record = None, None
        if (self.folder / SINGLE_FILE).is_file():
            check_inside(self.folder, self.folder / SINGLE_FILE)
            return [SINGLE_FILE]
        shards = sorted(p.name for p in self.folder.glob("model-*-of-*.safetensors"))
        if shards:
            raise RepackError(
                f"{self.folder}: has sharded weights ({shards[0]}, ...) but no {INDEX_FILE}; re-download the index"
            )
        raise RepackError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE}; is this a safetensors checkpoint?")

    def _check_index_matches_headers(self) -> None:
        """The index and the headers list the same tensors in the same files (loaders trust the index: a tensor it
        does not list is one transformers never loads, so converting it would change the model)."""
        if self.weight_map is None:
            return
        for name, file in self.weight_map.items():
            entry = self.entries.get(name)
            if entry is None or entry.file != file:
                raise RepackError(
                    f"{self.folder / INDEX_FILE}: lists tensor {name} in {file}, but that shard does not hold it; "
                    "re-download the checkpoint"
                )
        if len(self.entries) != len(self.weight_map):
            name = next(name for name in self.entries if name not in self.weight_map)
            raise RepackError(
                f"{self.folder / self.entries[name].file}: holds tensor {name}, which {INDEX_FILE} does not list (a "
                "loader would never read it); re-download the index, or remove the tensor"
            )

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise RepackError(f"{self.folder}: tensor {name} not found in the checkpoint")
        return self.entries[name]

    def read(self, name: str) -> torch.Tensor:
        """Load one tensor with ``pread`` into new memory (no mapping of the file stays behind)."""
        entry = self.entry(name)
        tensor = torch.empty(entry.shape, dtype=entry.torch_dtype)
        if entry.nbytes:
            self._pread_into(entry, _writable_bytes(tensor), entry.offset)
        return tensor

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the first dimension of one tensor, reading only their bytes."""
        entry = self.entry(name)
        rows = entry.shape[0] if entry.shape else 1
        if not 0 <= start <= stop <= rows:
            raise RepackError(f"{self.folder}: rows {start}:{stop} of tensor {name} are outside its {rows} rows")
        row_bytes = entry.nbytes // max(rows, 1)
        tensor = torch.empty((stop - start, *entry.shape[1:]), dtype=entry.torch_dtype)
        if tensor.numel():
            self._pread_into(entry, _writable_bytes(tensor), entry.offset + start * row_bytes)
        return tensor

    def iter_raw(self, name: str, chunk_bytes: int = READ_CHUNK) -> Iterator[torch.Tensor]:
        """The bytes of one tensor as uint8 pieces of at most ``chunk_bytes``, read in file order."""
        entry = self.entry(name)
        for start in range(0, entry.nbytes, chunk_bytes):
            yield self.read_raw(name, start, min(chunk_bytes, entry.nbytes - start))

    def read_raw(self, name: str, start: int, count: int) -> torch.Tensor:
        """Bytes ``start .. start + count`` of one tensor, as uint8."""
        entry = self.entry(name)
        if not 0 <= start <= start + count <= entry.nbytes:
            raise RepackError(f"{self.folder}: bytes {start}:{start + count} are outside tensor {name}")
        piece = torch.empty(count, dtype=torch.uint8)
        if count:
            self._pread_into(entry, memoryview(piece.numpy()), entry.offset + start)
        return piece

    def serve_from(self, server) -> None:
        """Serve reads from ``server`` where it can: its ``read_into(entry, offset, buffer)`` fills the buffer and
        returns True, or returns False and the file is read (the converter's read-once stream of these same
        descriptors, repack.streamed_reads); None: from the files only."""
        self._server = server

    def fd(self, file: str) -> int:
        """The descriptor ``file``'s header was read through (reads of its data must use it)."""
        if file not in self._fds:
            raise RepackError(f"{self.folder / file}: not a weight file of this checkpoint, or the reader is closed")
        return self._fds[file]

    def _pread_into(self, entry: TensorEntry, buffer: memoryview, offset: int) -> None:
        if self._server is not None and self._server.read_into(entry, offset, buffer):
            return
        path = self.folder / entry.file
        fd = self.fd(entry.file)
        done = 0
        while done < len(buffer):
            count = os.preadv(fd, [buffer[done:]], offset + done)
            if count == 0:
                raise RepackError(
                    f"{path}: truncated while reading tensor {entry.name} (file shorter than its header says); "
                    "re-download it"
                )
            done += count

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _file_state(stat: os.stat_result) -> tuple[int, ...]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _read_index(path: Path) -> tuple[dict[str, str], FileRecord]:
    """The index's weight_map, and the sha256 and size of the bytes it was parsed from."""
    raw = read_bounded(path, INDEX_MAX_BYTES, "safetensors index")
    data = parse_json(raw, path, "re-download it")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise RepackError(f"{path}: not a valid safetensors index (no weight_map object); re-download it")
    return weight_map, FileRecord(hashlib.sha256(raw).hexdigest(), len(raw))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's storage."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class HashingFile:
    """A file opened for writing that hashes every byte it writes (sha256) and counts them.

    Why the staging buffers: on this project's build machines buffered writes of tens of GB run at a
    fifth of the disk's speed (page-cache writeback), so bytes are gathered in page-aligned buffers and
    written with ``O_DIRECT`` in ``staging_bytes`` blocks by a helper thread, while the caller hashes and
    fills the other buffer; the unaligned tail goes through the page cache. Filesystems without
    ``O_DIRECT`` (tmpfs) fall back to buffered writes.
    """

    def __init__(self, path: Path, *, direct: bool = True, staging_bytes: int = STAGING_BYTES) -> None:
        self.path = path
        self.sha256 = hashlib.sha256()
        self.size = 0
        self._direct = direct and hasattr(os, "O_DIRECT")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self._direct else 0), 0o644)
        except OSError as error:
            if not self._direct or error.errno != errno.EINVAL:
                raise
            self._direct = False
            self._fd = os.open(path, flags, 0o644)
        staging_bytes = max(_DIRECT_ALIGN, staging_bytes // _DIRECT_ALIGN * _DIRECT_ALIGN)
        self._buffers = [mmap.mmap(-1, staging_bytes) for _ in range(2)]
        self._views = [memoryview(buffer) for buffer in self._buffers]
        self._arrays = [np.frombuffer(view, dtype=np.uint8) for view in self._views]
        self._current = 0  # index of the buffer being filled
        self._filled = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-io")
        self._inflight: Future | None = None

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.size += len(view)
        source = np.frombuffer(view, dtype=np.uint8)
        done = 0
        while done < len(view):
            target = self._views[self._current]
            count = min(len(view) - done, len(target) - self._filled)
            # numpy copies without the GIL (a memoryview slice assignment holds it), so the converter's thread
            # keeps running while this one stages its 16 MB blocks; no view of a staging buffer outlives the
            # statement (an error's traceback would keep it, and discard() could not release the buffer)
            np.copyto(self._arrays[self._current][self._filled : self._filled + count], source[done : done + count])
            self._filled += count
            done += count
            if self._filled == len(target):
                self._hand_over(target)

    def _hand_over(self, block: memoryview) -> None:
        """Start writing ``block`` in the helper thread and switch to the other buffer once it is free."""
        self._wait()
        self._inflight = self._io.submit(self._write_out, block)
        self._current ^= 1
        self._filled = 0

    def _wait(self) -> None:
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            inflight.result()  # re-raises the helper's OSError (disk full) here

    def _write_out(self, block: memoryview) -> None:
        done = 0
        while done < len(block):
            try:
                done += os.write(self._fd, block[done:])
            except OSError as error:
                if not self._direct or error.errno != errno.EINVAL:
                    raise
                self._buffered()  # the filesystem refuses direct I/O after all

    def _buffered(self) -> None:
        if self._direct:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self._direct = False

    def close(self) -> None:
        """Write the tail (through the page cache: it is not block-sized) and close."""
        if self._fd < 0:
            return
        try:
            self._wait()
            if self._filled:
                self._buffered()
                self._write_out(self._views[self._current][: self._filled])
                self._filled = 0
        finally:
            self.discard()

    def discard(self) -> None:
        """Close without writing what is still staged (after an error)."""
        if self._fd < 0:
            return
        self._io.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1
        self._arrays = []
        for view, buffer in zip(self._views, self._buffers, strict=True):
            # After a failed write (disk full, ulimit -f) the error's traceback still holds a slice of a buffer, so
            # it cannot be closed yet: it is unmapped when that slice is freed. The error is what gets reported.
            with suppress(BufferError):
                view.release()
                buffer.close()
        self._views, self._buffers = [], []


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def safetensors_header(tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length plus JSON header (space-padded to 8 bytes) of a file holding (name, code, shape) in order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, code, shape in tensors:
        nbytes = _nbytes(shape, code)
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None):
    """Write one safetensors file, hashing while writing; returns (sha256 hex, size in bytes)."""
    layout = [(name, dtype_code(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    out = HashingFile(path)
    try:
        out.write(safetensors_header(layout, metadata))
        for tensor in tensors.values():
            out.write(_tensor_bytes(tensor))
    except BaseException:
        out.discard()
        raise
    out.close()
    return out.sha256.hexdigest(), out.size


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor as the writer expects it: known before any byte is computed."""

    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    # The tensor this one must follow immediately, in the same file (a joined shared stack tensor follows the
    # routed one of the same name, formats/SPEC.md section 5); it must be the previous tensor of the plan.
    follows: str | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


@dataclass
class ShardLayout:
    """One output file: its final name and the tensors it holds, in file order."""

    file: str
    tensors: list[PlannedTensor] = field(default_factory=list)
    metadata: dict[str, str] | None = None  # the header's __metadata__ (None: {"format": "pt"})

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def header(self) -> bytes:
        return safetensors_header(((t.name, t.dtype, t.shape) for t in self.tensors), self.metadata)


def plan_shards(tensors: Iterable[PlannedTensor], max_shard_bytes: int) -> list[ShardLayout]:
    """Fill shards in order up to ``max_shard_bytes`` of data (a bigger unit gets a shard of its own).

    A unit is a tensor with the tensors that follow it (``PlannedTensor.follows``): it is never split across
    shards, so each follower's bytes start where its predecessor's end (safetensors packs data without padding).
    """
    if max_shard_bytes <= 0:
        raise RepackError(f"shard size must be positive, got {max_shard_bytes} bytes")
    groups: list[list[PlannedTensor]] = []
    used = 0
    for unit in _adjacent_units(tensors):
        nbytes = sum(tensor.nbytes for tensor in unit)
        if not groups or (groups[-1] and used + nbytes > max_shard_bytes):
            groups.append([])
            used = 0
        groups[-1].extend(unit)
        used += nbytes
    count = len(groups)
    return [ShardLayout(f"model-{i:05d}-of-{count:05d}.safetensors", group) for i, group in enumerate(groups, 1)]


def _adjacent_units(tensors: Iterable[PlannedTensor]) -> list[list[PlannedTensor]]:
    """The tensors in order, grouped so that each tensor that ``follows`` another shares its predecessor's unit."""
    units: list[list[PlannedTensor]] = []
    for tensor in tensors:
        if tensor.follows is None:
            units.append([tensor])
        elif units and units[-1][-1].name == tensor.follows:
            units[-1].append(tensor)
        else:
            previous = units[-1][-1].name if units else "nothing"
            raise RepackError(
                f"output tensor {tensor.name} must follow {tensor.follows} but comes after {previous}; this is a "
                "converter bug, please report it"
            )
    return units


@dataclass
class WrittenFile:
    name: str
    sha256: str
    size: int
    header_sha256: str | None = None  # a safetensors file's header (SafetensorsHeader.sha256)

    def record(self) -> dict:
        """The manifest's record of this file ({sha256, size[, header_sha256]})."""
        data = {"sha256": self.sha256, "size": self.size}
        if self.header_sha256 is not None:
            data["header_sha256"] = self.header_sha256
        return data


_END = object()  # queue marker: no more pieces


class ShardedWriter:
    """Stream planned tensors into shards plus an index, in plan order, with bounded memory.

    The caller passes every output tensor up front, then the bytes of each, in that order, through
    :meth:`add` (a whole tensor) or :meth:`write` (the next piece of a tensor, e.g. one expert's slice of
    a stacked tensor). Pieces go to a background thread that hashes them and writes them to the current
    shard; :meth:`write` blocks while the thread holds more than ``queue_bytes``, so memory never holds
    a shard, only the pieces in flight. An error in the thread (disk full) is raised by the next call.
    """

    def __init__(
        self,
        folder: str | Path,
        tensors: Iterable[PlannedTensor],
        max_shard_bytes: int,
        *,
        queue_bytes: int = QUEUE_BYTES,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.shards = plan_shards(tensors, max_shard_bytes)
        self.metadata = metadata
        for shard in self.shards:
            shard.metadata = metadata
        self.total_bytes = sum(shard.data_bytes for shard in self.shards)
        self.written: list[WrittenFile] = []
        self.queue_bytes = queue_bytes
        self.peak_buffered_bytes = 0
        self._plan = iter([(index, t) for index, shard in enumerate(self.shards) for t in shard.tensors])
        self._tensor: PlannedTensor | None = None
        self._shard_index = -1
        self._remaining = 0
        self._pending: list[tuple[int, memoryview, object]] = []
        self._buffered = 0
        self._error: BaseException | None = None
        self._closed = False
        self._stopping = False
        self._file: HashingFile | None = None
        self._file_index = -1
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name="shard-writer", daemon=True)
        self._thread.start()

    @property
    def current_file(self) -> str:
        """The shard being written (for error messages)."""
        index = max(self._file_index, 0)
        if not self.shards:
            return str(self.folder)
        return f"{self.folder / self.shards[index].file} (shard {index + 1} of {len(self.shards)})"

    @property
    def buffered_bytes(self) -> int:
        """Tensor bytes handed over but not yet written."""
        return self._buffered

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write a whole tensor; its dtype and shape must be the planned ones."""
        expected = self._next(name)
        if dtype_code(tensor.dtype) != expected.dtype or tuple(tensor.shape) != expected.shape:
            raise RepackError(
                f"output tensor {name} is {dtype_code(tensor.dtype)} {list(tensor.shape)} but the plan says "
                f"{expected.dtype} {list(expected.shape)}; this is a converter bug, please report it"
            )
        self.write(name, tensor)

    def write(self, name: str, piece: torch.Tensor) -> None:
        """Append the next bytes of tensor ``name`` (its planned dtype, or raw uint8 bytes)."""
        expected = self._tensor if self._tensor is not None and self._tensor.name == name else self._next(name)
        code = dtype_code(piece.dtype)
        if code not in (expected.dtype, "U8"):
            raise RepackError(
                f"output tensor {name}: got a {code} piece for a {expected.dtype} tensor; this is a converter bug"
            )
        data = _tensor_bytes(piece)
        if len(data) > self._remaining:
            raise RepackError(
                f"output tensor {name}: more bytes than its planned {expected.dtype} {list(expected.shape)}; "
                "this is a converter bug, please report it"
            )
        self._remaining -= len(data)
        self._put((self._shard_index, data, piece))

    def _next(self, name: str) -> PlannedTensor:
        """Move on to the next planned tensor, which must be ``name``, after the current one is complete."""
        if self._tensor is not None and self._remaining:
            raise RepackError(
                f"output tensor {self._tensor.name} is {self._remaining} bytes short when {name} starts; "
                "this is a converter bug, please report it"
            )
        if self._tensor is not None and self._tensor.name == name:
            raise RepackError(f"output tensor {name} written twice; this is a converter bug, please report it")
        self._shard_index, self._tensor = next(self._plan, (-1, None))
        while self._tensor is not None and self._tensor.name != name and not self._tensor.nbytes:
            self._skip_empty()  # a zero-byte tensor has no pieces: it is complete once passed
        if self._tensor is None or self._tensor.name != name:
            expected = self._tensor.name if self._tensor else "nothing more"
            raise RepackError(
                f"output tensor {name} arrived out of plan order (expected {expected}); this is a converter bug"
            )
        self._remaining = self._tensor.nbytes
        if not self._remaining:
            self._put((self._shard_index, memoryview(b""), None))  # opens the shard of an empty tensor
        return self._tensor

    def _skip_empty(self) -> None:
        """Pass the current zero-byte tensor (opening its shard, whose header lists it) and take the next."""
        self._put((self._shard_index, memoryview(b""), None))
        self._shard_index, self._tensor = next(self._plan, (-1, None))

    def _put(self, item) -> None:
        with self._cond:
            size = len(item[1]) if item is not _END else 0
            while self._pending and self._buffered + size > self.queue_bytes and self._error is None:
                self._cond.wait()
            self._raise_thread_error()
            self._pending.append(item)
            self._buffered += size
            self.peak_buffered_bytes = max(self.peak_buffered_bytes, self._buffered)
            self._cond.notify_all()

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._closed = True
            raise error

    def _drain(self) -> None:
        """Writer thread: hash and write pieces in order, opening each shard with its header."""
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    item = self._pending[0]
                if item is _END:
                    self._finish_file()
                    return
                shard_index, data, _ = item
                if shard_index != self._file_index:
                    self._finish_file()
                    self._open(shard_index)
                if len(data):
                    self._file.write(data)
                with self._cond:
                    if self._pending:  # abort() may have emptied it meanwhile
                        self._pending.pop(0)
                        self._buffered -= len(data)
                    self._cond.notify_all()
        except BaseException as error:  # re-raised on the caller's thread
            if self._file is not None:
                self._file.discard()
                self._file = None
            with self._cond:
                self._error = error
                self._pending.clear()
                self._buffered = 0
                self._cond.notify_all()

    def _open(self, index: int) -> None:
        self._file_index = index
        self._file = HashingFile(self.folder / self.shards[index].file)
        header = self.shards[index].header()
        self._header_sha256 = hashlib.sha256(header).hexdigest()
        self._file.write(header)

    def _finish_file(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        file.close()
        self.written.append(WrittenFile(file.path.name, file.sha256.hexdigest(), file.size, self._header_sha256))

    def close(self) -> list[WrittenFile]:
        """Wait for every byte, check the plan is complete, write the index; returns every file written."""
        if self._tensor is not None and self._remaining:
            raise RepackError(f"output tensor {self._tensor.name} is {self._remaining} bytes short at close")
        missing = next(self._plan, None)
        while missing is not None and not missing[1].nbytes:
            self._shard_index, self._tensor = missing
            self._put((self._shard_index, memoryview(b""), None))
            missing = next(self._plan, None)
        if missing is not None:
            raise RepackError(f"output tensor {missing[1].name} was never written; this is a converter bug")
        self._put(_END)
        self._thread.join()
        self._raise_thread_error()
        self._closed = True
        weight_map = {t.name: shard.file for shard in self.shards for t in shard.tensors}
        index = {"metadata": {**(self.metadata or {}), "total_size": self.total_bytes}, "weight_map": weight_map}
        self.written.append(write_json(self.folder / INDEX_FILE, index))
        return self.written

    def abort(self) -> None:
        """Stop the thread and close the open shard (after an error or Ctrl-C); the caller deletes the folder."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stopping = True
            self._pending.clear()
            self._buffered = 0
            self._cond.notify_all()
        self._thread.join()
        if self._file is not None:
            self._file.discard()
            self._file = None


def write_json(path: Path, data: dict) -> WrittenFile:
    """Write a JSON file (indented, trailing newline) and return its hash and size."""
    encoded = (json.dumps(data, indent=2, allow_nan=False) + "\n").encode()  # strict JSON, as we read it
    path.write_bytes(encoded)
    return WrittenFile(path.name, hashlib.sha256(encoded).hexdigest(), len(encoded))


def read_repack_config(folder: str | Path) -> tuple[dict, list[StackInfo]]:
    """config.json of a repack-moe checkpoint and its stacks; refuses other formats and unknown versions."""
    config = read_config(folder)
    return config, parse_repack_quant_config(config.get("quantization_config") or {}, str(Path(folder) / CONFIG_FILE))


def parse_repack_quant_config(quant: dict, where: str) -> list[StackInfo]:
    """The stacks of a ``quantization_config`` dict (formats/SPEC.md section 4); refuses other formats and unknown
    versions with one line naming ``where``. Shared by every reader (the loader, the vLLM plugin)."""
    check_repack_quant_config(quant, where)
    try:
        return [StackInfo.from_json(stack) for stack in quant.get("stacks", [])]
    except StackInfoError as error:
        raise RepackError(f"{where}: malformed stack entry in quantization_config.stacks ({error})") from None
