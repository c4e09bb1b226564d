"""Turn sweep results (benchmarks/sweep_moe.py JSON files) into the runtime's tuned config tables.

``python benchmarks/make_configs.py OUT_DIR SWEEP.json [SWEEP.json ...]``: for every (case, M) the fastest
config over all files wins (each file is one device run; a code path a later run did not time keeps its
earlier timing). Writes one
``E=..,N=..,device_name=...json`` per case (runtime/kernel_config.py's format).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.bench_moe import CASES

DEVICE = "NVIDIA_H200"


def best_configs(paths: list[Path]) -> dict[str, dict[int, dict]]:
    """case -> M -> the fastest config measured in any of the files."""
    fastest: dict[tuple[str, int], tuple[float, dict]] = {}
    for path in paths:
        for row in json.loads(path.read_text()):
            key = (row["case"], int(row["M"]))
            if key not in fastest or row["us"] < fastest[key][0]:
                fastest[key] = (row["us"], row["config"])
    tables: dict[str, dict[int, dict]] = {}
    for (case, m), (_, config) in fastest.items():
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
