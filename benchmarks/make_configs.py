"""Turn sweep results (benchmarks/sweep_moe.py JSON files) into the runtime's tuned config tables.

``python -m benchmarks.make_configs OUT_DIR [NEW_SWEEP.json ...]``: the sweeps recorded in benchmarks/tables.json
(the inputs of the shipped tables), then any new ones, in that order; for every (case, M) the fastest config over
all files wins. Each file is one device run: where a later file timed a code path (decode, weight-major, ...) at
some (case, M), the earlier files' timings of that path there are dropped, since the code they timed may have
changed since; a path a later run did not time keeps its earlier timings. Writes one ``E=..,N=..,device_name=...json``
per case (runtime/kernel_config.py's format): each winner as ``KernelConfig.to_dict`` writes it, its ``FAMILY``
named. A sweep row in the spelling before ``FAMILY`` reads as it ran (kernel_config.legacy_family): the shipped
weight-major rows, timed before the Gluon kernels existed, are ``gluon_sm90`` entries without a tile of their own
(the Gluon heuristic's where it measured faster, their weight-major tile elsewhere), the decode rows ``decode``.
After a new sweep that changes a shipped table, add it to benchmarks/tables.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.bench_moe import CASES
from repack.runtime.kernel_config import Family, KernelConfig

TABLES = Path(__file__).parent / "tables.json"
REPO = Path(__file__).parent.parent


def recorded_sweeps() -> tuple[str, list[Path]]:
    """(device name, the sweep files of the shipped tables in order) from benchmarks/tables.json."""
    record = json.loads(TABLES.read_text())
    return record["device"], [REPO / path for path in record["sweeps"]]


def code_path(config: dict) -> str:
    """Which kernels a sweep row timed: the decode kernels (CUDA-core or tensor-core), the weight-major ones (one block
    per pair, or aligned), the gptq-order tensor-core ones, or, with a tile of theirs, the Gluon sm_90 ones. A
    ``gluon_sm90`` entry without a tile is what the recorded sweeps' weight-major rows read as: timed on the
    weight-major kernels, before the Gluon ones existed."""
    parsed = KernelConfig.from_dict(config)
    if parsed.gluon is not None:
        return "gluon"
    if parsed.family in (Family.WEIGHT_MAJOR, Family.GLUON_SM90):
        return "weight-major direct" if parsed.direct else "weight-major"
    if parsed.family is Family.DECODE_MMA:
        return "decode-mma"
    return "decode" if parsed.family is Family.DECODE else "tensor-core"


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


def table_files(sweeps: list[Path], device: str) -> dict[str, str]:
    """File name -> JSON text of every table the sweeps make."""
    from repack.runtime.kernel_config import config_file_name

    shapes = {c.name: (c.experts, c.inter) for c in CASES}
    files = {}
    for case, table in best_configs(sweeps).items():
        experts, inter = shapes[case]
        entries = {str(m): KernelConfig.from_dict(table[m]).to_dict() for m in sorted(table)}
        files[config_file_name(experts, inter, device)] = json.dumps(entries, indent=1)
    return {name: text + "\n" for name, text in files.items()}


def main(out_dir: str, *new_sweeps: str) -> None:
    device, sweeps = recorded_sweeps()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in table_files(sweeps + [Path(s) for s in new_sweeps], device).items():
        (out / name).write_text(text)
        print(f"wrote {out / name} ({len(json.loads(text))} token counts)")


if __name__ == "__main__":
    main(*sys.argv[1:])
