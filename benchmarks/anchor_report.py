"""Markdown tables of one same-process run against Marlin (../shared/bench-marlin's anchor_results.json).

    python benchmarks/anchor_report.py RESULTS.json [--launches] [--ours VARIANT] [--variants] [--targets]

Prints ours/Marlin per model and M (below 1: we are faster), each cell's times, and with ``--launches`` where
every call's time goes (runs made through benchmarks/anchor_run.py: torch.profiler over the graph replay), so a
change can be predicted against the row it should move. ``--ours`` takes another of the run's project variants
(``project:NAME=VALUE``, anchor_run.py) as ours, where a cell has it; ``--variants`` adds every variant of every
cell side by side, each over ``project`` (with ``--launches``, each project variant's launches too, in the cells that
ran it: the row a variant was meant to move); ``--targets`` checks every cell against issues 17 and 18's targets
(:func:`targets_table`). What RESULTS.md records comes from here.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

# The GEMM launches of each side (ours: w13 and w2 of every family; Marlin's two; vLLM's Triton kernel); every other
# launch of a call is glue: routing, alignment, preparation, activation, gathers, top-k sums, clears and casts.
GEMMS = ("_w13", "_w2", "Marlin", "fused_moe_kernel")


def is_gemm(name: str) -> bool:
    return any(marker in name for marker in GEMMS)


def label(row: dict) -> str:
    return row["model"] + ("" if row["tag"] == "main" else f" {row['tag']}")


def ours_of(row: dict, name: str) -> dict:
    """The cell's record of variant ``name``; a project variant the cell lacks (an extra the run did not time
    with it) falls back to "project"."""
    variants = row["variants"]
    fallback = variants.get("project", {}) if name.startswith("project") else {}
    return variants.get(name) or fallback


def ratio_table(rows: list[dict], ours_name: str = "project") -> list[str]:
    """ours / Marlin per model (rows) and M (columns)."""
    ms = sorted({r["M"] for r in rows})
    cells: dict[str, dict[int, str]] = defaultdict(dict)
    for r in rows:
        ours, marlin = ours_of(r, ours_name).get("us"), r["variants"].get("marlin", {}).get("us")
        cells[label(r)][r["M"]] = f"{ours / marlin:.2f}" if ours and marlin else "-"
    lines = ["| ours / Marlin | " + " | ".join(f"M={m}" for m in ms) + " |", "|---" * (len(ms) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(c.get(m, "") for m in ms) + " |" for name, c in cells.items()]
    return lines


def times_table(rows: list[dict], ours_name: str = "project") -> list[str]:
    """floor / ours / Marlin / vLLM fp16 Triton microseconds, and our error against float32."""
    lines = ["| model | M | kernels | floor | ours | Marlin | fp16 Triton | ours/Marlin | ours/floor | ours err |"]
    lines.append("|---" * 10 + "|")
    fmt = lambda a, spec=".1f": format(a, spec) if a else "-"  # noqa: E731
    for r in rows:
        v, mine = r["variants"], ours_of(r, ours_name)
        ours, marlin, fp16 = mine.get("us"), v.get("marlin", {}).get("us"), v.get("triton_fp16", {}).get("us")
        config = mine.get("config")
        path = config.get("kernel_path", "") if isinstance(config, dict) else ""
        floor = r.get("floor_us")
        lines.append(
            f"| {label(r)} | {r['M']} | {path.split('.')[-1]} | {fmt(floor)} | {fmt(ours)} | "
            f"{fmt(marlin)} | {fmt(fp16)} | {fmt(ours and marlin and ours / marlin, '.2f')} | "
            f"{fmt(ours and floor and ours / floor, '.2f')} | {mine.get('rel_err', float('nan')):.1e} |"
        )
    return lines


def launch_cost(launch: dict) -> float:
    """What a launch adds to its call: its exposed time where the run recorded one (benchmarks/launch_profile.py;
    with dependent launches a launch's span includes its wait on the one before), else its span."""
    return launch.get("exposed_us", launch["us"])


def launch_text(launch: dict) -> str:
    """``name span`` (``xN`` for several launches a call), and the exposed part where it is less than the span."""
    text = f"{launch['name']} {launch['us']:.1f}" + (f" x{launch['launches']:.0f}" if launch["launches"] > 1.01 else "")
    return text + (f" ({launch_cost(launch):.1f} exposed)" if launch_cost(launch) < launch["us"] - 0.05 else "")


def launches_table(rows: list[dict], variant: str = "project") -> list[str]:
    """Per call: the total, the glue (what every launch but the GEMMs adds: :func:`launch_cost`) and its share,
    then every launch."""
    lines = [f"| model | M | call | glue | glue % | launches ({variant}, us per call) |", "|---" * 6 + "|"]
    for r in rows:
        rec = ours_of(r, variant)
        if "launches" not in rec:
            continue
        glue = sum(launch_cost(x) for x in rec["launches"] if not is_gemm(x["name"]))
        parts = "; ".join(launch_text(x) for x in rec["launches"])
        lines.append(
            f"| {label(r)} | {r['M']} | {rec['us']:.1f} | {glue:.1f} | {100 * glue / rec['us']:.1f} | {parts} |"
        )
    return lines


def project_variants(rows: list[dict]) -> list[str]:
    """The run's project variants ("project" and every ``project:NAME=VALUE``), in the order the run named them."""
    return [n for n in dict.fromkeys(n for r in rows for n in r["variants"]) if n.startswith("project")]


def variants_table(rows: list[dict]) -> list[str]:
    """Every variant of every cell, microseconds, each project variant also over ``project`` (the same process)."""
    names = list(dict.fromkeys(n for r in rows for n in r["variants"]))
    lines = ["| model | M | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for r in rows:
        base = r["variants"].get("project", {}).get("us")
        cells = []
        for name in names:
            us = r["variants"].get(name, {}).get("us")
            ratio = f" ({us / base:.3f})" if us and base and name.startswith("project:") else ""
            cells.append(f"{us:.1f}{ratio}" if us else "-")
        lines.append(f"| {label(r)} | {r['M']} | " + " | ".join(cells) + " |")
    return lines


# Issues 17 and 18's targets, as :func:`targets_table` checks them.
GLUE_SHARE_FROM_M64 = 0.05  # route + align + top-k sum (every non-GEMM launch) at most 5% of the call, M >= 64
GLUE_US_TO_M16 = 5.0  # ... and at most 5 us, M <= 16
FLOOR_FACTOR, FLOOR_SLACK_US = 1.25, 5.0  # M <= 64: the call within 1.25 x the HBM floor + 5 us
PREFILL_M = 1024  # from this M: each GEMM's rate, and the call against vLLM's fp16 Triton where the run timed it
TFLOPS_LONG_K, TFLOPS_SHORT_K, LONG_K = 550.0, 450.0, 2048  # TFLOP/s a GEMM reaches: K >= 2048 / K < 2048
EXTRA_OVER_FP16 = 1.05  # bf16 and act-order within 5% of the same cell's plain fp16 call


def gemm_tflops(row: dict, record: dict) -> dict[str, float]:
    """TFLOP/s of w13 (K = H) and w2 (K = I) over what each adds to the call (:func:`launch_cost`):
    2 x pairs x (2I x H) and 2 x pairs x (H x I) flops."""
    rates = {}
    for gemm, per_pair in (("w13", 4.0), ("w2", 2.0)):
        us = sum(launch_cost(x) for x in record.get("launches", []) if f"_{gemm}" in x["name"])
        if us > 0:
            rates[gemm] = per_pair * row["M"] * row["top_k"] * row["I"] * row["H"] / us / 1e6
    return rates


def cell_targets(row: dict, record: dict, fp16_us: float | None) -> list[tuple[str, bool, str]]:
    """(target, met, what was measured) for one cell of the run: faster than Marlin everywhere; M <= 16 and
    M >= 64 glue (issue 17); M <= 64 floor, M >= 1024 GEMM rates and the call against vLLM's fp16 Triton, and
    bf16 / act-order over plain fp16 (issue 18)."""
    m, us, variants = row["M"], record["us"], row["variants"]
    checks = []
    marlin = variants.get("marlin", {}).get("us")
    if marlin:
        checks.append(("< Marlin", us < marlin, f"{us / marlin:.2f}"))
    if "launches" in record:
        glue = sum(launch_cost(x) for x in record["launches"] if not is_gemm(x["name"]))
        if m <= 16:
            checks.append((f"glue <= {GLUE_US_TO_M16:g} us", glue <= GLUE_US_TO_M16, f"{glue:.1f} us"))
        if m >= 64:
            share = glue / us
            checks.append((f"glue <= {GLUE_SHARE_FROM_M64:.0%}", share <= GLUE_SHARE_FROM_M64, f"{share:.1%}"))
    if m <= 64 and row.get("floor_us"):
        bound = FLOOR_FACTOR * row["floor_us"] + FLOOR_SLACK_US
        checks.append((f"<= {FLOOR_FACTOR:g} floor + {FLOOR_SLACK_US:g}", us <= bound, f"{us:.1f} for {bound:.1f}"))
    if m >= PREFILL_M:
        for gemm, rate in gemm_tflops(row, record).items():
            k = row["H"] if gemm == "w13" else row["I"]
            need = TFLOPS_LONG_K if k >= LONG_K else TFLOPS_SHORT_K
            checks.append((f"{gemm} TFLOP/s", rate >= need, f"{rate:.0f} for {need:.0f}"))
        fp16_triton = variants.get("triton_fp16", {}).get("us")
        if fp16_triton:
            checks.append(("< fp16 Triton", us < fp16_triton, f"{us / fp16_triton:.2f}"))
    if row["tag"] != "main" and fp16_us:
        over = us / fp16_us
        checks.append((f"<= {EXTRA_OVER_FP16:g} x fp16", over <= EXTRA_OVER_FP16, f"{over:.3f}"))
    return checks


def targets_table(rows: list[dict], ours_name: str = "project") -> list[str]:
    """Every cell against every target that applies to it (:func:`cell_targets`), then the misses per target:
    what a run shows of issues 17 and 18 without arithmetic by hand. The targets are the H200's; the table says
    where a run on another GPU stands."""
    fp16 = {(r["model"], r["M"]): ours_of(r, ours_name).get("us") for r in rows if r["tag"] == "main"}
    lines = ["| model | M | targets (MISSED in capitals) |", "|---|---|---|"]
    met: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        record = ours_of(r, ours_name)
        if "us" not in record:
            continue
        checks = cell_targets(r, record, fp16.get((r["model"], r["M"])))
        for name, ok, _ in checks:
            met[name][0 if ok else 1] += 1
        text = "; ".join(f"{name} {seen}" if ok else f"MISSED {name} {seen}" for name, ok, seen in checks)
        lines.append(f"| {label(r)} | {r['M']} | {text} |")
    lines += ["", "| target | met | missed |", "|---|---:|---:|"]
    lines += [f"| {name} | {ok} | {missed} |" for name, (ok, missed) in met.items()]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--launches", action="store_true", help="add the per-launch tables (ours and Marlin)")
    parser.add_argument("--ours", default="project", help="the variant that is ours (where a cell has it)")
    parser.add_argument("--variants", action="store_true", help="add every variant of every cell side by side")
    parser.add_argument("--targets", action="store_true", help="add every cell checked against issues 17 and 18")
    args = parser.parse_args(argv)
    data = json.loads(args.results.read_text())
    rows = [r for r in data["rows"] if "variants" in r]
    out = ratio_table(rows, args.ours) + [""] + times_table(rows, args.ours)
    if args.launches:
        out += [""] + launches_table(rows, args.ours) + [""] + launches_table(rows, "marlin")
    if args.variants:
        out += [""] + variants_table(rows)
        if args.launches:
            for name in project_variants(rows):
                if name != args.ours:
                    out += [""] + launches_table([r for r in rows if name in r["variants"]], name)
    if args.targets:
        out += [""] + targets_table(rows, args.ours)
    print("\n".join(out))


if __name__ == "__main__":
    main()
