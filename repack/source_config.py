"""What a source checkpoint's config says about whether it can be converted, read before torch is imported.

Why: a folder ``repack convert`` cannot take for what its config says (config.json not JSON, an fp16 model,
another quant_method, 3-bit weights, AWQ's GEMV packing, a llama) needs no tensor to be refused, yet the refusal
used to come after seconds of importing torch and reading every header. :func:`check_source_config` asks the same
functions the planner asks (repack.plan.build_plan: the source format's config, then the family), so the line is
the one the conversion would end with; the CLI calls it among its checks before the work (repack.preflight).
"""

from __future__ import annotations

from pathlib import Path

from repack.families import detect_family
from repack.formats.config_files import read_config
from repack.formats.constants import CONFIG_FILE
from repack.formats.json_files import CONFIG_MAX_BYTES, parse_json, read_bounded
from repack.formats.source_configs import parse_source_config

QUANTIZE_CONFIG_FILE = "quantize_config.json"


def read_quantization_config(folder: Path, config: dict) -> tuple[dict | None, str | None]:
    """The source's quantization config: config.json's ``quantization_config``, else quantize_config.json (older
    GPTQ exports)."""
    quant = config.get("quantization_config")
    if isinstance(quant, dict):
        return quant, CONFIG_FILE
    path = folder / QUANTIZE_CONFIG_FILE
    if path.is_file():
        data = parse_json(read_bounded(path, CONFIG_MAX_BYTES, QUANTIZE_CONFIG_FILE), path, "fix or re-download it")
        if isinstance(data, dict):
            return data, QUANTIZE_CONFIG_FILE
    return None, None


def check_source_config(folder: Path) -> None:
    """Refuse, in one line, a local source whose config alone says it cannot be converted: config.json unreadable
    or not strict JSON, no quantization config or one of a format or scheme we do not read, an unsupported
    architecture. Checks in the planner's order; whatever needs the tensors' headers is left to the planner."""
    config = read_config(folder)
    quant, quant_file = read_quantization_config(folder, config)
    parse_source_config(quant, str(folder / (quant_file or CONFIG_FILE)))
    detect_family(config, str(folder / CONFIG_FILE))
