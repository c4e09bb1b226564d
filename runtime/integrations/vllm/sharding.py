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
``mma128`` word order on its 128-input blocks (formats/SPEC.md: the nibbles are permuted inside each block of 16
words), else one RepackError line says so. Expert parallelism gives rank ``r`` the whole experts
``[r E/size, (r + 1) E/size)`` of a routed stack; ``E`` must divide evenly.

Pure torch (no vLLM): tests/runtime/test_vllm_sharding.py checks every cut against the dequantized full stack.
"""

from __future__ import annotations

import dataclasses

import torch

from repack.formats.errors import RepackError
from repack.formats.stacks import MMA128_ORDER, ROUTED, StackInfo

MMA128_BLOCK = 128


def _check_rank(what: str, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise RepackError(f"{what}: rank {rank} of {size} does not exist; use 0 <= rank < size")


def tp_slice(info: StackInfo, size: int) -> int:
    """The per-rank intermediate size of ``info`` under ``size``-way tensor parallelism, or one RepackError line."""
    i, group = info.intermediate_size, info.group_size
    word_unit = MMA128_BLOCK if info.word_order == MMA128_ORDER else 32 // info.bits
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
    out = {}
    for name, tensor in tensors.items():
        kind = name.rpartition(".")[2]
        if kind == "w13_qweight":  # [E, 2I, H/pack]: gate rows then up rows
            out[name] = torch.cat([tensor[:, lo:hi], tensor[:, i + lo : i + hi]], dim=1)
        elif kind in ("w13_scales", "w13_zeros"):  # [E, G1, 2I]
            out[name] = torch.cat([tensor[..., lo:hi], tensor[..., i + lo : i + hi]], dim=-1)
        elif kind == "w2_qweight":  # [E, H, I/pack]
            out[name] = tensor[..., lo // pack : hi // pack]
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
