"""Kernel configs for the fused MoE: the typed :class:`KernelConfig`, tuned JSON tables per device and shape, and a
run-time guard that shrinks a config a device cannot hold.

A config names the kernel family that runs it (``family``, one module each in runtime/kernels/: :class:`Family`),
a tile in Triton's launch meta-parameters and the few switches of that family. Where the named family cannot run
a call (the stack, the device), runtime/fused_moe.py runs the config's tile on the first tl tensor-core family of
its ordered list that can; without a config it takes a tuned table's entry, else the first family whose heuristic
claims the call. fused_moe parses a config once, at its entry, and the families read its fields.

JSON tables (vLLM style) live in ``runtime/configs/`` (or ``$REPACK_MOE_CONFIG_DIR``), named
``E={experts},N={intermediate},device_name={device name, spaces as _}.json``, and map a token count M to an
entry: ``BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages`` always, ``FAMILY``, then the family's switches
(``DIRECT``, ``SCALE_ACC``, ``SPLIT_K``, ``QUANT_AHEAD``, ``REDUCE``, ``PREFETCH``, ``GLUON``: :data:`JSON_KEYS`).
The entry with the nearest M is used. ``repack tune`` (runtime/tune.py) and benchmarks/make_configs.py write them.
Entries in the spelling before ``FAMILY`` (``WEIGHT_MAJOR``, ``PORTABLE``, ``NIBBLE_DOTS``) read as they ran then
(:func:`legacy_family`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from repack.formats.errors import RepackError

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")  # required in every entry


class Family(str, Enum):
    """The kernel families, one module each in runtime/kernels/ (a config's ``FAMILY``)."""

    DECODE = "decode"  # CUDA cores, one program per (token, expert) pair: kernels/decode.py
    DECODE_MMA = "decode_mma"  # the decode's launches on Hopper tensor cores (Gluon, mma.sync): kernels/decode_mma.py
    GLUON_SM90 = "gluon_sm90"  # Hopper tensor cores, a wgmma in flight while dequantizing: kernels/gluon_sm90.py
    WEIGHT_MAJOR = "weight_major"  # tensor cores, weights as the MMA's register operand: kernels/weight_major.py
    GPTQ_ORDER = "gptq_order"  # tensor cores, tokens as the A operand, gptq-order words only: kernels/gptq_order.py


# The families that always run one program per pair (DIRECT implied) and sum the top-k in their w2.
DECODE_FAMILIES = (Family.DECODE, Family.DECODE_MMA)

# Register cap per thread (maxnreg) of the warp-specialized kernels, by (persistent programs per SM, consumer warps):
# P programs of one warpgroup's allocation per 4 consumer warps, plus the producer's, share the SM's 65536 registers.
# The producer then gives back all but its few (setmaxnreg), which the consumer takes: one program of two consumer
# warpgroups at 168 runs them at 232 beside a 40-register producer.
PERSISTENT_REGISTERS = {(4, 4): 64, (3, 4): 80, (2, 4): 128, (1, 8): 168}


@dataclass(frozen=True)
class GluonTile:
    """The Gluon sm_90 kernels' launch shape: ``block_m`` tokens (the wgmma N), ``block_n`` output channels per
    w13 program (``2 * block_n`` weight rows: gate and up), ``group_m`` token blocks per weight-tile group,
    ``stages`` K steps in the shared-memory ring, ``warps`` 4 or 8 (one or two warpgroups sharing the block's
    activations: twice the weight rows per activation byte read, benchmarks/KERNEL_NOTES.md item 16) and
    ``w2_block_n`` w2's weight rows per program (0: the w13 tile's row count, at least 64) and ``per_sm``: 0 for
    one program per tile (kernels/gluon_sm90.py), else the warp-specialized persistent kernels with that many
    programs on every SM (kernels/gluon_ws_sm90.py, KERNEL_NOTES.md item 25: 16 channels a consumer warp, w2's rows
    set by its warps; :data:`PERSISTENT_REGISTERS` says which (per_sm, warps) fit).
    JSON: ``"GLUON": [block_m, block_n, group_m(, stages(, warps(, w2_block_n(, per_sm))))]``."""

    block_m: int
    block_n: int
    group_m: int = 1
    stages: int = 4
    warps: int = 4
    w2_block_n: int = 0
    per_sm: int = 0

    def __post_init__(self) -> None:
        if self.block_m not in (16, 32, 64, 128) or self.block_n not in (64, 128, 256):
            raise RepackError(
                f"kernel config: GLUON: unsupported tile {self.block_m} x {self.block_n}; use block_m in "
                "16/32/64/128 and block_n in 64/128/256"
            )
        if self.group_m < 1 or self.stages < 2:
            raise RepackError(f"kernel config: GLUON: group_m {self.group_m} < 1 or stages {self.stages} < 2")
        if self.warps not in (4, 8) or self.w2_block_n not in (0, 64, 128, 256):
            raise RepackError(
                f"kernel config: GLUON: warps {self.warps} / w2_block_n {self.w2_block_n}; use warps 4 or 8 and "
                "w2_block_n 0 (the w13 rows), 64, 128 or 256"
            )
        if self.per_sm and (self.per_sm, self.warps) not in PERSISTENT_REGISTERS:
            shapes = ", ".join(f"per_sm {p} on {w} warps" for p, w in PERSISTENT_REGISTERS)
            raise RepackError(
                f"kernel config: GLUON: per_sm {self.per_sm} on {self.warps} warps; use per_sm 0 (a program per tile) "
                f"or one of: {shapes}"
            )
        if self.per_sm and (self.block_n != 16 * self.warps or self.w2_block_n):
            raise RepackError(
                f"kernel config: GLUON: per_sm {self.per_sm} (warp-specialized) takes 16 channels a warp and w2's "
                f"rows from its warps, not block_n {self.block_n} on {self.warps} warps, w2_block_n {self.w2_block_n}"
            )
        # Each warp owns 16 weight rows; w13's gate/up halves must split on a register bit, not a warp bit.
        if self.block_n < 16 * self.warps or self.w2_rows < 16 * self.warps:
            raise RepackError(
                f"kernel config: GLUON: {self.warps} warps need block_n and w2_block_n >= {16 * self.warps}"
            )

    @property
    def registers(self) -> int:
        """maxnreg of a warp-specialized tile (``per_sm`` set): :data:`PERSISTENT_REGISTERS`."""
        return PERSISTENT_REGISTERS[self.per_sm, self.warps]

    @property
    def w2_rows(self) -> int:
        """w2's weight rows per program."""
        return self.w2_block_n or max(64, min(256, 2 * self.block_n) if self.warps == 8 else self.block_n)

    @classmethod
    def from_list(cls, entry: object) -> GluonTile:
        if (
            not isinstance(entry, (list, tuple))
            or not 2 <= len(entry) <= 7
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            raise RepackError(
                "kernel config: GLUON must be [block_m, block_n, group_m(, stages(, warps(, w2_block_n(, per_sm))))], "
                f"not {entry!r}"
            )
        return cls(*entry)

    def to_list(self) -> list[int]:
        values = [self.block_m, self.block_n, self.group_m, self.stages, self.warps, self.w2_block_n, self.per_sm]
        while len(values) > 4 and values[-1] == (4, 0, 0)[len(values) - 5]:  # trailing defaults left out
            values.pop()
        return values


REDUCE_MODES = ("pairs", "atomic", "out", "last")  # KernelConfig.reduce


@dataclass(frozen=True)
class KernelConfig:
    """One fused-MoE kernel config, typed. JSON tables and ``fused_moe(config=...)`` dicts use the keys of
    :data:`JSON_KEYS`; :meth:`from_dict` and :meth:`to_dict` translate.

    What each family reads: decode ``block_n``, ``block_k`` (128 on mma128 stacks), warps, stages, ``split_k``,
    ``prefetch``; decode_mma ``block_n``, warps, ``split_k`` (the CUDA-core decode runs its configs where it
    cannot); weight_major ``block_m``, ``block_n``, ``group_m`` (``block_k`` is 128), warps, stages, ``direct``,
    ``scale_acc``, ``quant_ahead``, ``reduce``; gptq_order the whole tile and ``reduce``; gluon_sm90 ``gluon`` and
    ``reduce``, and runs its tl tile and switches on the weight-major kernels where it cannot run."""

    family: Family
    # tile and launch sizes (Triton meta-parameters)
    block_m: int  # tokens per row block (the tensor-core families)
    block_n: int  # output channels per program
    block_k: int  # inputs per K step (the weight-major kernels always step 128; mma128 decode too)
    group_m: int  # row blocks that share a weight tile while it is in L2
    num_warps: int
    num_stages: int
    # family switches
    direct: bool = False  # one program (block) per (token, expert) pair, no alignment: DECODE always, WEIGHT_MAJOR
    scale_acc: bool = True  # tensor cores: exact ``q - zero`` weights, each K step's sum scaled once in fp32
    split_k: int = 1  # DECODE: slices of K per (pair, tile), meeting in fp32 sums
    quant_ahead: bool = False  # WEIGHT_MAJOR: scales and zeros loaded one K step ahead
    # tensor cores, the top-k sum: per-pair rows summed by kernels/topk_sum.py ("pairs"), fp32 atomics into a
    # zeroed [M, H] buffer cast at the end ("atomic"), or atomics of the activation dtype straight into the
    # zeroed output ("out": no launch for the sum at all; fp16 only, KERNEL_NOTES item 18), or per-pair rows each
    # token's summed by the w2 program that writes its last ("last": no launch for the sum, rounded as "pairs";
    # gluon_sm90 only, "pairs" elsewhere: family.KernelFamily.reduce_modes). No shipped table sets it.
    reduce: str = "pairs"
    prefetch: int = 1  # DECODE: K blocks of weights loaded ahead (1 or 2); no shipped table sets 2
    # GLUON_SM90: the tile of the Gluon kernels; None: their heuristic's tile and top-k sum, wherever they measured
    # faster than the weight-major kernels (gluon_sm90.preferred), and the tl tile on those elsewhere
    gluon: GluonTile | None = None

    def __post_init__(self) -> None:
        if self.family in DECODE_FAMILIES and not self.direct:
            raise RepackError("kernel config: the decode kernels run one program per pair; set DIRECT")
        if self.direct and self.family not in (*DECODE_FAMILIES, Family.WEIGHT_MAJOR):
            raise RepackError(
                f"kernel config: DIRECT (one block per pair) is a decode or weight_major mode, not "
                f"{self.family.value}'s"
            )
        if self.gluon is not None and self.family is not Family.GLUON_SM90:
            raise RepackError(
                f"kernel config: a GLUON tile is the gluon_sm90 family's, not {self.family.value}'s; set FAMILY "
                "gluon_sm90, without DIRECT (the Gluon kernels have no one-block-per-pair mode)"
            )
        if self.reduce not in REDUCE_MODES:
            raise RepackError(f"kernel config: REDUCE must be one of {', '.join(REDUCE_MODES)}, not {self.reduce!r}")
        if self.prefetch not in (1, 2):
            raise RepackError(f"kernel config: PREFETCH must be 1 or 2, not {self.prefetch!r}")

    @classmethod
    def from_dict(cls, entry: Mapping) -> KernelConfig:
        """Parse a table entry or a ``fused_moe(config=...)`` dict; a missing or unknown key is a RepackError."""
        missing = [k for k in CONFIG_KEYS if k not in entry]
        if missing:
            raise RepackError(f"kernel config lacks {', '.join(missing)}")
        unknown = [k for k in entry if k not in JSON_KEYS and k not in LEGACY_KEYS]
        if unknown:
            raise RepackError(
                f"kernel config: unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(JSON_KEYS)}"
            )
        gluon = GluonTile.from_list(entry["GLUON"]) if entry.get("GLUON") is not None else None
        if "FAMILY" in entry:
            legacy = [k for k in LEGACY_KEYS if k in entry]
            if legacy:
                raise RepackError(
                    f"kernel config: FAMILY names the family; drop {', '.join(legacy)} (the spelling before it)"
                )
            try:
                family = Family(entry["FAMILY"])
            except ValueError:
                raise RepackError(
                    f"kernel config: FAMILY must be one of {', '.join(f.value for f in Family)}, not "
                    f"{entry['FAMILY']!r}"
                ) from None
        else:
            family = legacy_family(entry, gluon)
        direct = bool(entry.get("DIRECT", family in DECODE_FAMILIES))
        types = {f.name: f.type for f in fields(cls)}
        values = {
            JSON_KEYS[k]: v for k, v in entry.items() if k in JSON_KEYS and k not in ("FAMILY", "DIRECT", "GLUON")
        }
        typed = {
            name: (bool(v) if types[name] == "bool" else int(v) if types[name] == "int" else v)
            for name, v in values.items()
        }
        return cls(family=family, direct=direct, gluon=gluon, **typed)

    def to_dict(self) -> dict:
        """The JSON entry: ``FAMILY``, the tile, and the switches that are not at their defaults."""
        entry = {"FAMILY": self.family.value}
        entry.update({key: getattr(self, name) for key, name in JSON_KEYS.items() if name in _SIZES})
        if self.direct and self.family not in DECODE_FAMILIES:
            entry["DIRECT"] = True
        for key, name in JSON_KEYS.items():
            if name in _SWITCHES and getattr(self, name) != _DEFAULTS[name]:
                entry[key] = getattr(self, name)
        if self.gluon is not None:
            entry["GLUON"] = self.gluon.to_list()
        return entry

    def meta(self, *, with_block_k: bool = True) -> dict:
        """The Triton launch meta-parameters of the tile (what :func:`fit_config` may shrink)."""
        sizes = dict(
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_K=self.block_k,
            GROUP_M=self.group_m,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
        if not with_block_k:
            del sizes["BLOCK_K"]
        return sizes

    def fit_group(self, group_size: int) -> KernelConfig:
        """BLOCK_K divides the group (one scale row per K step): halved until it does, never under 16."""
        block_k = self.block_k
        if group_size != -1:
            while group_size % block_k:
                block_k //= 2
        block_k = max(block_k, 16)
        return self if block_k == self.block_k else replace(self, block_k=block_k)


JSON_KEYS = {  # table key -> KernelConfig field
    "FAMILY": "family",
    "BLOCK_M": "block_m",
    "BLOCK_N": "block_n",
    "BLOCK_K": "block_k",
    "GROUP_M": "group_m",
    "num_warps": "num_warps",
    "num_stages": "num_stages",
    "DIRECT": "direct",
    "SCALE_ACC": "scale_acc",
    "SPLIT_K": "split_k",
    "QUANT_AHEAD": "quant_ahead",
    "REDUCE": "reduce",
    "PREFETCH": "prefetch",
    "GLUON": "gluon",
}
# The spelling before FAMILY, still read (:func:`legacy_family`): WEIGHT_MAJOR and DIRECT chose the tl family,
# PORTABLE kept an aligned tl entry off the Gluon kernels, NIBBLE_DOTS (retired: the gptq-order kernels' one dot
# per nibble position, which no shipped table chose) is read and ignored.
LEGACY_KEYS = ("WEIGHT_MAJOR", "PORTABLE", "NIBBLE_DOTS")
_SIZES = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
_SWITCHES = ("scale_acc", "split_k", "quant_ahead", "reduce", "prefetch")
_DEFAULTS = {f.name: f.default for f in fields(KernelConfig) if f.name in _SWITCHES}


def legacy_family(entry: Mapping, gluon: GluonTile | None) -> Family:
    """The family an entry without ``FAMILY`` names, as it ran before the key existed: ``DIRECT`` alone the decode
    kernels, with ``WEIGHT_MAJOR`` the weight-major ones one block per pair; a ``GLUON`` tile the Gluon kernels;
    ``WEIGHT_MAJOR`` the Gluon kernels with their heuristic's tile where they measured faster and the weight-major
    ones elsewhere (the shipped tables, timed before the Gluon kernels existed), unless ``PORTABLE`` (what `repack
    tune` wrote for a weight-major winner); neither key the gptq-order kernels (weight-major on an mma128 stack)."""
    direct, weight_major = bool(entry.get("DIRECT", False)), bool(entry.get("WEIGHT_MAJOR", False))
    if entry.get("PORTABLE", False) and gluon is not None:
        raise RepackError("kernel config: PORTABLE (the tl kernels) contradicts a GLUON tile; drop one of them")
    if direct:
        return Family.WEIGHT_MAJOR if weight_major else Family.DECODE
    if gluon is not None:
        return Family.GLUON_SM90
    if weight_major:
        return Family.WEIGHT_MAJOR if entry.get("PORTABLE", False) else Family.GLUON_SM90
    return Family.GPTQ_ORDER


def as_kernel_config(config: KernelConfig | Mapping) -> KernelConfig:
    """A KernelConfig as is; a dict in the table spelling parsed."""
    return config if isinstance(config, KernelConfig) else KernelConfig.from_dict(config)


def config_dir() -> Path:
    return Path(os.environ.get("REPACK_MOE_CONFIG_DIR", CONFIG_DIR))


def device_name(device: torch.device | str) -> str:
    """The name used in config file names: ``NVIDIA_H200``; ``cpu`` without a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def config_file_name(num_experts: int, intermediate_size: int, name: str) -> str:
    return f"E={num_experts},N={intermediate_size},device_name={name}.json"


@functools.lru_cache(maxsize=64)
def load_configs(num_experts: int, intermediate_size: int, name: str) -> dict[int, KernelConfig] | None:
    """The tuned table for a shape and device, or None; a malformed file is a RepackError."""
    path = config_dir() / config_file_name(num_experts, intermediate_size, name)
    if not path.exists():
        return None
    try:
        entries = {int(m): entry for m, entry in json.loads(path.read_text()).items()}
    except (ValueError, AttributeError) as exc:
        raise RepackError(f"{path}: not a JSON object of M -> config ({exc}); re-run `repack tune`") from exc
    table = {}
    for m, entry in entries.items():
        try:
            table[m] = KernelConfig.from_dict(entry)
        except (RepackError, TypeError, AttributeError) as exc:
            raise RepackError(f"{path}: entry M={m}: {exc}; re-run `repack tune`") from exc
    return table


def get_config(weights, num_tokens: int, top_k: int, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """The config a call without one takes: :func:`repack.runtime.fused_moe.get_config`, which asks the families'
    heuristics where no table is tuned. Also answered here, where it lived before the families described themselves,
    for callers of that name (../shared/bench-marlin/bench_anchor.py)."""
    from repack.runtime.fused_moe import get_config as families_config  # fused_moe imports this module

    return families_config(weights, num_tokens, top_k, dtype, device)


# On the CPU the kernels run in Triton's interpreter, one program after another: the cost is the number of
# programs, not bytes, so every M takes the sorted path with wide tiles (the decode path's one program per
# token-expert pair and BLOCK_N tile is the slowest choice there). Tests pass explicit configs for the rest.
INTERPRETER_CONFIG = KernelConfig(
    Family.WEIGHT_MAJOR, block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=1
)


def shrink_config(meta: dict) -> dict | None:
    """Launch meta-parameters that need less shared memory (fewer stages, then smaller K and N tiles), or None."""
    smaller = dict(meta)
    if smaller["num_stages"] > 2:
        smaller["num_stages"] -= 1
    elif smaller.get("BLOCK_K", 0) > 32:
        smaller["BLOCK_K"] //= 2
    elif smaller["BLOCK_N"] > 32:
        smaller["BLOCK_N"] //= 2
    elif smaller["num_stages"] > 1:
        smaller["num_stages"] = 1
    else:
        return None
    return smaller


_FITTED: dict[tuple, dict] = {}


def fit_config(meta: dict, device: torch.device, launch: Callable[[dict], object], kernel_name: str = "") -> dict:
    """Run ``launch(meta)``; if the device lacks the shared memory it needs, retry with smaller meta-parameters.

    The ones that worked are remembered per (kernel, device, meta-parameters), so the fallback costs one failed
    compile per process, and CUDA-graph replays never see it.
    """
    key = (kernel_name, str(device), tuple(sorted(meta.items())))
    current = _FITTED.get(key, meta)
    while True:
        try:
            launch(current)
        except OutOfResources as exc:
            smaller = shrink_config(current)
            if smaller is None:
                raise RepackError(
                    f"fused_moe: no config fits the shared memory of {device} ({exc}); report the device name"
                ) from exc
            current = smaller
            continue
        _FITTED[key] = current
        return current
