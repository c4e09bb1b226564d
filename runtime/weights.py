"""The tensors of one expert stack as the kernels see them: the format's tensors, nothing recomputed."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from repack.formats.stacks import GPTQ_ORDER, MMA_ORDERS, STACK_TENSORS, TILE_ROWS, TILES_ORDER, StackInfo


@dataclass
class MoeWeights:
    """One stack of E experts in the repack-moe layout (formats/SPEC.md), on one device.

    Every field is a tensor exactly as stored in the checkpoint (or a view of one); ``None`` where the
    format omits it (zeros for symmetric schemes, perms without act-order). A routed stack joined with its
    shared chunks (:func:`join_adjacent`) is one such stack too, with ``routed_experts`` set.
    """

    w13_qweight: torch.Tensor  # int32 [E, 2I, H/pack]; "mma128_tiles": [E, 2I/64, H/128, 64, 16]
    w13_scales: torch.Tensor  # fp16 [E, G1, 2I]
    w2_qweight: torch.Tensor  # int32 [E, H, I/pack]; "mma128_tiles": [E, H/64, I/128, 64, 16]
    w2_scales: torch.Tensor  # fp16 [E, G2, H]
    bits: int
    group_size: int  # -1: one group over the whole input
    w13_zeros: torch.Tensor | None = None  # uint8 [E, G1, 2I]
    w2_zeros: torch.Tensor | None = None  # uint8 [E, G2, H]
    w13_perm: torch.Tensor | None = None  # int32 [E, H]
    word_order: str = GPTQ_ORDER  # where each input sits in the words: formats.stacks.WORD_ORDERS (SPEC.md section 3)
    # Set on a routed stack joined with its shared chunks (join_adjacent): the routed experts come first, the
    # shared chunks are experts routed_experts..E-1. Kernel configs are tuned per routed stack, so they are
    # looked up by this count (runtime/fused_moe.get_config).
    routed_experts: int | None = None

    @property
    def mma_order(self) -> bool:
        """The words hold the mma128 nibble order, in rows or in tiles (the weight-major, Gluon and decode kernels
        read it; nothing else does)."""
        return self.word_order in MMA_ORDERS

    @property
    def tiled(self) -> bool:
        """The words are stored in tiles of 64 rows x one 128-input block ("mma128_tiles"; kernels address them
        through kernels.common.word_strides)."""
        return self.word_order == TILES_ORDER

    @property
    def num_experts(self) -> int:
        return int(self.w13_qweight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w2_qweight.shape[1]) * (TILE_ROWS if self.tiled else 1)

    @property
    def intermediate_size(self) -> int:
        return int(self.w13_qweight.shape[1]) * (TILE_ROWS if self.tiled else 1) // 2

    def group_len(self, k: int) -> int:
        """Inputs per scale row of a projection with ``k`` inputs: the group, or all of K for group size -1."""
        return k if self.group_size == -1 else self.group_size

    @property
    def sym(self) -> bool:
        return self.w13_zeros is None

    @property
    def config_experts(self) -> int:
        """The expert count the kernel config tables are keyed by: the routed stack's, also when joined."""
        return self.routed_experts if self.routed_experts is not None else self.num_experts

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


# The stack tensors MoeWeights holds, in the format's order (w2_perm only serves the inverse: not loaded here).
TENSOR_FIELDS = tuple(kind for kind in STACK_TENSORS if kind in {f.name for f in fields(MoeWeights)})


def join_adjacent(routed: MoeWeights, shared: MoeWeights) -> MoeWeights | None:
    """The routed stack extended by the shared chunks as one stack of E + C experts, or None if it cannot be a view.

    Why: one fused_moe call over all E + C experts (each token takes its top-k plus the C shared chunks) replaces
    the block's second call. Built only from views: every tensor of ``shared`` must start where the routed tensor
    of the same kind ends in the same storage (the converter writes joinable stacks that way, formats/SPEC.md
    section 5), and both stacks must be read alike (bits, group size, word order, which tensors exist). Anything
    else (older checkpoints, stacks loaded into separate buffers) gives None, and the caller runs two calls;
    nothing is ever copied.
    """
    if routed.routed_experts is not None or shared.routed_experts is not None:
        return None
    if (routed.bits, routed.group_size, routed.word_order) != (shared.bits, shared.group_size, shared.word_order):
        return None
    joined = {}
    for kind in TENSOR_FIELDS:
        first, second = getattr(routed, kind), getattr(shared, kind)
        if first is None and second is None:
            continue
        view = stacked_view(first, second) if first is not None and second is not None else None
        if view is None:
            return None
        joined[kind] = view
    return replace(routed, **joined, routed_experts=routed.num_experts)


def stacked_view(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor | None:
    """``[E1 + E2, ...]``: a view of two contiguous stacks that lie back to back in one storage, else None."""
    same_kind = first.dtype == second.dtype and first.device == second.device and first.shape[1:] == second.shape[1:]
    if not (same_kind and first.dim() > 0 and first.is_contiguous() and second.is_contiguous()):
        return None
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None
    if second.data_ptr() != first.data_ptr() + first.nbytes:
        return None
    flat = first.as_strided((first.numel() + second.numel(),), (1,))  # same storage offset as ``first``
    return flat.view(first.shape[0] + second.shape[0], *first.shape[1:])
