"""GPTQ (GPTQModel, AutoGPTQ) as a source format: v1 (``checkpoint_format: "gptq"``) and v2 zero points,
act-order through ``g_idx``; the tensor conventions themselves are formats/gptq.py's.

GPTQ's qweight is already the canonical packing, so reading a linear moves no bits of its words: the zeros are
unpacked (and v1's ``+1`` applied on the whole word, as GPTQModel does), a symmetric scheme's zeros are checked
and dropped. Its non-expert linears are what the runtime's dense GPTQ linear reads, so they are copied through.
"""

from __future__ import annotations

import torch

from ..gptq import (
    GptqFormatError,
    GptqLinear,
    check_linear,
    check_zero_points,
    read_zero_points,
    write_zero_points,
)
from ..quant_config import QuantConfig, parse_quant_config
from .base import CanonicalLinear, LinearScheme, SourceFormat, TensorSource, meta_tensor


def symmetric_qzeros_word(scheme: LinearScheme) -> torch.Tensor:
    """The one int32 qzeros word a symmetric scheme stores everywhere (v1 4-bit: 0x77777777)."""
    zeros = torch.full((1, scheme.pack_factor), scheme.sym_zero, dtype=torch.uint8)
    return write_zero_points(zeros, scheme)


class GptqSource(SourceFormat):
    name = "gptq"
    marker = "qweight"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    required = ("qweight", "qzeros", "scales")
    stores_gptq_linears = True

    def __init__(self, raw: dict, where: str) -> None:
        super().__init__(raw, where)
        self.config: QuantConfig = parse_quant_config(raw, where)

    def scheme_for(self, module: str) -> LinearScheme | None:
        return self.config.scheme_for(module)

    def base_scheme(self) -> LinearScheme:
        return self.config.base

    def _gptq_linear(self, source: TensorSource, module: str, load) -> GptqLinear:
        g_idx = f"{module}.g_idx"
        return GptqLinear(
            qweight=meta_tensor(source, f"{module}.qweight"),
            qzeros=load(f"{module}.qzeros"),
            scales=load(f"{module}.scales"),
            g_idx=source.read(g_idx) if g_idx in source else None,
        )

    def header_linear(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        linear = self._gptq_linear(source, module, lambda name: meta_tensor(source, name))
        check_linear(module, linear, scheme)
        zeros = None if scheme.sym else torch.empty(tuple(linear.scales.shape), dtype=torch.uint8, device="meta")
        return CanonicalLinear(linear.qweight, linear.scales, zeros, linear.g_idx)

    def read_small(self, source: TensorSource, module: str, scheme: LinearScheme) -> CanonicalLinear:
        linear = self._gptq_linear(source, module, source.read)
        check_linear(module, linear, scheme)
        if scheme.sym:
            if not bool((linear.qzeros == symmetric_qzeros_word(scheme)).all()):
                check_zero_points(module, linear, scheme)  # unpacks the zeros; explains the mismatch
            zeros = None
        else:
            zeros = read_zero_points(linear.qzeros, scheme)
        return CanonicalLinear(linear.qweight, linear.scales, zeros, linear.g_idx)

    def read_qweight(self, source: TensorSource, module: str, scheme: LinearScheme) -> torch.Tensor:
        return source.read(f"{module}.qweight")

    def write(self, module: str, linear: CanonicalLinear, scheme: LinearScheme, like: TensorSource) -> dict:
        return gptq_tensors(module, linear, scheme)

    def describe(self) -> str:
        base = self.config.base
        return f"gptq ({base.checkpoint_format}) {base.bits}-bit group {base.group_size}"


def gptq_tensors(module: str, linear: CanonicalLinear, scheme: LinearScheme) -> dict[str, torch.Tensor]:
    """A canonical linear as GPTQ tensors of ``scheme.checkpoint_format`` ("gptq" or "gptq_v2")."""
    if scheme.checkpoint_format not in ("gptq", "gptq_v2"):
        raise GptqFormatError(f"{module}: cannot write GPTQ zero points as {scheme.checkpoint_format!r}")
    zeros = linear.zeros
    if zeros is None:
        zeros = torch.full(tuple(linear.scales.shape), scheme.sym_zero, dtype=torch.uint8)
    out = {
        f"{module}.qweight": linear.qweight.contiguous(),
        f"{module}.qzeros": write_zero_points(zeros.contiguous(), scheme),
        f"{module}.scales": linear.scales.contiguous(),
    }
    if linear.g_idx is not None:
        out[f"{module}.g_idx"] = linear.g_idx.contiguous()
    return out


def canonical_from_gptq(linear: GptqLinear, scheme: LinearScheme) -> CanonicalLinear:
    """A GPTQ linear's tensors (in memory) as a canonical linear: zeros read with ``scheme``'s convention."""
    zeros = None if scheme.sym else read_zero_points(linear.qzeros, scheme)
    return CanonicalLinear(linear.qweight, linear.scales, zeros, linear.g_idx)
