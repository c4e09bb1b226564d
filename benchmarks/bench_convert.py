"""Conversion benchmark at full 57B scale: wall time, throughput and peak RSS of `repack convert`.

Why this shape: the targets (issue 2) are relative to the machine, so the script measures the machine too.
It makes (or reuses) the synthetic Qwen2-57B-A14B GPTQ checkpoint, drops the page cache where permitted,
times `cat` of the weight files to /dev/null (the floor: reading the bytes once), then runs `repack convert`
and `repack verify --source` as child processes, each from a cold cache, measuring wall time and the child's
own peak RSS (``os.wait4``). It prints a markdown table and appends it under ``## Conversion (CPU)`` in
benchmarks/RESULTS.md. Data goes under --work (default /work/bench-data) and is deleted afterwards unless --keep.

    python benchmarks/bench_convert.py                         # full size: ~31 GB in, ~31 GB out
    python benchmarks/bench_convert.py --layers 2 --no-results # quick check on ~4 GB
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_load import evict  # run as a script: benchmarks/ is sys.path[0]

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
SECTION = "## Conversion (CPU)"
TARGET_RATIO = 1.3  # wall time of convert / wall time of cat
TARGET_RSS_BYTES = 2 * 10**9
FULL_SOURCE_BYTES = 31 * 10**9


@dataclass
class ChildRun:
    """One timed child process."""

    command: list[str]
    wall_s: float
    max_rss_bytes: int
    user_s: float
    sys_s: float


def run_child(command: list[str], *, quiet: bool = False) -> ChildRun:
    """Run ``command``; wall time and the child's own peak RSS and CPU time from ``os.wait4``."""
    start = time.monotonic()
    stdout = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen(command, stdout=stdout)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"benchmark step failed with exit code {process.returncode}: {shlex.join(command)}")
    return ChildRun(command, wall, usage.ru_maxrss * 1024, usage.ru_utime, usage.ru_stime)


def drop_page_cache(*folders: Path) -> bool:
    """sync and drop the page cache so the next step reads from disk: all of it where permitted, else the pages
    of every file under ``folders`` (``POSIX_FADV_DONTNEED`` needs no privilege); False if neither worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        pass
    files = [path for folder in folders if folder.is_dir() for path in folder.rglob("*") if path.is_file()]
    evict(files)
    return bool(files)


def load_average() -> str:
    """The 1-minute load average now (other users of the machine's cores slow every step)."""
    return f"{os.getloadavg()[0]:.2f}"


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def machine_description(work: Path) -> dict[str, str]:
    """nproc, RAM, the disk under ``work`` and the software versions, for the table."""
    import safetensors
    import torch

    from repack import __version__

    mem_kb = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    df = subprocess.run(["df", "-hT", str(work)], capture_output=True, text=True).stdout.splitlines()[-1].split()
    return {
        "cpu": f"{os.cpu_count()} cores (nproc), {cpu}",
        "ram": f"{mem_kb / 2**20:.1f} GiB",
        "disk": f"{df[0]} ({df[1]}, {df[2]} total, {df[4]} free at start)",
        "versions": (
            f"python {platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}, "
            f"moe-repack {__version__}, {platform.system()} {platform.release()}"
        ),
    }


def check_disk_space(work: Path, need: int) -> None:
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, the benchmark needs ~{need / 1e9:.0f} GB; free some space")


def markdown(figures: dict, machine: dict[str, str]) -> str:
    """The run as a markdown block: context lines, then one table."""
    read_s, convert = figures["read_s"], figures["convert"]
    source_gb = figures["source_bytes"] / 1e9
    ratio = convert.wall_s / read_s
    rss_ok = convert.max_rss_bytes <= TARGET_RSS_BYTES
    rows = [
        ("source weights", f"{source_gb:.2f} GB in {figures['source_files']} files", ""),
        ("`cat` weights > /dev/null", f"{read_s:.1f} s ({source_gb / read_s:.2f} GB/s)", "the floor"),
        (
            "`repack convert` wall",
            f"{convert.wall_s:.1f} s ({source_gb / convert.wall_s:.2f} GB/s; user {convert.user_s:.0f} s, "
            f"sys {convert.sys_s:.0f} s)",
            f"{ratio:.2f}x read time (target <= {TARGET_RATIO}x: {'met' if ratio <= TARGET_RATIO else 'missed'})",
        ),
        (
            "`repack convert` peak RSS",
            f"{convert.max_rss_bytes / 1e9:.2f} GB",
            f"target <= {TARGET_RSS_BYTES / 1e9:.0f} GB: {'met' if rss_ok else 'missed'}",
        ),
        ("output", f"{figures['output_bytes'] / 1e9:.2f} GB", ""),
    ]
    if figures.get("verify"):
        verify = figures["verify"]
        rows.append(
            (
                "`repack verify OUT --source SRC` wall",
                f"{verify.wall_s:.1f} s (peak RSS {verify.max_rss_bytes / 1e9:.2f} GB)",
                "sha256 of both sides + bit-exact inverse of every stack",
            )
        )
    if figures.get("generate_s") is not None:
        rows.append(("synthetic source generation", f"{figures['generate_s']:.1f} s", "make_synthetic_57b.py"))
    cache = (
        "dropped before each step (the whole cache, or the files' pages with POSIX_FADV_DONTNEED)"
        if figures["cache_dropped"]
        else "NOT dropped (not permitted): warm-cache figures"
    )
    load = ", ".join(f"{step} {value}" for step, value in figures["load"].items())
    lines = [
        f"### {figures['date']}: {figures['label']}",
        "",
        f"- machine: {machine['cpu']}; RAM {machine['ram']}; disk {machine['disk']}",
        f"- versions: {machine['versions']}",
        f"- page cache: {cache}",
        f"- 1-minute load average at the start of each step (2 cores shared with other work): {load}",
        f"- command: `{figures['command']}`",
        f"- convert: `{shlex.join(convert.command)}`",
        "",
        "| measure | value | note |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
    ]
    return "\n".join(lines)


def append_results(path: Path, block: str) -> None:
    """Add ``block`` at the end of the ``## Conversion (CPU)`` section, creating the section (or file)."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n" + block
    else:
        start = text.index(SECTION) + len(SECTION)
        next_section = text.find("\n## ", start)
        end = len(text) if next_section < 0 else next_section + 1
        text = text[:end].rstrip("\n") + "\n\n" + block + ("\n" + text[end:] if next_section >= 0 else "")
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, help="reuse this GPTQ checkpoint instead of generating one")
    parser.add_argument("--work", type=Path, default=Path("/work/bench-data"), help="folder for src and out")
    parser.add_argument("--layers", type=int, help="generate only this many layers (default: all 28)")
    parser.add_argument("--shard-size", default="5GB", help="repack convert --shard-size")
    parser.add_argument("--no-verify", action="store_true", help="skip timing repack verify")
    parser.add_argument("--no-results", action="store_true", help=f"print only, do not append to {RESULTS.name}")
    parser.add_argument("--keep", action="store_true", help="keep the generated source and the output")
    args = parser.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    machine = machine_description(args.work)
    generated = args.src is None
    src = args.src or args.work / "src-57b"
    out = args.work / "out-57b"
    shutil.rmtree(out, ignore_errors=True)
    figures: dict = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "label": f"synthetic Qwen2-57B-A14B GPTQ int4{f', {args.layers} layers' if args.layers else ''}",
    }
    try:
        if generated:
            shutil.rmtree(src, ignore_errors=True)
            check_disk_space(args.work, 2 * FULL_SOURCE_BYTES * (args.layers or 28) // 28 + 4 * 10**9)
            generate = [sys.executable, str(REPO / "benchmarks" / "make_synthetic_57b.py"), str(src)]
            if args.layers:
                generate += ["--layers", str(args.layers)]
            figures["generate_s"] = run_child(generate).wall_s
        else:
            check_disk_space(args.work, folder_bytes(src) + 10**9)
        files = weight_files(src)
        figures["source_files"] = len(files)
        figures["source_bytes"] = sum(p.stat().st_size for p in files)

        figures["cache_dropped"] = drop_page_cache(src)
        figures["load"] = {"cat": load_average()}
        figures["read_s"] = run_child(["cat", *map(str, files)], quiet=True).wall_s
        print(f"cat: {figures['read_s']:.1f} s for {figures['source_bytes'] / 1e9:.2f} GB", flush=True)

        drop_page_cache(src)
        figures["load"]["convert"] = load_average()
        # The `repack` of this interpreter's environment (`make bench-convert` does not put .venv/bin on PATH).
        beside = Path(sys.executable).parent / "repack"
        repack = str(beside) if beside.exists() else shutil.which("repack") or "repack"
        convert = [repack, "convert", str(src), str(out), "--shard-size", args.shard_size, "--quiet"]
        figures["convert"] = run_child(convert)
        figures["output_bytes"] = folder_bytes(out)
        print(f"convert: {figures['convert'].wall_s:.1f} s, peak RSS {figures['convert'].max_rss_bytes / 1e9:.2f} GB")

        if not args.no_verify:
            drop_page_cache(src, out)
            figures["load"]["verify"] = load_average()
            figures["verify"] = run_child([repack, "verify", str(out), "--source", str(src)])
            print(f"verify: {figures['verify'].wall_s:.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            if generated:
                shutil.rmtree(src, ignore_errors=True)

    block = markdown(figures, machine)
    print(block)
    if not args.no_results:
        append_results(RESULTS, block)
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
