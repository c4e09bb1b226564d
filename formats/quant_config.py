"""The source's GPTQ quantization config: which modules are quantized, and with which scheme.

GPTQModel's ``dynamic`` maps regexes over full module names to overrides: a ``-:`` key means "not
quantized"; a ``+:`` or bare key overrides ``bits`` / ``group_size`` / ``sym`` for matching modules. The
first matching rule wins (GPTQModel's order). ``modules_in_block_to_quantize`` lists, per decoder block,
the module names (relative to ``model.layers.{i}``) that were quantized; anything else was not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from repack.formats.errors import RepackError
from repack.formats.gptq import CHECKPOINT_FORMATS, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, GptqScheme

_LAYER_PREFIX = re.compile(r"^.*?layers\.\d+\.")


@dataclass
class DynamicRule:
    quantized: bool
    pattern: re.Pattern
    overrides: dict


@dataclass
class QuantConfig:
    raw: dict
    where: str  # file the config came from, for messages
    base: GptqScheme
    rules: list[DynamicRule] = field(default_factory=list)
    block_modules: list[str] | None = None

    def scheme_for(self, module: str) -> GptqScheme | None:
        """The scheme of one module (full name), or None when the config says it is not quantized."""
        if self.block_modules is not None:
            relative = _LAYER_PREFIX.sub("", module, count=1)
            if not any(_module_matches(entry, relative) for entry in self.block_modules):
                return None
        for rule in self.rules:
            if rule.pattern.match(module):
                if not rule.quantized:
                    return None
                return _make_scheme(
                    {**self._base_dict(), **rule.overrides}, f"{self.where} dynamic[{rule.pattern.pattern!r}]"
                )
        return self.base

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
    # GPTQModel writes the zero-point convention as `checkpoint_format`; `format` is its older synonym.
    declared = {key: values[key] for key in ("checkpoint_format", "format") if values.get(key)}
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
    return GptqScheme(bits=int(bits), group_size=int(group), sym=bool(sym), checkpoint_format=fmt)


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
    rules = []
    for key, overrides in (raw.get("dynamic") or {}).items():
        quantized = not key.startswith("-:")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise RepackError(f"{where}: dynamic rule {key!r} is not a valid regex ({error})") from None
        rules.append(DynamicRule(quantized, compiled, dict(overrides or {}) if quantized else {}))
    block = raw.get("modules_in_block_to_quantize")
    block_modules = (
        [name for group in block for name in ([group] if isinstance(group, str) else group)] if block else None
    )
    return QuantConfig(raw=raw, where=where, base=base, rules=rules, block_modules=block_modules)
