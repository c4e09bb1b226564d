"""One rank's part of a stored stack under tensor or expert parallelism (vLLM's ``tensor_parallel_size``,
``enable_expert_parallel``), cut from the stack as stored: no repacking, no dequantization.

Tensor parallelism cuts every expert's intermediate size ``I`` into ``size`` equal slices; rank ``r`` keeps sorted
intermediate channels ``[r I/size, (r + 1) I/size)``:

- ``w13`` (rows: gate channels ``0..I-1``, then up channels ``I..2I-1``, both in w2's sorted order, formats/SPEC.md
  section 3): the rank's gate rows and its up rows, so gate and up stay paired in one ``[2 I/size, ...]`` tensor;
  ``w13_scales``/``w13_zeros`` follow on their last axis; ``w13_perm`` (act-order over ``H``) is whole on every rank.
- ``w2`` (rows: output channels ``H``; words along sorted ``I``): the rank's ``K`` slice of every row, its scales and
  zeros the slice's groups (whole when there is one group). The ranks' w2 products then sum to the full one
  (vLLM's all-reduce). ``w2_perm`` serves only ``repack verify``'s inverse and has no per-rank meaning: not cut.

A cut must fall on a group boundary (so each rank's scales are whole groups) and on a word boundary, for the
``mma128`` word orders on their 128-input blocks (formats/SPEC.md: the nibbles are permuted inside each block of 16
words; ``mma128_tiles`` cuts w13 between tiles of 64 rows, whole since the slice is a multiple of 128, and w2 between
the tiles of its K steps), else one RepackError line says so. Expert parallelism gives rank ``r`` the whole experts
``[r E/size, (r + 1) E/size)`` of a routed stack; ``E`` must divide evenly.

Under expert parallelism vLLM's router still picks among all E experts, and a rank's share of a token is the sum
over the pairs that landed on its experts: :class:`StackShard` gives such a rank one extra expert after its own,
all zeros (its scales 0, so its output is exactly 0), and the pairs routed to other ranks' experts go there
(:meth:`StackShard.id_map`), so the kernels run on in-range ids with nothing to skip.

:class:`StackShard` is one rank's plan for one stored stack, what the vLLM plugin's experts method follows: the
parameters' shapes (:meth:`StackShard.shapes`) and the cut of each stored tensor as it arrives whole
(:meth:`StackShard.cut`). Pure torch (no vLLM): tests/runtime/test_vllm_sharding.py checks every cut against
the dequantized full stack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from repack.formats.errors import RepackError
from repack.formats.stacks import MMA_ORDERS, ROUTED, TILE_ROWS, TILES_ORDER, StackInfo

MMA128_BLOCK = 128


def _check_rank(what: str, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise RepackError(f"{what}: rank {rank} of {size} does not exist; use 0 <= rank < size")


def tp_slice(info: StackInfo, size: int) -> int:
    """The per-rank intermediate size of ``info`` under ``size``-way tensor parallelism, or one RepackError line."""
    i, group = info.intermediate_size, info.group_size
    word_unit = MMA128_BLOCK if info.word_order in MMA_ORDERS else 32 // info.bits
    units = [word_unit] + ([group] if group != -1 else [])
    if size < 1 or i % size or any((i // size) % unit for unit in units):
        raise RepackError(
            f"{info.prefix}: cannot cut I={i} into {size} tensor-parallel shards: each must be a multiple of "
            f"{word_unit} ({info.word_order} word order) and of the group size {group}; serve with a "
            "--tensor-parallel-size that cuts I so (or 1)"
        )
    return i // size


def tp_shard_info(info: StackInfo, rank: int, size: int) -> StackInfo:
    _check_rank(info.prefix, rank, size)
    return dataclasses.replace(info, intermediate_size=tp_slice(info, size))


def tp_shard(info: StackInfo, tensors: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors (same names) of the stack ``tensors`` (keyed ``<prefix>.<kind>``)."""
    _check_rank(info.prefix, rank, size)
    part = tp_slice(info, size)
    i, pack, group = info.intermediate_size, 32 // info.bits, info.group_size
    lo, hi = rank * part, (rank + 1) * part
    tiled = info.word_order == TILES_ORDER
    row, word = (TILE_ROWS, MMA128_BLOCK) if tiled else (1, pack)  # w13 rows and w2 inputs per unit of axis 1, 2
    out = {}
    for name, tensor in tensors.items():
        kind = name.rpartition(".")[2]
        if kind == "w13_qweight":  # [E, 2I, H/pack] (tiles: [E, 2I/64, ...]): gate rows then up rows
            gate, up = tensor[:, lo // row : hi // row], tensor[:, (i + lo) // row : (i + hi) // row]
            out[name] = torch.cat([gate, up], dim=1)
        elif kind in ("w13_scales", "w13_zeros"):  # [E, G1, 2I]
            out[name] = torch.cat([tensor[..., lo:hi], tensor[..., i + lo : i + hi]], dim=-1)
        elif kind == "w2_qweight":  # [E, H, I/pack] (tiles: [E, H/64, I/128, 64, 16])
            out[name] = tensor[:, :, lo // word : hi // word]
        elif kind in ("w2_scales", "w2_zeros"):  # [E, G2, H]
            out[name] = tensor if group == -1 else tensor[:, lo // group : hi // group]  # one group: every rank's
        elif kind == "w13_perm":  # [E, H]: the input's order, the same on every rank
            out[name] = tensor
        elif kind != "w2_perm":
            raise RepackError(f"{name}: not a stack tensor this plugin can shard; re-run `repack convert`")
    return out


def ep_experts(info: StackInfo, size: int) -> int:
    """Experts per rank under ``size``-way expert parallelism, or one RepackError line."""
    if info.kind != ROUTED or size < 1 or info.num_experts % size or info.chunks_per_source != 1:
        raise RepackError(
            f"{info.prefix}: cannot give {size} expert-parallel ranks equal whole experts of this "
            f"{info.kind} stack of {info.num_experts}; serve with an expert-parallel size that divides "
            f"{info.num_experts} (routed stacks only), or without --enable-expert-parallel"
        )
    return info.num_experts // size


def ep_shard_info(info: StackInfo, rank: int, size: int) -> StackInfo:
    _check_rank(info.prefix, rank, size)
    per_rank = ep_experts(info, size)
    modules = info.source_modules[rank * per_rank : (rank + 1) * per_rank]
    return dataclasses.replace(info, num_experts=per_rank, source_modules=modules)


def ep_shard(info: StackInfo, tensors: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s whole experts: every stack tensor's leading (expert) axis sliced."""
    _check_rank(info.prefix, rank, size)
    per_rank = ep_experts(info, size)
    return {name: tensor[rank * per_rank : (rank + 1) * per_rank] for name, tensor in tensors.items()}


STORED_DTYPES = {"int32": torch.int32, "float16": torch.float16, "uint8": torch.uint8}


@dataclass(frozen=True)
class StackShard:
    """What one rank keeps of one stored stack: a tensor-parallel slice of every expert (``tp`` = (rank, size)),
    or whole experts (``experts``: their global ids, a contiguous run) plus one zero expert, or all of it.

    ``stored`` describes the stack in the files, ``local`` the rank's part (as a stack of its own)."""

    stored: StackInfo
    local: StackInfo
    tp: tuple[int, int] | None = None
    experts: tuple[int, ...] | None = None

    @property
    def absent_expert(self) -> int | None:
        """The local id of the zero expert that stands for every other rank's experts (expert parallelism)."""
        return None if self.experts is None else len(self.experts)

    @property
    def num_local_experts(self) -> int:
        """Experts of the rank's parameters: its own, plus the zero expert under expert parallelism."""
        return self.local.num_experts + (0 if self.experts is None else 1)

    def shapes(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """kind (``w13_qweight``) -> (shape, dtype) of this rank's parameter, for every stored tensor of the
        stack (``w2_perm``, which serves only ``repack verify``, included: the caller drops what it does not load)."""
        out = {}
        for name, (shape, dtype) in self.local.tensor_shapes().items():
            out[name.rpartition(".")[2]] = ([self.num_local_experts, *shape[1:]], STORED_DTYPES[dtype])
        return out

    def stored_shape(self, kind: str) -> tuple[list[int], torch.dtype]:
        """(shape, dtype) of stored tensor ``kind`` in the files."""
        shape, dtype = self.stored.tensor_shapes()[f"{self.stored.prefix}.{kind}"]
        return shape, STORED_DTYPES[dtype]

    def cut(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of stored tensor ``kind`` (the whole ``[E, ...]`` tensor as stored); a view where the
        cut allows one (whole experts, one group of w2 scales), else a new tensor."""
        name = f"{self.stored.prefix}.{kind}"
        if self.tp is not None:
            return tp_shard(self.stored, {name: tensor}, *self.tp)[name]
        if self.experts is not None:
            return tensor[self.experts[0] : self.experts[-1] + 1]
        return tensor

    def rank_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rank's tensors (same names) as the plugin's parameters hold them after loading: each stored tensor of
        ``tensors`` (keyed ``<prefix>.<kind>``) cut, and under expert parallelism followed by the zero expert."""
        out = {}
        for name, tensor in tensors.items():
            kind = name.rpartition(".")[2]
            if kind == "w2_perm":
                continue
            part = self.cut(kind, tensor).contiguous()  # a parameter is dense, whatever view the cut is
            if self.absent_expert is not None:
                part = torch.cat([part, torch.zeros_like(part[:1])])
            out[name] = part
        return out

    def id_map(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """int32 [E]: global expert id -> local id, the zero expert for other ranks' experts; None without
        expert parallelism (ids are local already)."""
        if self.experts is None:
            return None
        mapping = torch.full((self.stored.num_experts,), self.absent_expert, dtype=torch.int32)
        mapping[list(self.experts)] = torch.arange(len(self.experts), dtype=torch.int32)
        return mapping.to(device)


def plan_shard(
    info: StackInfo, tp: tuple[int, int] = (0, 1), experts: list[int] | None = None, ep_size: int = 1
) -> StackShard:
    """One rank's :class:`StackShard` of ``info``: whole experts ``experts`` (the global ids vLLM placed on this
    rank, which must be its contiguous share of ``ep_size`` equal ones) when ``ep_size`` > 1, else the
    tensor-parallel slice ``tp`` = (rank, size) (size 1: the stack whole). Anything that cannot be cut is one
    RepackError line."""
    if ep_size > 1:
        per_rank = ep_experts(info, ep_size)
        ranks = [r for r in range(ep_size) if list(range(r * per_rank, (r + 1) * per_rank)) == list(experts or [])]
        if not ranks:
            raise RepackError(
                f"{info.prefix}: vLLM placed experts {list(experts or [])[:8]}... on this rank, not a contiguous share "
                f"of {per_rank} of the {info.num_experts}; serve with vLLM's default (linear) expert placement"
            )
        return StackShard(info, ep_shard_info(info, ranks[0], ep_size), experts=tuple(experts))
    rank, size = tp
    if size == 1:
        _check_rank(info.prefix, rank, size)
        return StackShard(info, info)
    return StackShard(info, tp_shard_info(info, rank, size), tp=(rank, size))
