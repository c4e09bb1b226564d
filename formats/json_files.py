"""JSON files a stranger wrote (config.json, the index, the manifest): read with a size bound, parsed strictly.

Why strict: Python's ``json`` reads more than JSON. It takes UTF-16 and UTF-32 bytes (JSON files are UTF-8, and the
safetensors spec says so for headers) and the constants ``NaN`` and ``Infinity``, which it would then write back
into our output, where every strict parser (Rust's serde in safetensors and tokenizers, JavaScript on the Hub)
refuses the file. Why bounded: ``read_text()`` of a 10 GB "config.json" costs 10 GB before anything is checked.

Torch-free: the manifest reader (``repack push``, ``repack inspect``) uses it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from stat import S_ISREG

from .errors import RepackError

CONFIG_MAX_BYTES = 16 << 20  # real config.json files are a few KB
INDEX_MAX_BYTES = 64 << 20  # DeepSeek-V3's index (91k tensors) is about 9 MB
MANIFEST_MAX_BYTES = 16 << 20  # two records per file of a conversion: a few KB for the largest models


def read_bounded(path: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of ``path``, refused in one line when they are more than ``max_bytes`` (checked before reading).

    Only a regular file is read: a FIFO or a device would block or never end."""
    try:
        with path.open("rb") as handle:
            stat = os.fstat(handle.fileno())
            if not S_ISREG(stat.st_mode):
                raise RepackError(f"{path}: is not a regular file; replace it with the {what}")
            if stat.st_size > max_bytes:
                raise RepackError(
                    f"{path}: {stat.st_size} bytes is more than the {max_bytes >> 20} MB a {what} may have (corrupt, "
                    "or not what its name says); re-create or re-download it"
                )
            raw = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise RepackError(f"{path}: file not found") from None
    if len(raw) > max_bytes:  # grew while being read
        raise RepackError(f"{path}: more than the {max_bytes >> 20} MB a {what} may have; re-create it")
    return raw


def parse_json(raw: bytes, path: Path | str, fix: str) -> object:
    """Strict JSON: UTF-8 only, no ``NaN``/``Infinity``; one-line error ending in ``fix`` otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RepackError(f"{path}: not UTF-8 (byte {error.start}); JSON files are UTF-8, {fix}") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise RepackError(f"{path}: not valid JSON ({_one_line(error)}); {fix}") from None
    where = non_finite_path(data)
    if where is not None:
        raise RepackError(f"{path}: {where or 'the value'} is NaN or Infinity, which JSON does not allow; {fix}")
    return data


def non_finite_path(data: object, path: str = "") -> str | None:
    """Dotted path of the first NaN or infinite number in ``data`` (``""`` for ``data`` itself), or None."""
    stack: list[tuple[object, str]] = [(data, path)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where
        if isinstance(value, dict):
            stack.extend((item, f"{where}.{key}" if where else str(key)) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{index}]") for index, item in reversed(list(enumerate(value))))
    return None


def read_json_object(path: Path, max_bytes: int, what: str, fix: str) -> dict:
    """A bounded, strictly parsed JSON object from ``path``."""
    data = parse_json(read_bounded(path, max_bytes, what), path, fix)
    if not isinstance(data, dict):
        raise RepackError(f"{path}: not a JSON object; {fix}")
    return data


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())
