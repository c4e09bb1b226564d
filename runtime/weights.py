"""The tensors of one expert stack as the kernels see them: the format's tensors, nothing recomputed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from repack.formats.repack_v1 import GPTQ_ORDER, MMA128_ORDER, StackInfo


@dataclass
class MoeWeights:
    """One stack of E experts in the repack-moe v1 layout (formats/SPEC.md), on one device.

    Every field is a tensor exactly as stored in the checkpoint (or a view of one); ``None`` where the
    format omits it (zeros for symmetric schemes, perms without act-order).
    """

    w13_qweight: torch.Tensor  # int32 [E, 2I, H/pack]
    w13_scales: torch.Tensor  # fp16 [E, G1, 2I]
    w2_qweight: torch.Tensor  # int32 [E, H, I/pack]
    w2_scales: torch.Tensor  # fp16 [E, G2, H]
    bits: int
    group_size: int  # -1: one group over the whole input
    w13_zeros: torch.Tensor | None = None  # uint8 [E, G1, 2I]
    w2_zeros: torch.Tensor | None = None  # uint8 [E, G2, H]
    w13_perm: torch.Tensor | None = None  # int32 [E, H]
    word_order: str = GPTQ_ORDER  # where each input sits in the words: GPTQ_ORDER or MMA128_ORDER (SPEC.md section 3)

    @property
    def mma_order(self) -> bool:
        """The words are in the mma128 order (the weight-major and decode kernels read it; nothing else does)."""
        return self.word_order == MMA128_ORDER

    @property
    def num_experts(self) -> int:
        return int(self.w13_qweight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w2_qweight.shape[1])

    @property
    def intermediate_size(self) -> int:
        return int(self.w13_qweight.shape[1]) // 2

    @property
    def sym(self) -> bool:
        return self.w13_zeros is None

    @classmethod
    def from_tensors(cls, info: StackInfo, tensors: dict[str, torch.Tensor]) -> MoeWeights:
        """Pick a stack's tensors out of ``tensors`` (keyed by full checkpoint name) without touching them."""
        get = lambda n: tensors.get(f"{info.prefix}.{n}")  # noqa: E731
        return cls(
            w13_qweight=get("w13_qweight"),
            w13_scales=get("w13_scales"),
            w2_qweight=get("w2_qweight"),
            w2_scales=get("w2_scales"),
            bits=info.bits,
            group_size=info.group_size,
            w13_zeros=get("w13_zeros"),
            w2_zeros=get("w2_zeros"),
            w13_perm=get("w13_perm"),
            word_order=info.word_order,
        )
