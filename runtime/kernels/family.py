"""What a kernel family declares, so runtime/fused_moe.py chooses among the families by asking them.

Each family module of runtime/kernels/ (decode, gluon_sm90, weight_major, gptq_order) exports ``FAMILY``, one
:class:`KernelFamily`: what it can run (:meth:`~KernelFamily.supports`), the config it takes a call with
(:meth:`~KernelFamily.configure`), its config for a call nobody tuned (:meth:`~KernelFamily.heuristic`), whether it
works on per-expert row blocks (:meth:`~KernelFamily.block_rows`), which top-k sum it does (:attr:`~KernelFamily.
topk_sum`) and its launches (:meth:`~KernelFamily.run`). A new family is one module and one place in
fused_moe.FAMILIES, the ordered list fused_moe walks.

A fused_moe call, stage by stage (the shape of vLLM's modular fused-MoE kernel: a prepare and a finalize step around
an experts step whose implementations say what they support and which reduction they leave):

1. plan: the config's family (the tuned or heuristic one's without a config) where it takes the call, else the first
   family of fused_moe.FAMILIES that runs other families' tiles (:attr:`~KernelFamily.runs_tl_tiles`) and takes it;
2. prepare: for a family with row blocks, the (token, expert) pairs sorted into them (kernels/align.py), with the
   routing inside that launch where it fits; else the routing inside the family's first launch where it can
   (:meth:`~KernelFamily.routes_in_first_launch`), or a routing launch of its own;
3. experts: :meth:`~KernelFamily.run`, w13 then w2;
4. finalize: the top-k sum, by the family itself or by fused_moe as ``config.reduce`` says (:class:`TopkSum`).

Dimension letters: runtime/kernels/__init__.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from enum import Enum
from typing import ClassVar

import torch

from repack.runtime.kernel_config import Family, KernelConfig
from repack.runtime.kernels.align import Alignment
from repack.runtime.weights import MoeWeights


class TopkSum(str, Enum):
    """Who sums each token's top-k rows."""

    IN_W2 = "in_w2"  # the family's w2 adds them itself and writes ``out`` (decode: fp32 adds, the last one writes)
    BY_REDUCE = "by_reduce"  # w2 writes what ``config.reduce`` asks for; fused_moe sets up the target, sums after


@dataclass(frozen=True)
class Call:
    """What a family is asked about one call."""

    weights: MoeWeights
    device: torch.device
    dtype: torch.dtype  # the activations'
    num_pairs: int  # (token, expert) pairs: M * top_k


@dataclass
class Work:
    """One call's tensors, as the experts stage gets them."""

    x: torch.Tensor  # [M, H] fp16/bf16, unit stride along H
    weights: MoeWeights
    topk_ids: torch.Tensor  # [M, T] int32/int64, contiguous
    topk_weights: torch.Tensor  # [M, T] fp32
    out: torch.Tensor  # [M, H] activation dtype: the result
    rows: Alignment | None = None  # the pairs sorted into row blocks (families with block_rows)
    # TopkSum.BY_REDUCE: where w2 writes: [P, H] rows ("pairs", or ``out`` itself at top-1; "last": w2 also sums
    # them into ``out``), [M, H] fp32 ("atomic") or ``out`` ("out"), zeroed by fused_moe unless the family clears it
    # (clears_target)
    target: torch.Tensor | None = None
    routing: tuple[torch.Tensor, bool] | None = None  # (router logits [M, E], renormalize): route in the first launch


class KernelFamily(ABC):
    """One kernel family, as fused_moe sees it. Subclasses set the class attributes and implement the three
    abstract methods; the defaults take configs that name the family, with the family's own rows per block."""

    family: ClassVar[Family]
    topk_sum: ClassVar[TopkSum]
    clears_target: ClassVar[bool] = False  # w13 zeroes the target that w2 adds into, so fused_moe does not
    runs_tl_tiles: ClassVar[bool] = False  # takes another family's tl tile where that family cannot run a call
    interpreted: ClassVar[bool] = True  # its kernels run in Triton's interpreter (tl): the CPU-tested references
    # the config.reduce values its w2 writes (TopkSum.BY_REDUCE); fused_moe runs any other as "pairs"
    reduce_modes: ClassVar[tuple[str, ...]] = ("pairs", "atomic", "out")

    @abstractmethod
    def supports(self, call: Call) -> bool:
        """Whether these kernels can run the call at all: the stack (bits, word order, sizes, groups), the device."""

    @abstractmethod
    def heuristic(self, call: Call) -> KernelConfig | None:
        """The config for a call nobody tuned, or None where another family should take it (fused_moe asks the
        families in order and takes the first config)."""

    @abstractmethod
    def run(self, work: Work, config: KernelConfig) -> None:
        """The launches of w13 and w2 for ``work`` under a config :meth:`configure` returned."""

    def asked_by(self, config: KernelConfig) -> bool:
        """Whether ``config`` asks for this family (fused_moe tries the families a config asks for first)."""
        return config.family is self.family

    def configure(self, config: KernelConfig, call: Call) -> KernelConfig | None:
        """The config this family runs ``call`` with, from ``config`` (its own, or another family's tl tile where
        :attr:`runs_tl_tiles`: a Gluon tile stays behind), or None where it cannot run the call."""
        return replace(config, family=self.family, gluon=None) if self.supports(call) else None

    def block_rows(self, config: KernelConfig) -> int | None:
        """Rows per per-expert block its kernels work on (kernels/align.py), or None: one program per pair."""
        return config.block_m

    def routes_in_first_launch(self, weights: MoeWeights) -> bool:
        """Whether its first launch can route the tokens itself (``Work.routing``), saving the routing launch."""
        return False
