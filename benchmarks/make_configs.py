"""Turn sweep results (benchmarks/sweep_moe.py JSON files) into the runtime's tuned config tables.

``python benchmarks/make_configs.py OUT_DIR SWEEP.json [SWEEP.json ...]``: for every (case, M) the fastest
config over all files wins. Each file is one device run, in order: where a later file timed a code path (decode,
weight-major, ...) at some (case, M), the earlier files' timings of that path there are dropped, since the code
they timed may have changed since; a path a later run did not time keeps its earlier timings. Writes one
``E=..,N=..,device_name=...json`` per case (runtime/kernel_config.py's format).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.bench_moe import CASES

DEVICE = "NVIDIA_H200"


def code_path(config: dict) -> str:
    """Which kernels a config runs: the CUDA-core decode kernels, the weight-major ones (DIRECT or aligned), or the
    older tensor-core ones."""
    if config.get("WEIGHT_MAJOR"):
        return "weight-major direct" if config.get("DIRECT") else "weight-major"
    return "decode" if config.get("DIRECT") else "tensor-core"


def best_configs(paths: list[Path]) -> dict[str, dict[int, dict]]:
    """case -> M -> the fastest config of the latest timings of each code path."""
    latest: dict[tuple[str, int, str], list[tuple[float, dict]]] = {}
    for path in paths:
        timed: dict[tuple[str, int, str], list[tuple[float, dict]]] = {}
        for row in json.loads(path.read_text()):
            key = (row["case"], int(row["M"]), code_path(row["config"]))
            timed.setdefault(key, []).append((row["us"], row["config"]))
        latest.update(timed)
    fastest: dict[tuple[str, int], tuple[float, dict]] = {}
    for (case, m, _), rows in latest.items():
        us, config = min(rows, key=lambda r: r[0])
        if (case, m) not in fastest or us < fastest[(case, m)][0]:
            fastest[(case, m)] = (us, config)
    tables: dict[str, dict[int, dict]] = {}
    for (case, m), (_, config) in sorted(fastest.items()):
        tables.setdefault(case, {})[m] = config
    return tables


def main(out_dir: str, *sweeps: str) -> None:
    from repack.runtime.kernel_config import config_file_name

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {c.name: (c.experts, c.inter) for c in CASES}
    for case, table in best_configs([Path(s) for s in sweeps]).items():
        experts, inter = shapes[case]
        path = out / config_file_name(experts, inter, DEVICE)
        path.write_text(json.dumps({str(m): table[m] for m in sorted(table)}, indent=1) + "\n")
        print(f"wrote {path} ({len(table)} token counts)")


if __name__ == "__main__":
    main(*sys.argv[1:])
