"""A checkpoint's config.json: read once, bounded and strict, with the checksum of the very bytes parsed; and the
check that it describes a repack-moe checkpoint this reader knows.

Why a module of its own, free of torch: the CLI reads a source's config.json (``repack convert``) and an output's
(``repack inspect``, ``repack tune``, ``repack verify``) before it imports torch, so a folder that is not what the
command takes is refused at once; the converter, verify and the loader read it through the same functions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from .constants import CONFIG_FILE, FORMAT_NAME, QUANT_METHOD, SUPPORTED_FORMAT_VERSIONS
from .errors import RepackError
from .json_files import CONFIG_MAX_BYTES, parse_json, read_bounded
from .manifest import FileRecord


def read_config(folder: str | Path) -> dict:
    """config.json of a checkpoint folder, with one-line errors."""
    return read_config_record(folder)[0]


def read_config_record(folder: str | Path) -> tuple[dict, FileRecord]:
    """config.json of a checkpoint folder, and the sha256 and size of the very bytes parsed (bounded, strict JSON:
    UTF-8, no NaN), so a manifest records the config the conversion used, not one that changed since."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        if path.exists() or path.is_symlink():
            raise RepackError(f"{path}: not a regular file; replace it with the model's config.json")
        raise RepackError(f"{Path(folder)}: no {CONFIG_FILE}; is this a Hugging Face model folder?")
    raw = read_bounded(path, CONFIG_MAX_BYTES, "config.json")
    config = parse_json(raw, path, "fix or re-download it")
    if not isinstance(config, dict):
        raise RepackError(f"{path}: not a JSON object; fix or re-download it")
    return config, FileRecord(hashlib.sha256(raw).hexdigest(), len(raw))


def check_repack_quant_config(quant: object, where: str) -> dict:
    """``quant`` (an output's ``quantization_config``) is a repack-moe config of a version this reader knows; one
    line naming ``where`` otherwise (another format, a folder not converted yet, a newer version)."""
    if not isinstance(quant, dict):
        raise RepackError(f"{where}: quantization_config is not an object; not a {FORMAT_NAME} checkpoint")
    if quant.get("quant_method") != QUANT_METHOD or quant.get("format") != FORMAT_NAME:
        raise RepackError(
            f"{where}: not a {FORMAT_NAME} checkpoint (quant_method {quant.get('quant_method')!r}); "
            "convert it first with `repack convert`"
        )
    version = quant.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise RepackError(
            f"{where}: {FORMAT_NAME} format_version {version!r} is not supported by this reader (knows "
            f"{', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))}); upgrade moe-repack or re-convert the source"
        )
    return quant


def check_repack_config(folder: str | Path) -> dict:
    """config.json of a converted folder, checked to be a repack-moe checkpoint this reader knows."""
    config = read_config(folder)
    check_repack_quant_config(config.get("quantization_config") or {}, str(Path(folder) / CONFIG_FILE))
    return config
