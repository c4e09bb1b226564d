"""Kernel configs for the fused MoE: the typed :class:`KernelConfig`, tuned JSON tables per device and shape,
a heuristic otherwise, and a run-time guard that shrinks a config a device cannot hold.

A config names the kernel family that runs (``kernels``: the CUDA-core ``decode`` kernels, the ``weight_major``
tensor-core kernels, or the older ``gptq_order`` tensor-core kernels for stacks the weight-major ones cannot
read), its tile and launch sizes, and the few switches that family takes. On a Hopper GPU an aligned
tensor-core config runs the Gluon sm_90 kernels where they measured faster (fused_moe.choose_kernels), with a
tile of theirs it names (``gluon``) or their heuristic's; ``portable`` keeps it on its tl family there instead
(what ``repack tune`` writes when a tl config won, so that an entry runs what was timed). The tl family also
runs wherever Gluon cannot. fused_moe parses a config once, at its entry, and the families read its fields.

JSON tables (vLLM style) live in ``runtime/configs/`` (or ``$REPACK_MOE_CONFIG_DIR``), named
``E={experts},N={intermediate},device_name={device name, spaces as _}.json``, and map a token count M to an
entry in the Triton spelling: ``BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages`` always, then
``DIRECT`` / ``WEIGHT_MAJOR`` (which family: :meth:`KernelConfig.from_dict`), ``SCALE_ACC``, ``SPLIT_K``,
``QUANT_AHEAD``, ``PORTABLE`` (true: the tl kernels, never Gluon), ``GLUON`` (a :class:`GluonTile` as a list),
and the tuning-only ``REDUCE``, ``PREFETCH``; ``NIBBLE_DOTS`` (retired) is read and ignored. The entry with the
nearest M is used.
``repack tune`` (runtime/tune.py) and benchmarks/make_configs.py write them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from repack.formats.errors import RepackError

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")  # required in every entry


class Kernels(str, Enum):
    """The kernel family a config runs (one module each in runtime/kernels/)."""

    DECODE = "decode"  # CUDA cores, one program per (token, expert) pair: runtime/kernels/decode.py
    WEIGHT_MAJOR = "weight_major"  # tensor cores, weights as the MMA's register operand: kernels/weight_major.py
    GPTQ_ORDER = "gptq_order"  # tensor cores, tokens as the A operand, gptq-order words only: kernels/gptq_order.py
    # Hopper tensor cores with wgmma kept in flight (kernels/gluon_sm90.py). Never a config's ``kernels``:
    # fused_moe.choose_kernels grants it to an aligned config on sm_90 where it is faster or asked for (a ``gluon``
    # tile, or $REPACK_GLUON_KERNELS=1) and the config is not ``portable``; the config's tl family runs elsewhere.
    GLUON_SM90 = "gluon_sm90"


@dataclass(frozen=True)
class GluonTile:
    """The Gluon sm_90 kernels' launch shape: ``block_m`` tokens (the wgmma N), ``block_n`` output channels per
    w13 program (``2 * block_n`` weight rows: gate and up), ``group_m`` token blocks per weight-tile group,
    ``stages`` K steps in the shared-memory ring, ``warps`` 4 or 8 (one or two warpgroups sharing the block's
    activations: twice the weight rows per activation byte read, benchmarks/KERNEL_NOTES.md item 16) and
    ``w2_block_n`` w2's weight rows per program (0: the w13 tile's row count, at least 64).
    JSON: ``"GLUON": [block_m, block_n, group_m(, stages(, warps(, w2_block_n)))]``."""

    block_m: int
    block_n: int
    group_m: int = 1
    stages: int = 4
    warps: int = 4
    w2_block_n: int = 0

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
        # Each warp owns 16 weight rows; w13's gate/up halves must split on a register bit, not a warp bit.
        if self.block_n < 16 * self.warps or self.w2_rows < 16 * self.warps:
            raise RepackError(
                f"kernel config: GLUON: {self.warps} warps need block_n and w2_block_n >= {16 * self.warps}"
            )

    @property
    def w2_rows(self) -> int:
        """w2's weight rows per program."""
        return self.w2_block_n or max(64, min(256, 2 * self.block_n) if self.warps == 8 else self.block_n)

    @classmethod
    def from_list(cls, entry: object) -> GluonTile:
        if (
            not isinstance(entry, (list, tuple))
            or not 2 <= len(entry) <= 6
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
        ):
            raise RepackError(
                "kernel config: GLUON must be [block_m, block_n, group_m(, stages(, warps(, w2_block_n)))], "
                f"not {entry!r}"
            )
        return cls(*entry)

    def to_list(self) -> list[int]:
        values = [self.block_m, self.block_n, self.group_m, self.stages, self.warps, self.w2_block_n]
        while len(values) > 4 and values[-1] == (4, 0)[len(values) - 5]:  # trailing defaults left out
            values.pop()
        return values


REDUCE_MODES = ("pairs", "atomic", "out")  # KernelConfig.reduce


@dataclass(frozen=True)
class KernelConfig:
    """One fused-MoE kernel config, typed. JSON tables and ``fused_moe(config=...)`` dicts use the Triton-style
    keys of :data:`JSON_KEYS`; :meth:`from_dict` and :meth:`to_dict` translate."""

    kernels: Kernels
    # tile and launch sizes (Triton meta-parameters)
    block_m: int  # tokens per row block (the tensor-core families)
    block_n: int  # output channels per program
    block_k: int  # inputs per K step (the weight-major kernels always step 128; mma128 decode too)
    group_m: int  # row blocks that share a weight tile while it is in L2
    num_warps: int
    num_stages: int
    # family switches
    direct: bool = False  # one program per (token, expert) pair, no alignment launch (always on for DECODE)
    scale_acc: bool = True  # tensor cores: exact ``q - zero`` weights, each K step's sum scaled once in fp32
    split_k: int = 1  # DECODE: slices of K per (pair, tile), meeting in fp32 sums
    quant_ahead: bool = False  # WEIGHT_MAJOR: scales and zeros loaded one K step ahead
    # tuning-only: no shipped table (runtime/configs/) sets these to anything but the default; tune.py searches them
    # tensor cores, the top-k sum: per-pair rows summed by kernels/topk_sum.py ("pairs"), fp32 atomics into a
    # zeroed [M, H] buffer cast at the end ("atomic"), or atomics of the activation dtype straight into the
    # zeroed output ("out": no launch for the sum at all; fp16 only, KERNEL_NOTES item 18)
    reduce: str = "pairs"
    prefetch: int = 1  # DECODE: K blocks of weights loaded ahead (1 or 2)
    # the Gluon sm_90 kernels (runtime/kernels/gluon_sm90.py): with this tile where they can run; or, ``portable``,
    # never, not even where they would run by default (a tl config that won a tuning on sm_90)
    portable: bool = False
    gluon: GluonTile | None = None

    def __post_init__(self) -> None:
        if self.kernels is Kernels.GLUON_SM90:
            raise RepackError("kernel config: the Gluon kernels are asked for with a GLUON tile beside a tl family")
        if self.kernels is Kernels.DECODE and not self.direct:
            raise RepackError("kernel config: the decode kernels run one program per pair; set DIRECT")
        if self.reduce not in REDUCE_MODES:
            raise RepackError(f"kernel config: REDUCE must be one of {', '.join(REDUCE_MODES)}, not {self.reduce!r}")
        if self.prefetch not in (1, 2):
            raise RepackError(f"kernel config: PREFETCH must be 1 or 2, not {self.prefetch!r}")
        if self.portable and self.gluon is not None:
            raise RepackError("kernel config: PORTABLE (the tl kernels) contradicts a GLUON tile; drop one of them")

    @classmethod
    def from_dict(cls, entry: Mapping) -> KernelConfig:
        """Parse a table entry or a ``fused_moe(config=...)`` dict; a missing or unknown key is a RepackError.

        The family: ``WEIGHT_MAJOR`` -> weight-major (``DIRECT``: one block per pair); else ``DIRECT`` ->
        decode; else the gptq-order tensor-core kernels."""
        missing = [k for k in CONFIG_KEYS if k not in entry]
        if missing:
            raise RepackError(f"kernel config lacks {', '.join(missing)}")
        unknown = [k for k in entry if k not in JSON_KEYS and k not in RETIRED_KEYS]
        if unknown:
            raise RepackError(
                f"kernel config: unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(JSON_KEYS)}"
            )
        direct = bool(entry.get("DIRECT", False))
        if entry.get("WEIGHT_MAJOR", False):
            kernels = Kernels.WEIGHT_MAJOR
        else:
            kernels = Kernels.DECODE if direct else Kernels.GPTQ_ORDER
        values = {
            JSON_KEYS[k]: entry[k] for k in entry if k in JSON_KEYS and k not in ("DIRECT", "WEIGHT_MAJOR", "GLUON")
        }
        types = {f.name: f.type for f in fields(cls)}
        typed = {
            name: (bool(v) if types[name] == "bool" else int(v) if types[name] == "int" else v)
            for name, v in values.items()
        }
        gluon = GluonTile.from_list(entry["GLUON"]) if entry.get("GLUON") is not None else None
        return cls(kernels=kernels, direct=direct, gluon=gluon, **typed)

    def to_dict(self) -> dict:
        """The JSON entry (Triton-style keys); switches at their defaults are left out."""
        entry = {key: getattr(self, name) for key, name in JSON_KEYS.items() if name in _SIZES}
        if self.direct:
            entry["DIRECT"] = True
        if self.kernels is Kernels.WEIGHT_MAJOR:
            entry["WEIGHT_MAJOR"] = True
        defaults = asdict(_DEFAULTS)
        for key, name in JSON_KEYS.items():
            if name in _SWITCHES and getattr(self, name) != defaults[name]:
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


JSON_KEYS = {  # table key -> KernelConfig field ("WEIGHT_MAJOR" and "DIRECT" together choose ``kernels``)
    "BLOCK_M": "block_m",
    "BLOCK_N": "block_n",
    "BLOCK_K": "block_k",
    "GROUP_M": "group_m",
    "num_warps": "num_warps",
    "num_stages": "num_stages",
    "DIRECT": "direct",
    "WEIGHT_MAJOR": "kernels",
    "SCALE_ACC": "scale_acc",
    "SPLIT_K": "split_k",
    "QUANT_AHEAD": "quant_ahead",
    "REDUCE": "reduce",
    "PREFETCH": "prefetch",
    "PORTABLE": "portable",
    "GLUON": "gluon",
}
_SIZES = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
# Read and ignored: NIBBLE_DOTS chose the gptq-order kernels' one dot per nibble position, which no shipped table chose
# (retired; the int16 reshape path runs such an entry).
RETIRED_KEYS = ("NIBBLE_DOTS",)
_SWITCHES = ("scale_acc", "split_k", "quant_ahead", "reduce", "prefetch", "portable")
_DEFAULTS = KernelConfig(Kernels.GPTQ_ORDER, 16, 16, 16, 1, 1, 1)


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


def direct_mode(num_pairs: int, num_experts: int) -> bool:
    """Decode: one CUDA-core program per (token, k) pair beats sorting while pairs rarely share experts
    (where the H200 crossover sits: benchmarks/RESULTS.md). Each pair reads its expert's weights: with more pairs
    than experts (Mixtral's eight at 16 tokens: four reads of every expert) the sorted path reads each once."""
    return num_pairs <= max(32, num_experts // 2) and num_pairs <= max(8, num_experts)


def heuristic_config(num_tokens: int, top_k: int, num_experts: int) -> KernelConfig:
    """A safe config for untuned shapes, following what the H200 sweep picked for the tuned ones.

    Past decode: the weight-major tensor-core kernels, with a token tile that grows with the rows each expert
    gets; fused_moe runs a stack they do not support on the gptq-order kernels instead.
    """
    num_pairs = num_tokens * top_k
    per_expert = num_pairs / max(1, num_experts)
    if direct_mode(num_pairs, num_experts):
        # Few pairs leave most of the GPU idle: slices of K give it programs (KERNEL_NOTES.md item 10).
        split = 4 if num_pairs <= 8 else 2 if num_pairs <= 16 else 1
        return KernelConfig(Kernels.DECODE, 16, 32, 128, 1, num_warps=1, num_stages=1, direct=True, split_k=split)
    if per_expert <= 8:
        block_m, block_n, group_m = 16, 128, 1
    elif per_expert <= 24:
        block_m, block_n, group_m = 32, 64, 4
    else:
        block_m, block_n, group_m = 64, 128, 8
    tile = dict(block_m=block_m, block_n=block_n, block_k=128, group_m=group_m, num_warps=4, num_stages=3)
    return KernelConfig(Kernels.WEIGHT_MAJOR, **tile, scale_acc=False)


HEURISTIC_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def heuristic_configs() -> list[KernelConfig]:
    """Every distinct config the heuristic can return (for the sm_90 compile test)."""
    seen: dict[KernelConfig, None] = {}
    for m in HEURISTIC_TOKEN_COUNTS:
        for top_k, experts in ((8, 64), (4, 60), (1, 8), (2, 160)):
            seen[heuristic_config(m, top_k, experts)] = None
    return list(seen)


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


# On the CPU the kernels run in Triton's interpreter, one program after another: the cost is the number of
# programs, not bytes, so every M takes the sorted path with wide tiles (the decode path's one program per
# token-expert pair and BLOCK_N tile is the slowest choice there). Tests pass explicit configs for the rest.
INTERPRETER_CONFIG = KernelConfig(
    Kernels.WEIGHT_MAJOR, block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=1
)


def get_config(weights, num_tokens: int, top_k: int, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """Tuned config of the nearest M for this device and shape, else the heuristic's (the interpreter's on CPU).

    A routed stack joined with its shared chunks (``weights.routed_experts`` set) uses the routed stack's table:
    tables are tuned per routed shape. Its ``top_k`` counts the shared chunks too, so a token brings more pairs
    than the table's entries were tuned for; the choice between one-program-per-pair (DIRECT) and aligned entries
    is then made by :func:`direct_mode` on the joined pairs, and the nearest M among the entries of that kind is used.
    """
    del dtype  # one table serves fp16 and bf16 (same bytes and tiles)
    table = load_configs(weights.config_experts, weights.intermediate_size, device_name(device))
    if not table:
        if torch.device(device).type == "cpu":
            return INTERPRETER_CONFIG
        return heuristic_config(num_tokens, top_k, weights.num_experts)
    if weights.config_experts != weights.num_experts:
        direct = direct_mode(num_tokens * top_k, weights.num_experts)
        table = {m: cfg for m, cfg in table.items() if cfg.direct == direct} or table
    nearest = min(table, key=lambda m: abs(m - num_tokens))
    return table[nearest]


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
