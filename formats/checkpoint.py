"""The file side of the format: read and write (sharded) safetensors checkpoints, and read our config.

Both the converter and the runtime loader use this module, so it imports nothing from the CLI. Errors
are :class:`repack.errors.RepackError` with one line that names the file and says what to do.

- :class:`CheckpointReader` opens a single ``model.safetensors`` or an indexed sharded checkpoint lazily:
  it parses only the safetensors headers to list names, shapes and dtypes, and memory-maps a shard
  (``safe_open``) on the first :meth:`CheckpointReader.get` from it.
- :class:`ShardedWriter` writes ``model-0000i-of-0000N.safetensors`` shards as tensors arrive, holding at
  most one shard's pending tensors, hashes every byte as it writes it, and renames the shards to their
  final ``-of-N`` names and writes ``model.safetensors.index.json`` at :meth:`ShardedWriter.close`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from repack.errors import RepackError

from .repack_v1 import FORMAT_NAME, FORMAT_VERSION, INDEX_FILE, QUANT_METHOD, StackInfo

SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HASH_CHUNK = 16 << 20

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
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in _DTYPE_CODES.items()}
# Largest header we accept: real checkpoints have a few MB at most; more means a corrupt length field.
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives and what it is, read from a safetensors header (no data loaded)."""

    name: str
    file: str  # file name relative to the checkpoint folder
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "I32", "F16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPE_CODES[self.dtype]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.torch_dtype).element_size()


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype ("F16" for torch.float16)."""
    if dtype not in _CODE_OF_DTYPE:
        raise RepackError(f"tensor dtype {dtype} has no safetensors code; convert it to a supported dtype first")
    return _CODE_OF_DTYPE[dtype]


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one file's header; a truncated or corrupt file raises a one-line error naming it."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            raw_len = handle.read(8)
            if len(raw_len) < 8:
                raise RepackError(f"{path}: truncated safetensors file ({size} bytes); re-download or re-save it")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise RepackError(
                    f"{path}: corrupt or truncated safetensors header (header length {header_len}, file size "
                    f"{size}); re-download or re-save it"
                )
            header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RepackError(f"{path}: corrupt safetensors header ({error}); re-download or re-save it") from None
    except FileNotFoundError:
        raise RepackError(f"{path}: file not found; re-download the checkpoint") from None
    if not isinstance(header, dict):
        raise RepackError(f"{path}: corrupt safetensors header (not a JSON object); re-download or re-save it")
    entries: dict[str, TensorEntry] = {}
    data_bytes = size - 8 - header_len
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (_start, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise RepackError(
                f"{path}: corrupt safetensors header entry for {name}; re-download or re-save it"
            ) from None
        if dtype not in _DTYPE_CODES:
            raise RepackError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        if end > data_bytes:
            raise RepackError(
                f"{path}: truncated safetensors file (tensor {name} ends at byte {end} of {data_bytes} data "
                "bytes); re-download it"
            )
        entries[name] = TensorEntry(name, path.name, shape, dtype)
    return entries


class CheckpointReader:
    """Lazy view of the tensors of a checkpoint folder (single file or sharded with an index)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files = self._weight_files()
        self.entries: dict[str, TensorEntry] = {}
        for file in self.files:
            for name, entry in read_safetensors_header(self.folder / file).items():
                if name in self.entries:
                    raise RepackError(
                        f"{self.folder / file}: tensor {name} also stored in {self.entries[name].file}; "
                        "remove the duplicate"
                    )
                self.entries[name] = entry
        self._check_index_matches_headers()
        self._handles: dict[str, object] = {}

    def _weight_files(self) -> list[str]:
        """The safetensors files that hold the weights, from the index when there is one."""
        if not self.folder.is_dir():
            raise RepackError(f"{self.folder}: not a folder; pass a checkpoint folder")
        index_path = self.folder / INDEX_FILE
        if index_path.is_file():
            self.weight_map = _read_index(index_path)
            files = sorted(set(self.weight_map.values()))
            for file in files:
                if not (self.folder / file).is_file():
                    raise RepackError(
                        f"{index_path}: names shard {file}, which is missing from {self.folder}; re-download it"
                    )
            return files
        self.weight_map = None
        if (self.folder / SINGLE_FILE).is_file():
            return [SINGLE_FILE]
        shards = sorted(p.name for p in self.folder.glob("model-*-of-*.safetensors"))
        if shards:
            raise RepackError(
                f"{self.folder}: has sharded weights ({shards[0]}, ...) but no {INDEX_FILE}; re-download the index"
            )
        raise RepackError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE}; is this a safetensors checkpoint?")

    def _check_index_matches_headers(self) -> None:
        if self.weight_map is None:
            return
        for name, file in self.weight_map.items():
            entry = self.entries.get(name)
            if entry is None or entry.file != file:
                raise RepackError(
                    f"{self.folder / INDEX_FILE}: lists tensor {name} in {file}, but that shard does not hold it; "
                    "re-download the checkpoint"
                )

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise RepackError(f"{self.folder}: tensor {name} not found in the checkpoint")
        return self.entries[name]

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor (memory-mapped read of its bytes only)."""
        entry = self.entry(name)
        path = self.folder / entry.file
        try:
            handle = self._handles.get(entry.file)
            if handle is None:
                handle = safe_open(str(path), framework="pt")
                self._handles[entry.file] = handle
            return handle.get_tensor(name)
        except SafetensorError as error:
            raise RepackError(f"{path}: cannot read tensor {name} ({_one_line(error)}); re-download it") from None

    def close(self) -> None:
        self._handles.clear()

    def file_sizes(self) -> dict[str, int]:
        return {file: (self.folder / file).stat().st_size for file in self.files}


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise RepackError(f"{path}: not a valid safetensors index (no weight_map); re-download it") from None
    if not isinstance(weight_map, dict):
        raise RepackError(f"{path}: weight_map is not an object; re-download it")
    return weight_map


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


class HashingFile:
    """A binary file opened for writing that hashes every byte it writes (sha256) and counts them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = path.open("wb")
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self._handle.write(view)
        self.size += len(view)

    def close(self) -> None:
        self._handle.close()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None):
    """Write one safetensors file, hashing while writing; returns (sha256 hex, size in bytes)."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtype_code(tensor.dtype),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    out = HashingFile(path)
    try:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for tensor in tensors.values():
            out.write(_tensor_bytes(tensor))
    finally:
        out.close()
    return out.sha256.hexdigest(), out.size


@dataclass
class WrittenFile:
    name: str
    sha256: str
    size: int


class ShardedWriter:
    """Stream tensors into size-capped shards plus an index, in the order they are added.

    A shard is written as soon as the next tensor would overflow it, so memory holds at most one shard's
    pending tensors. Shards are first written as ``model-0000i.safetensors.partial`` (the total count is
    unknown until the end) and renamed to ``model-0000i-of-0000N.safetensors`` by :meth:`close`.
    """

    def __init__(self, folder: str | Path, max_shard_bytes: int) -> None:
        if max_shard_bytes <= 0:
            raise RepackError(f"shard size must be positive, got {max_shard_bytes} bytes")
        self.folder = Path(folder)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._partials: list[tuple[Path, list[str], str, int]] = []  # path, names, sha256, size
        self.total_bytes = 0
        self.written: list[WrittenFile] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        if name in self._pending or any(name in names for _, names, _, _ in self._partials):
            raise RepackError(f"output tensor {name} written twice; this is a converter bug, please report it")
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        """Write the pending tensors as the next shard."""
        if not self._pending:
            return
        path = self.folder / f"model-{len(self._partials) + 1:05d}.safetensors.partial"
        sha, size = write_safetensors(path, self._pending)
        self._partials.append((path, list(self._pending), sha, size))
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> list[WrittenFile]:
        """Flush, rename shards to their final names, write the index; returns every file written."""
        self.flush()
        count = len(self._partials)
        weight_map: dict[str, str] = {}
        for i, (path, names, sha, size) in enumerate(self._partials, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
            self.written.append(WrittenFile(final, sha, size))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        self.written.append(write_json(self.folder / INDEX_FILE, index))
        return self.written


def write_json(path: Path, data: dict) -> WrittenFile:
    """Write a JSON file (indented, trailing newline) and return its hash and size."""
    encoded = (json.dumps(data, indent=2) + "\n").encode()
    path.write_bytes(encoded)
    return WrittenFile(path.name, hashlib.sha256(encoded).hexdigest(), len(encoded))


def hash_file(path: Path) -> tuple[str, int]:
    """sha256 hex and size of a file, read in large sequential chunks."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def iter_file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        yield from iter(lambda: handle.read(HASH_CHUNK), b"")


def read_config(folder: str | Path) -> dict:
    """config.json of a checkpoint folder, with one-line errors."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise RepackError(f"{Path(folder)}: no {CONFIG_FILE}; is this a Hugging Face model folder?")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RepackError(f"{path}: not valid JSON ({_one_line(error)}); fix or re-download it") from None
    if not isinstance(config, dict):
        raise RepackError(f"{path}: not a JSON object; fix or re-download it")
    return config


def read_repack_config(folder: str | Path) -> tuple[dict, list[StackInfo]]:
    """config.json of a repack-moe checkpoint and its stacks; refuses other formats and unknown versions."""
    config = read_config(folder)
    path = Path(folder) / CONFIG_FILE
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != QUANT_METHOD or quant.get("format") != FORMAT_NAME:
        raise RepackError(
            f"{path}: not a {FORMAT_NAME} checkpoint (quant_method {quant.get('quant_method')!r}); "
            "convert it first with `repack convert`"
        )
    version = quant.get("format_version")
    if version != FORMAT_VERSION:
        raise RepackError(
            f"{path}: {FORMAT_NAME} format_version {version!r} is not supported by this reader (knows "
            f"{FORMAT_VERSION}); upgrade moe-repack or re-convert the source"
        )
    try:
        stacks = [StackInfo.from_json(stack) for stack in quant.get("stacks", [])]
    except TypeError as error:
        raise RepackError(f"{path}: malformed stack entry in quantization_config.stacks ({error})") from None
    return config, stacks
