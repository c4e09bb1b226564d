"""What each source format's quantization config says, read without torch: which source format a checkpoint is in,
which of its modules are quantized, and with which scheme.

Why apart from the readers (formats/sources/): a config ``repack convert`` cannot take (an fp16 model, another
quant_method, 3-bit weights, AWQ's GEMV packing, llm-compressor's unsaved or sparse models) needs no tensor to be
refused, so the CLI checks it before importing torch (repack/source_config.py) and answers at once. Each reader is
its config plus the tensors: ``AwqSource`` and ``CompressedTensorsSource`` extend the classes here, GPTQ's reader
holds formats/quant_config.py's :class:`~repack.formats.quant_config.QuantConfig`; the checks are the same code
either way.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Callable

import regex

from .errors import RepackError
from .quant_config import parse_quant_config
from .schemes import GptqScheme as LinearScheme


class SourceFormatError(RepackError):
    """Tensors or a config that do not follow a source format's conventions; the message names what and where."""


# ----------------------------------------------------------------------------------------------------------- AWQ

AWQ_VERSIONS = ("gemm",)
AWQ_GROUP_SIZES = (32, 64, 128, -1)


class AwqConfig:
    """AWQ's quantization config (AutoAWQ's or GPTQModel's): one scheme for every linear but those named in
    ``modules_to_not_convert``; only the GEMM packing."""

    def __init__(self, raw: dict, where: str) -> None:
        self.raw = raw
        self.where = where
        bits = raw.get("bits", raw.get("w_bit"))
        group = raw.get("group_size", raw.get("q_group_size", 128))
        version = str(raw.get("version") or raw.get("format") or "gemm").lower()
        if version not in AWQ_VERSIONS:
            raise SourceFormatError(
                f"{where}: AWQ version {version!r} is not supported (only the GEMM packing: version 'gemm'); save the "
                "model with AutoAWQ's GEMM kernel or GPTQModel's FORMAT.GEMM"
            )
        if bits != 4:
            raise SourceFormatError(f"{where}: {bits}-bit AWQ is not supported (AWQ GEMM packs 4 bits); re-quantize")
        if group not in AWQ_GROUP_SIZES:
            raise SourceFormatError(
                f"{where}: AWQ group_size {group!r} is not supported; supported: {', '.join(map(str, AWQ_GROUP_SIZES))}"
            )
        sym = raw.get("sym", not raw.get("zero_point", True))
        self.scheme = LinearScheme(bits=4, group_size=int(group), sym=bool(sym), checkpoint_format="awq")
        skip = raw.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(entry, str) for entry in skip):
            raise SourceFormatError(f"{where}: modules_to_not_convert must be a list of module names, not {skip!r}")
        self.not_converted = skip

    def scheme_for(self, module: str) -> LinearScheme | None:
        # AutoAWQ (and transformers' AWQ loader) skips a module when any entry is a substring of its name.
        if any(entry and entry in module for entry in self.not_converted):
            return None
        return self.scheme

    def base_scheme(self) -> LinearScheme:
        return self.scheme

    def describe(self) -> str:
        return f"awq (gemm) 4-bit group {self.scheme.group_size}"


# ------------------------------------------------------------------------------------------- compressed-tensors

PACKED_FORMAT = "pack-quantized"
STRATEGIES = ("group", "channel")
CT_BITS = (4, 8)
CT_GROUP_SIZES = (32, 64, 128)
LINEAR_CLASS = "Linear"
REGEX_SECONDS = 5.0


class CompressedTensorsConfig:
    """compressed-tensors' quantization config: ``config_groups`` (targets and weight arguments), ``ignore``, and
    what a model saved otherwise than dense and compressed says about itself."""

    def __init__(self, raw: dict, where: str) -> None:
        self.raw = raw
        self.where = where
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise SourceFormatError(f"{where}: compressed-tensors config has no config_groups; not a quantized model")
        status = raw.get("quantization_status", "compressed")
        if status != "compressed":
            raise SourceFormatError(
                f"{where}: quantization_status is {status!r}, not 'compressed'; save the model with "
                "save_compressed=True"
            )
        for key, what in (("sparsity_config", "sparsity compression"), ("transform_config", "weight transforms")):
            value = raw.get(key) or {}
            if value and not (key == "sparsity_config" and value.get("format") in (None, "dense")):
                raise SourceFormatError(
                    f"{where}: {key} is set ({what}, {reprlib.repr(value)}); repack takes dense pack-quantized weights "
                    "only, re-quantize without it"
                )
        # Why a budget: the regexes come from the checkpoint; one with nested quantifiers can backtrack for hours.
        self.regex_seconds_left = REGEX_SECONDS
        self.groups = [self._group(name, group) for name, group in groups.items()]
        self.ignore = [_pattern(entry, f"{where} ignore") for entry in _strings(raw.get("ignore") or [], where)]

    def _group(self, name: str, group: object) -> tuple[list, LinearScheme | str]:
        """(target patterns, scheme) of one config group; the scheme is a reason string where we cannot read it,
        refused only if a stored linear uses the group."""
        where = f"{self.where} config_groups.{name}"
        if not isinstance(group, dict):
            raise SourceFormatError(f"{where}: must be an object, not {reprlib.repr(group)}")
        targets = [_pattern(entry, f"{where}.targets") for entry in _strings(group.get("targets") or [], where)]
        return targets, _scheme(group, str(group.get("format") or self.raw.get("format") or ""), where)

    def _matches(self, pattern, module: str) -> bool:
        if isinstance(pattern, str):
            return pattern in (module, LINEAR_CLASS)
        start = time.monotonic()
        try:
            return pattern.match(module, timeout=max(self.regex_seconds_left, 1e-3)) is not None
        except TimeoutError:
            raise SourceFormatError(
                f"{self.where}: regex {pattern.pattern!r} takes too long to match module names (nested quantifiers "
                "backtrack); simplify it"
            ) from None
        finally:
            self.regex_seconds_left -= time.monotonic() - start

    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of the config group whose target matches ``module`` most specifically (an exact name, then a
        regex, then the class name "Linear": compressed-tensors' own precedence); None when ignored or untargeted."""
        if any(self._matches(pattern, module) for pattern in self.ignore):
            return None
        best: tuple[int, LinearScheme | str] | None = None
        for targets, scheme in self.groups:
            ranks = [_specificity(pattern) for pattern in targets if self._matches(pattern, module)]
            if ranks and (best is None or min(ranks) < best[0]):
                best = (min(ranks), scheme)
        if best is None:
            return None
        if isinstance(best[1], str):
            raise SourceFormatError(f"{module}: {best[1]}")
        return best[1]

    def base_scheme(self) -> LinearScheme | None:
        return next((scheme for _, scheme in self.groups if not isinstance(scheme, str)), None)

    def describe(self) -> str:
        schemes = {s for _, s in self.groups if not isinstance(s, str)}
        parts = sorted(f"{s.bits}-bit {'channel' if s.group_size == -1 else f'group {s.group_size}'}"
                       f"{'' if s.sym else ' asym'}" for s in schemes)  # fmt: skip
        return f"compressed-tensors (pack-quantized) {', '.join(parts)}"


def _specificity(pattern) -> int:
    """0 for an exact module name, 1 for a regex, 2 for the class name "Linear"."""
    if isinstance(pattern, str):
        return 2 if pattern == LINEAR_CLASS else 0
    return 1


def _strings(entries: object, where: str) -> list[str]:
    if isinstance(entries, str):
        entries = [entries]
    if not isinstance(entries, list) or not all(isinstance(entry, str) for entry in entries):
        raise SourceFormatError(f"{where}: expected a list of module names or 're:' patterns, not "
                                f"{reprlib.repr(entries)}")  # fmt: skip
    return entries


def _pattern(entry: str, where: str):
    """An exact name (or the class name "Linear") as a string, a ``re:`` entry as a compiled regex."""
    if not entry.startswith("re:"):
        return entry
    try:
        return regex.compile(entry[3:])
    except (regex.error, ValueError) as error:
        raise SourceFormatError(f"{where}: {entry!r} is not a valid regex ({error})") from None


def _scheme(group: dict, fmt: str, where: str) -> LinearScheme | str:
    """The linear scheme of one config group, or why it cannot be converted (one line)."""
    weights = group.get("weights")
    if not isinstance(weights, dict):
        return f"{where} quantizes no weights (weights is {reprlib.repr(weights)}); nothing for repack to pack"
    if group.get("input_activations"):
        return (f"{where} also quantizes activations (input_activations set); repack takes weight-only W4A16 / "
                "W8A16 schemes")  # fmt: skip
    if fmt != PACKED_FORMAT:
        return f"{where}: format {fmt!r} is not supported (only {PACKED_FORMAT!r}); save with save_compressed=True"
    if weights.get("type", "int") != "int":
        return f"{where}: weight type {weights.get('type')!r} is not supported (integer weights only)"
    bits = weights.get("num_bits")
    if bits not in CT_BITS:
        return f"{where}: {bits}-bit weights are not supported; supported: {', '.join(map(str, CT_BITS))}"
    if weights.get("dynamic"):
        return f"{where}: dynamic weight quantization is not supported"
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        return f"{where}: weight strategy {strategy!r} is not supported; supported: {', '.join(STRATEGIES)}"
    group_size = -1
    if strategy == "group":
        group_size = weights.get("group_size")
        if group_size not in CT_GROUP_SIZES:
            return (f"{where}: group_size {group_size!r} is not supported; supported: "
                    f"{', '.join(map(str, CT_GROUP_SIZES))}")  # fmt: skip
    sym = weights.get("symmetric", True)
    return LinearScheme(bits=int(bits), group_size=int(group_size), sym=bool(sym), checkpoint_format=PACKED_FORMAT)


# --------------------------------------------------------------------------------------------- which format

# quant_method -> its config's parser; formats/sources/__init__.py keys its readers the same (a test holds them so).
CONFIGS: dict[str, Callable[[dict, str], object]] = {
    "gptq": parse_quant_config,
    "awq": AwqConfig,
    "compressed-tensors": CompressedTensorsConfig,
}
SOURCE_METHODS = tuple(CONFIGS)


def source_method(raw: dict | None, where: str) -> str:
    """The source format a quantization config ``raw`` (read from ``where``) is in; one line when there is none we
    read (no config: not a quantized checkpoint; another quant_method)."""
    if raw is None:
        raise SourceFormatError(
            f"{where}: no quantization_config in config.json and no quantize_config.json: this is not a quantized "
            "checkpoint (fp16/bf16?); quantize it first (GPTQ, AWQ or compressed-tensors W4A16)"
        )
    if not isinstance(raw, dict):
        raise SourceFormatError(f"{where}: quantization_config must be an object; fix config.json")
    method = str(raw.get("quant_method") or "gptq").lower()
    if method not in CONFIGS:
        raise SourceFormatError(
            f"{where}: quant_method is {raw.get('quant_method')!r}; supported source formats: "
            f"{', '.join(SOURCE_METHODS)} (re-quantize with one of them)"
        )
    return method


def parse_source_config(raw: dict | None, where: str) -> object:
    """``raw`` parsed by its format's config class: every refusal a config alone decides, without a tensor."""
    return CONFIGS[source_method(raw, where)](raw, where)
