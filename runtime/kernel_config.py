"""Kernel configs for the fused MoE: tuned JSON per device and shape, a heuristic otherwise, and a
run-time guard that shrinks a config a device cannot hold.

JSON files (vLLM style) live in ``runtime/configs/`` (or ``$REPACK_MOE_CONFIG_DIR``), named
``E={experts},N={intermediate},device_name={device name, spaces as _}.json`` and map a token count M
to ``{BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages[, DIRECT, REDUCE]}``; the entry with
the nearest M is used. ``repack tune`` writes them (runtime/tune.py).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from repack.formats.errors import RepackError

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


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
    """Decode: one CUDA-core program per (token, k) pair beats sorting while pairs rarely share experts.

    Measured on an H200 (benchmarks/RESULTS.md): direct wins up to 32 pairs (Qwen2-57B M=4, top-8) and loses
    to the tensor-core path by M=16.
    """
    return num_pairs <= max(32, num_experts // 2)


def heuristic_config(num_tokens: int, top_k: int, num_experts: int) -> dict:
    """A safe config for untuned shapes, following what the H200 sweep picked for the tuned ones.

    Past decode: the weight-major tensor-core kernels (runtime/kernels/weight_major.py), with a token tile that grows
    with the rows each expert gets; fused_moe runs a stack they do not support on its older kernels instead.
    """
    num_pairs = num_tokens * top_k
    per_expert = num_pairs / max(1, num_experts)
    if direct_mode(num_pairs, num_experts):
        # Few pairs leave most of the GPU idle: slices of K give it programs (H200 probe, KERNEL_NOTES.md item 10).
        split = 4 if num_pairs <= 8 else 2 if num_pairs <= 16 else 1
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=1, num_stages=1, DIRECT=True,
                    SPLIT_K=split)  # fmt: skip
    if per_expert <= 8:
        tile = dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1)
    elif per_expert <= 24:
        tile = dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=4)
    else:
        tile = dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8)
    return dict(tile, BLOCK_K=128, num_warps=4, num_stages=3, WEIGHT_MAJOR=True, SCALE_ACC=False)


HEURISTIC_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def heuristic_configs() -> list[dict]:
    """Every distinct config the heuristic can return (for the sm_90 compile test)."""
    seen: dict[str, dict] = {}
    for m in HEURISTIC_TOKEN_COUNTS:
        for top_k, experts in ((8, 64), (4, 60), (1, 8), (2, 160)):
            cfg = heuristic_config(m, top_k, experts)
            seen[json.dumps(cfg, sort_keys=True)] = cfg
    return list(seen.values())


@functools.lru_cache(maxsize=64)
def load_configs(num_experts: int, intermediate_size: int, name: str) -> dict[int, dict] | None:
    """The tuned table for a shape and device, or None; a malformed file is a RepackError."""
    path = config_dir() / config_file_name(num_experts, intermediate_size, name)
    if not path.exists():
        return None
    try:
        table = {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}
    except (ValueError, AttributeError) as exc:
        raise RepackError(f"{path}: not a JSON object of M -> config ({exc}); re-run `repack tune`") from exc
    for m, cfg in table.items():
        missing = [k for k in CONFIG_KEYS if k not in cfg]
        if missing:
            raise RepackError(f"{path}: entry M={m} lacks {', '.join(missing)}; re-run `repack tune`")
    return table


# On the CPU the kernels run in Triton's interpreter, one program after another: the cost is the number of
# programs, not bytes, so every M takes the sorted path with wide tiles (the decode path's one program per
# token-expert pair and BLOCK_N tile is the slowest choice there). Tests pass explicit configs for the rest.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=1, WEIGHT_MAJOR=True)


def get_config(weights, num_tokens: int, top_k: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tuned config of the nearest M for this device and shape, else the heuristic's (the interpreter's on CPU).

    A routed stack joined with its shared chunks (``weights.routed_experts`` set) uses the routed stack's table:
    tables are tuned per routed shape. Its ``top_k`` counts the shared chunks too, so a token brings more pairs
    than the table's entries were tuned for; the choice between decode (DIRECT) and tensor-core entries is then
    made by :func:`direct_mode` on the joined pairs, and the nearest M among the entries of that kind is used.
    """
    del dtype  # one table serves fp16 and bf16 (same bytes and tiles)
    table = load_configs(weights.config_experts, weights.intermediate_size, device_name(device))
    if not table:
        if torch.device(device).type == "cpu":
            return dict(INTERPRETER_CONFIG)
        return heuristic_config(num_tokens, top_k, weights.num_experts)
    if weights.config_experts != weights.num_experts:
        direct = direct_mode(num_tokens * top_k, weights.num_experts)
        table = {m: cfg for m, cfg in table.items() if bool(cfg.get("DIRECT")) == direct} or table
    nearest = min(table, key=lambda m: abs(m - num_tokens))
    return dict(table[nearest])


def shrink_config(cfg: dict) -> dict | None:
    """A config that needs less shared memory (fewer stages, then smaller K and N tiles), or None."""
    smaller = dict(cfg)
    if smaller["num_stages"] > 2:
        smaller["num_stages"] -= 1
    elif smaller["BLOCK_K"] > 32:
        smaller["BLOCK_K"] //= 2
    elif smaller["BLOCK_N"] > 32:
        smaller["BLOCK_N"] //= 2
    elif smaller["num_stages"] > 1:
        smaller["num_stages"] = 1
    else:
        return None
    return smaller


_FITTED: dict[tuple, dict] = {}


def fit_config(cfg: dict, device: torch.device, launch: Callable[[dict], object], kernel_name: str = "") -> dict:
    """Run ``launch(cfg)``; if the device lacks the shared memory it needs, retry with smaller configs.

    The config that worked is remembered per (kernel, device, config), so the fallback costs one failed
    compile per process, and CUDA-graph replays never see it.
    """
    key = (kernel_name, str(device), tuple(sorted(cfg.items())))
    current = _FITTED.get(key, cfg)
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
