"""compressed-tensors (llm-compressor) as a source format: ``pack-quantized`` integer weights, activations unquantized.

One linear ``nn.Linear(in=K, out=N)`` stores:

- ``weight_packed`` int32 ``[N, K * b / 32]``: packed along the **input**; value ``q + 2^(b-1)`` (the signed value
  made unsigned) of input ``k = (32 / b) r + s`` sits in field ``s`` of word ``[n, r]`` (``pack_to_int32``);
- ``weight_scale`` ``[N, G]`` in the model's float dtype: G groups (strategy "group", ``group_size``) or 1 (strategy
  "channel");
- ``weight_zero_point`` int32 ``[N * b / 32, G]`` (asymmetric only): the signed zero points packed the same way but
  along the **output** dimension; a symmetric scheme stores none (its zero is 0, unsigned ``2^(b-1)``);
- ``weight_shape`` int64 ``[2]`` = ``[N, K]``; ``weight_g_idx`` int32 ``[K]`` with ``actorder: "group"``.

and ``W[n, k] = scale[n, g] * (q[n, k] - zp[n, g])``. Signed minus signed equals unsigned minus unsigned, so the
canonical values and zeros are the stored unsigned ones: the canonical qweight is ``weight_packed`` transposed, not a
field moved. Scales of another float dtype (bfloat16, float32) are taken where every value is a float16 exactly
(and written back in their own dtype), else refused: the format stores float16 scales.

Which linears are quantized, and how: each ``config_groups`` entry's ``targets`` (``"Linear"``, an exact module
name, or ``"re:<regex>"``) with its ``weights`` arguments, the most specific match winning; ``ignore`` (names or
``re:`` regexes) wins over every target.
"""

from __future__ import annotations

import reprlib
import time

import regex
import torch

from .base import (
    CanonicalLinear,
    LinearScheme,
    SourceFormat,
    SourceFormatError,
    TensorSource,
    check_tensor,
    meta_tensor,
)
from .words import pack_last, unpack_last

PACKED_FORMAT = "pack-quantized"
STRATEGIES = ("group", "channel")
CT_BITS = (4, 8)
CT_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LINEAR_CLASS = "Linear"
REGEX_SECONDS = 5.0


class CompressedTensorsSource(SourceFormat):
    name = "compressed-tensors"
    marker = "weight_packed"
    suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    required = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, raw: dict, where: str) -> None:
        super().__init__(raw, where)
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

    def _shapes(self, source: TensorSource, module: str, scheme: LinearScheme, shape: tuple[int, int] | None):
        """(K, N) after checking every stored tensor's dtype and shape; ``shape`` is weight_shape's value."""
        packed = meta_tensor(source, f"{module}.weight_packed")
        if packed.dim() != 2 or packed.dtype != torch.int32:
            raise SourceFormatError(
                f"{module}.weight_packed: expected a 2-D int32 tensor ([N, K*bits/32], pack-quantized), got "
                f"{str(packed.dtype).removeprefix('torch.')} {list(packed.shape)}"
            )
        n, words = (int(d) for d in packed.shape)
        k = words * scheme.pack_factor if shape is None else shape[1]
        if shape is not None and (shape[0] != n or k != words * scheme.pack_factor):
            raise SourceFormatError(
                f"{module}.weight_shape: says {shape[0]}x{shape[1]} (out x in) but weight_packed {list(packed.shape)} "
                f"holds {n} rows of {words * scheme.pack_factor} {scheme.bits}-bit inputs; inputs must fill whole "
                "int32 words and the shapes agree (re-export the checkpoint)"
            )
        if n % scheme.pack_factor:
            raise SourceFormatError(f"{module}.weight_packed: {n} outputs is not a multiple of {scheme.pack_factor}")
        groups = scheme.groups(k)
        why = f"a {k}x{n} {scheme.bits}-bit linear, group {scheme.group_size}"
        scale = meta_tensor(source, f"{module}.weight_scale")
        check_tensor(f"{module}.weight_scale", scale, (n, groups), SCALE_DTYPES, why)
        zero = f"{module}.weight_zero_point"
        if scheme.sym and zero in source:
            raise SourceFormatError(f"{zero}: present, but the config says symmetric (no zero point); fix the config")
        if not scheme.sym:
            if zero not in source:
                raise SourceFormatError(
                    f"{zero}: missing, but the config says asymmetric; the checkpoint is incomplete"
                )
            stored = meta_tensor(source, zero)
            check_tensor(zero, stored, (n // scheme.pack_factor, groups), (torch.int32,), why + ", packed along N")
        g_idx = f"{module}.weight_g_idx"
        if g_idx in source:
            check_tensor(g_idx, meta_tensor(source, g_idx), (k,), (torch.int32,), why)
        return k, n

    def _weight_shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        name = f"{module}.weight_shape"
        entry = source.entry(name)
        if tuple(entry.shape) != (2,) or entry.torch_dtype not in (torch.int64, torch.int32):
            raise SourceFormatError(
                f"{name}: expected an integer tensor of 2 entries [out, in], got {list(entry.shape)}"
            )
        n, k = (int(v) for v in source.read(name))
        return n, k

    def _g_idx(self, source: TensorSource, module: str, k: int, scheme: LinearScheme) -> torch.Tensor | None:
        name = f"{module}.weight_g_idx"
        if name not in source:
            return None
        g_idx = source.read(name)
        groups = scheme.groups(k)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise SourceFormatError(f"{name}: group ids must lie in [0, {groups}), found [{int(g_idx.min())}, "
                                    f"{int(g_idx.max())}]")  # fmt: skip
        return g_idx

    def header_linear(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        k, n = self._shapes(source, module, scheme, self._weight_shape(source, module))
        groups = scheme.groups(k)
        meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
        zeros = None if scheme.sym else meta((groups, n), torch.uint8)
        qweight = meta((k // scheme.pack_factor, n), torch.int32)
        return CanonicalLinear(qweight, meta((groups, n), torch.float16), zeros, self._g_idx(source, module, k, scheme))

    def read_small(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        k, n = self._shapes(source, module, scheme, self._weight_shape(source, module))
        scales = exact_float16(source.read(f"{module}.weight_scale"), f"{module}.weight_scale").t().contiguous()
        zeros = None
        if not scheme.sym:
            packed = source.read(f"{module}.weight_zero_point")
            zeros = unpack_last(packed.t().contiguous(), scheme.bits)  # [G, N], unsigned
        qweight = torch.empty((k // scheme.pack_factor, n), dtype=torch.int32, device="meta")
        return CanonicalLinear(qweight, scales, zeros, self._g_idx(source, module, k, scheme))

    def read_qweight(self, source: TensorSource, module: str, scheme: LinearScheme) -> torch.Tensor:
        return source.read(f"{module}.weight_packed").t().contiguous()

    def write(self, module: str, linear: CanonicalLinear, scheme: LinearScheme, like: TensorSource) -> dict:
        k, n = linear.in_features(scheme), linear.out_features
        scale_name, shape_name = f"{module}.weight_scale", f"{module}.weight_shape"
        scale_dtype = like.entry(scale_name).torch_dtype if scale_name in like else torch.float16
        shape_dtype = like.entry(shape_name).torch_dtype if shape_name in like else torch.int64
        out = {
            f"{module}.weight_packed": linear.qweight.t().contiguous(),
            scale_name: linear.scales.t().to(scale_dtype).contiguous(),
            shape_name: torch.tensor([n, k], dtype=shape_dtype),
        }
        if linear.zeros is not None:
            out[f"{module}.weight_zero_point"] = pack_last(linear.zeros, scheme.bits).t().contiguous()
        if linear.g_idx is not None:
            out[f"{module}.weight_g_idx"] = linear.g_idx.contiguous()
        return out

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


def exact_float16(scales: torch.Tensor, name: str) -> torch.Tensor:
    """``scales`` as float16, refused unless every value is a float16 exactly (so the inverse restores the bits)."""
    if scales.dtype == torch.float16:
        return scales
    half = scales.to(torch.float16)
    back = half.to(scales.dtype)
    if not torch.equal(back.view(torch.int16 if scales.itemsize == 2 else torch.int32),
                       scales.view(torch.int16 if scales.itemsize == 2 else torch.int32)):  # fmt: skip
        raise SourceFormatError(
            f"{name}: {str(scales.dtype).removeprefix('torch.')} scales that float16 cannot hold exactly (the format "
            "stores float16 scales); quantize the model in float16 (load it with dtype=torch.float16)"
        )
    return half
