"""The quantization scheme of a linear (bits, group size, symmetry, the source's zero-point convention) and the GPTQ
values it may take.

Why a module of its own, free of torch: ``repack convert`` checks a source's quantization config before it imports
torch (repack/source_config.py), so a checkpoint it cannot convert is refused at once; the config readers
(formats/quant_config.py, formats/source_configs.py) build their schemes from this module alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import RepackError

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GptqFormatError(RepackError):
    """Tensors or config that do not follow the GPTQ conventions; the message names what and where."""


@dataclass(frozen=True)
class GptqScheme:
    """Quantization parameters shared by every quantized linear of a checkpoint (or one override)."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    checkpoint_format: str = "gptq"

    @property
    def pack_factor(self) -> int:
        """Values per int32 word."""
        return 32 // self.bits

    @property
    def max_q(self) -> int:
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        """The true zero point of a symmetric scheme: 8 for 4 bits, 128 for 8 bits."""
        return 1 << (self.bits - 1)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def group_len(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size
