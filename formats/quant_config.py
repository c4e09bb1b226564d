"""The source's GPTQ quantization config: which modules are quantized, and with which scheme.

GPTQModel's ``dynamic`` maps regexes over full module names to overrides: a ``-:`` key means "not
quantized"; a ``+:`` or bare key overrides ``bits`` / ``group_size`` / ``sym`` for matching modules. The
first matching rule wins (GPTQModel's order). ``modules_in_block_to_quantize`` lists, per decoder block,
the module names (relative to ``model.layers.{i}``) that were quantized; anything else was not.
"""

from __future__ import annotations

import re
import reprlib
import time
from dataclasses import dataclass, field

import regex

from repack.formats.errors import RepackError
from repack.formats.schemes import CHECKPOINT_FORMATS, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, GptqScheme

try:  # Python's own regex parser: a private module, stable in shape since 3.5 (sre_parse before 3.11)
    from re import _constants as _sre_constants
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_constants
    import sre_parse as _sre_parse

_REPEATS = {_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT, getattr(_sre_constants, "POSSESSIVE_REPEAT", None)}

_LAYER_PREFIX = re.compile(r"^.*?layers\.\d+\.")
# A converted checkpoint's non-expert GPTQ linears: copied from a GPTQ source (its own config describes them), or
# converted from another source format into GPTQ tensors with v2 zero points, described by this key's config.
DENSE_CONFIG_KEY = "linear_quantization_config"
DENSE_LINEAR_FORMAT = "gptq_v2"
SOURCE_CONFIG_KEY = "source_quantization_config"
REGEX_SECONDS = 5.0
# What all ``dynamic`` regexes of a config may cost to compile, in pattern elements after counted repeats are
# expanded (the regex module compiles `a{1000}` as a thousand copies: about 250 bytes each, measured). Real rules
# (`.*\.experts\.\d+\..*`) are tens; this is a few MB.
REGEX_COMPILE_UNITS = 20_000


@dataclass
class DynamicRule:
    quantized: bool
    pattern: regex.Pattern
    overrides: dict


@dataclass
class QuantConfig:
    raw: dict
    where: str  # file the config came from, for messages
    base: GptqScheme
    rules: list[DynamicRule] = field(default_factory=list)
    block_modules: list[str] | None = None
    # Why a budget: ``dynamic`` regexes come from the checkpoint, and one with nested quantifiers can backtrack
    # for hours on a long module name; all matching of one config gets this many seconds in all.
    regex_seconds_left: float = field(default_factory=lambda: REGEX_SECONDS)

    def scheme_for(self, module: str) -> GptqScheme | None:
        """The scheme of one module (full name), or None when the config says it is not quantized."""
        if self.block_modules is not None:
            relative = _LAYER_PREFIX.sub("", module, count=1)
            if not any(_module_matches(entry, relative) for entry in self.block_modules):
                return None
        for rule in self.rules:
            if self._matches(rule, module):
                if not rule.quantized:
                    return None
                return _make_scheme(
                    {**self._base_dict(), **rule.overrides}, f"{self.where} dynamic[{rule.pattern.pattern!r}]"
                )
        return self.base

    def _matches(self, rule: DynamicRule, module: str) -> bool:
        start = time.monotonic()
        try:
            return rule.pattern.match(module, timeout=max(self.regex_seconds_left, 1e-3)) is not None
        except TimeoutError:
            raise RepackError(
                f"{self.where}: dynamic rule {rule.pattern.pattern!r} takes too long to match module names "
                "(nested quantifiers backtrack); simplify the regex"
            ) from None
        finally:
            self.regex_seconds_left -= time.monotonic() - start

    def _base_dict(self) -> dict:
        return {
            "bits": self.base.bits,
            "group_size": self.base.group_size,
            "sym": self.base.sym,
            "checkpoint_format": self.base.checkpoint_format,
        }


def _module_matches(entry: str, relative: str) -> bool:
    """``mlp.experts.#.gate_proj`` / ``mlp.experts.{expert}.gate_proj`` style entries match any expert index."""
    if entry == relative:
        return True
    pattern = re.escape(entry).replace(r"\#", r"\d+").replace(r"\{expert\}", r"\d+")
    return re.fullmatch(pattern, relative) is not None


def _make_scheme(values: dict, where: str) -> GptqScheme:
    bits, group, sym = values.get("bits"), values.get("group_size", 128), values.get("sym", True)
    if bits not in SUPPORTED_BITS:
        raise RepackError(
            f"{where}: {bits}-bit GPTQ is not supported; supported bits: "
            f"{', '.join(map(str, SUPPORTED_BITS))} (re-quantize with bits=4)"
        )
    if group not in SUPPORTED_GROUP_SIZES:
        raise RepackError(
            f"{where}: group_size {group} is not supported; supported: "
            f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))} (re-quantize with one of them)"
        )
    if not isinstance(sym, bool):  # a string "false" would read as true
        raise RepackError(f"{where}: sym {sym!r} is not a JSON boolean; write true or false")
    # GPTQModel writes the zero-point convention as `checkpoint_format`; `format` is its older synonym.
    declared = {key: values[key] for key in ("checkpoint_format", "format") if values.get(key)}
    for key, value in declared.items():
        if not isinstance(value, str):
            raise RepackError(f"{where}: {key} {value!r} is not a string; write one of {', '.join(CHECKPOINT_FORMATS)}")
    if len(set(declared.values())) > 1:
        raise RepackError(
            f"{where}: checkpoint_format {declared['checkpoint_format']!r} and format {declared['format']!r} "
            "disagree; fix one of them (gptq = v1 zero points, gptq_v2 = stored as is)"
        )
    fmt = next(iter(declared.values()), "gptq")
    if fmt not in CHECKPOINT_FORMATS:
        raise RepackError(
            f"{where}: checkpoint_format {fmt!r} is not supported; supported: {', '.join(CHECKPOINT_FORMATS)} "
            "(save the model in GPTQ format)"
        )
    return GptqScheme(bits=int(bits), group_size=int(group), sym=sym, checkpoint_format=fmt)


def parse_quant_config(raw: dict | None, where: str) -> QuantConfig:
    """Validate that ``raw`` is a GPTQ config we can convert, and parse its scheme and overrides."""
    if raw is None:
        raise RepackError(
            f"{where}: no quantization_config in config.json and no quantize_config.json: this is not a GPTQ "
            "checkpoint (fp16/bf16?); quantize it with GPTQModel first"
        )
    method = str(raw.get("quant_method", "")).lower()
    if method and method != "gptq":
        raise RepackError(
            f"{where}: quant_method is {raw.get('quant_method')!r}, not 'gptq'; only GPTQ checkpoints are "
            "supported (re-quantize with GPTQModel)"
        )
    if not method and "bits" not in raw:
        raise RepackError(f"{where}: quantization config has neither quant_method nor bits; not a GPTQ checkpoint")
    base = _make_scheme(raw, where)
    rules = _dynamic_rules(raw.get("dynamic"), where)
    block_modules = _block_modules(raw.get("modules_in_block_to_quantize"), where)
    return QuantConfig(raw=raw, where=where, base=base, rules=rules, block_modules=block_modules)


def _dynamic_rules(dynamic: object, where: str) -> list[DynamicRule]:
    """GPTQModel's ``dynamic``: an object of regex -> overrides (an object; anything for a ``-:`` rule)."""
    if not dynamic:
        return []
    if not isinstance(dynamic, dict):
        raise RepackError(
            f"{where}: dynamic must be an object of regex -> overrides, not a {type(dynamic).__name__}; fix it"
        )
    rules = []
    budget = REGEX_COMPILE_UNITS
    for key, overrides in dynamic.items():
        quantized = not key.startswith("-:")
        if quantized and not isinstance(overrides, dict | None):
            raise RepackError(
                f"{where}: dynamic rule {key!r} must map to an object of overrides, not a {type(overrides).__name__}"
            )
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        budget -= _compile_units(pattern, key, where)
        if budget < 0:
            raise RepackError(
                f"{where}: dynamic rule {key!r} makes the dynamic regexes too large to compile (over "
                f"{REGEX_COMPILE_UNITS} elements with counted repeats expanded); simplify the regex"
            )
        try:
            compiled = regex.compile(pattern)
        except (regex.error, ValueError, TypeError) as error:
            raise RepackError(f"{where}: dynamic rule {key!r} is not a valid regex ({error})") from None
        rules.append(DynamicRule(quantized, compiled, dict(overrides or {}) if quantized else {}))
    return rules


def _compile_units(pattern: str, key: str, where: str) -> int:
    """Elements of ``pattern`` once its counted repeats are expanded, from Python's own regex parser (which builds
    a tree, not the expansion): what compiling it costs, known before compiling it. GPTQModel matches ``dynamic``
    with Python's ``re``, so a pattern that ``re`` cannot parse is no valid rule either."""
    try:
        parsed = _sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError, TypeError) as error:
        raise RepackError(f"{where}: dynamic rule {key!r} is not a valid regex ({error})") from None
    return _units(parsed)


def _units(node: object) -> int:
    """Expanded size of a parsed pattern (``sre_parse.SubPattern``), or of anything inside one that holds them."""
    if isinstance(node, _sre_parse.SubPattern):
        return max(1, sum(_item_units(op, argument) for op, argument in node))
    if isinstance(node, (list, tuple)):
        return sum(_units(item) for item in node)
    return 0


def _item_units(op: object, argument: object) -> int:
    if op in _REPEATS:
        low, high, body = argument
        copies = low + 1 if high == _sre_constants.MAXREPEAT else high
        return max(copies, 1) * _units(body)
    return 1 + _units(argument)


def _block_modules(block: object, where: str) -> list[str] | None:
    """``modules_in_block_to_quantize``: a list of module names or of lists of them, flattened."""
    if not block:
        return None
    groups = block if isinstance(block, list) else []
    names = [name for group in groups for name in (group if isinstance(group, list) else [group])]
    if not groups or not all(isinstance(name, str) for name in names):
        raise RepackError(
            f"{where}: modules_in_block_to_quantize must be a list of module names (or of lists of them), not "
            f"{reprlib.repr(block)}; fix it"
        )
    return names


def dense_linear_config(repack_quant: dict) -> dict | None:
    """The GPTQ config that a converted checkpoint's non-expert GPTQ linears are read with, from its
    ``quantization_config`` (formats/SPEC.md section 4): ``linear_quantization_config`` when the source was not GPTQ,
    else the source's own config."""
    return repack_quant.get(DENSE_CONFIG_KEY) or repack_quant.get(SOURCE_CONFIG_KEY)
