"""Conversion benchmark at Qwen2-57B scale: `repack convert` and `repack verify --source` against `cp -r` of the
same checkpoint, measured back to back in one run.

Why `cp`: a converter reads every source byte and writes as many, so the physical limit on a machine is a copy of
the same files to the same disk (reads and writes share it), not `cat` (reads only). The targets (issue 22, items
6 and 7) are relative: convert <= 1.2x `cp -r SRC DST` (including the sync that makes the copy durable: the
converter fsyncs its output too), verify --source <= convert, peak RSS <= 2 GB for both.

Each repeat drops the page cache of the files involved (``POSIX_FADV_DONTNEED``; all of it where permitted), then
runs, back to back: `cp -r SRC DST` + `sync` of the copy (the copy is deleted at once: a full-size source, its
copy and the output do not fit on 80 GB together), `repack convert SRC OUT`, `repack verify OUT --source SRC`.
Every step records wall time, the child's CPU time and peak RSS (``os.wait4``) and the machine's load (`uptime`)
just before it: the machine is shared (2 cores), and the ratio of the same run is what compares, not the seconds.
It prints a markdown block and appends it under ``## Conversion (CPU)`` in benchmarks/RESULTS.md.

    python benchmarks/bench_convert.py                             # full size: ~31.5 GB in, as much out
    python benchmarks/bench_convert.py --layers 14 --repeat 3      # what fits beside other work, three times
    python benchmarks/bench_convert.py --layers 2 --no-results     # a quick check on ~4 GB
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
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
TARGET_RATIO = 1.2  # wall time of convert / wall time of cp -r (+ sync)
TARGET_RSS_BYTES = 2 * 10**9
FULL_LAYERS = 28
LAYER_BYTES = 1.05 * 10**9  # synthetic Qwen2-57B: routed + shared experts + attention of one layer
FIXED_BYTES = 2.2 * 10**9  # embeddings and lm_head


@dataclass
class ChildRun:
    """One timed child process, and the machine's load just before it."""

    command: list[str]
    wall_s: float
    max_rss_bytes: int
    user_s: float
    sys_s: float
    load: str

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.sys_s


def uptime() -> str:
    """The 1, 5 and 15 minute load averages, as `uptime` prints them."""
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def run_child(command: list[str], *, quiet: bool = False) -> ChildRun:
    """Run ``command``; wall time and the child's own peak RSS and CPU time from ``os.wait4``."""
    load = uptime()
    start = time.monotonic()
    stdout = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen(command, stdout=stdout)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"benchmark step failed with exit code {process.returncode}: {shlex.join(command)}")
    return ChildRun(command, wall, usage.ru_maxrss * 1024, usage.ru_utime, usage.ru_stime, load)


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
    cp = subprocess.run(["cp", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return {
        "cpu": f"{os.cpu_count()} cores (nproc), {cpu}",
        "ram": f"{mem_kb / 2**20:.1f} GiB",
        "disk": f"{df[0]} ({df[1]}, {df[2]} total, {df[4]} free at start)",
        "versions": (
            f"python {platform.python_version()}, torch {torch.__version__}, safetensors {safetensors.__version__}, "
            f"moe-repack {__version__}, {cp}, {platform.system()} {platform.release()}"
        ),
    }


def check_disk_space(work: Path, need: float) -> None:
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(
            f"{work}: {free / 1e9:.1f} GB free, the benchmark needs ~{need / 1e9:.0f} GB; free some space or pass "
            "fewer --layers"
        )


@dataclass
class Repeat:
    """One back-to-back run of the anchor, the conversion and the verification."""

    cp: ChildRun
    sync: ChildRun
    convert: ChildRun
    verify: ChildRun | None

    @property
    def anchor_s(self) -> float:
        return self.cp.wall_s + self.sync.wall_s

    @property
    def ratio(self) -> float:
        return self.convert.wall_s / self.anchor_s


def run_repeat(src: Path, out: Path, copy: Path, repack: str, shard_size: str, verify: bool) -> Repeat:
    drop_page_cache(src)
    copied = run_child(["cp", "-r", str(src), str(copy)])
    synced = run_child(["sync", *map(str, sorted(copy.iterdir()))])
    shutil.rmtree(copy)  # before converting: source, copy and output of full size do not fit together
    print(f"cp -r: {copied.wall_s:.1f} s + sync {synced.wall_s:.1f} s (load {copied.load})", flush=True)
    drop_page_cache(src)
    shutil.rmtree(out, ignore_errors=True)
    converted = run_child([repack, "convert", str(src), str(out), "--shard-size", shard_size, "--quiet"])
    ratio = converted.wall_s / (copied.wall_s + synced.wall_s)
    print(f"convert: {converted.wall_s:.1f} s ({ratio:.2f}x), peak RSS {converted.max_rss_bytes / 1e9:.2f} GB")
    verified = None
    if verify:
        drop_page_cache(src, out)
        verified = run_child([repack, "verify", str(out), "--source", str(src), "--quiet"], quiet=True)
        print(f"verify --source: {verified.wall_s:.1f} s, peak RSS {verified.max_rss_bytes / 1e9:.2f} GB", flush=True)
    return Repeat(copied, synced, converted, verified)


def markdown(figures: dict, machine: dict[str, str], repeats: list[Repeat]) -> str:
    """The run as a markdown block: context lines, then one row per repeat."""
    source_gb = figures["source_bytes"] / 1e9
    cache = (
        "dropped before each step (the whole cache, or the files' pages with POSIX_FADV_DONTNEED)"
        if figures["cache_dropped"]
        else "NOT dropped (not permitted): warm-cache figures"
    )
    first = repeats[0]
    lines = [
        f"### {figures['date']}: {figures['label']}",
        "",
        f"- machine: {machine['cpu']}; RAM {machine['ram']}; disk {machine['disk']}",
        f"- versions: {machine['versions']}",
        f"- source: {source_gb:.2f} GB in {figures['source_files']} weight files; output "
        f"{figures['output_bytes'] / 1e9:.2f} GB",
        f"- page cache: {cache}",
        f"- command: `{figures['command']}`",
        f"- anchor: `{shlex.join(first.cp.command)}` then `sync` of the copy's files, deleted before converting",
        f"- convert: `{shlex.join(first.convert.command)}`",
        *([f"- verify: `{shlex.join(first.verify.command)}`"] if first.verify else []),
        "- load: 1, 5 and 15 minute load averages (`uptime`) just before each step; 2 cores shared with other work",
        "",
        "| repeat | load before cp | `cp -r` + sync | load before convert | convert wall (CPU) | convert / cp "
        "| convert peak RSS | load before verify | verify --source wall (CPU) | verify / convert | verify peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, repeat in enumerate(repeats, 1):
        convert, verify = repeat.convert, repeat.verify
        verify_cells = (
            [verify.load, f"{verify.wall_s:.1f} s ({verify.cpu_s:.0f} s)", f"{verify.wall_s / convert.wall_s:.2f}x",
             f"{verify.max_rss_bytes / 1e9:.2f} GB"]
            if verify else ["", "not run", "", ""]
        )  # fmt: skip
        cells = [
            str(index),
            repeat.cp.load,
            f"{repeat.cp.wall_s:.1f} + {repeat.sync.wall_s:.1f} s",
            convert.load,
            f"{convert.wall_s:.1f} s ({convert.cpu_s:.0f} s)",
            f"**{repeat.ratio:.2f}x**",
            f"{convert.max_rss_bytes / 1e9:.2f} GB",
            *verify_cells,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    ratios = ", ".join(f"{r.ratio:.2f}x" for r in repeats)
    met = sum(r.ratio <= TARGET_RATIO for r in repeats)
    verified = [r for r in repeats if r.verify]
    verify_met = sum(r.verify.wall_s <= r.convert.wall_s for r in verified)
    rss = max(max(r.convert.max_rss_bytes, r.verify.max_rss_bytes if r.verify else 0) for r in repeats)
    lines += [
        "",
        f"Targets: convert <= {TARGET_RATIO}x `cp -r` + sync of the same repeat: {met} of {len(repeats)} repeats "
        f"({ratios}); "
        + (f"verify --source <= convert: {verify_met} of {len(verified)}; " if verified else "")
        + f"peak RSS <= {TARGET_RSS_BYTES / 1e9:.0f} GB: {rss / 1e9:.2f} GB at most "
        f"({'met' if rss <= TARGET_RSS_BYTES else 'missed'}).",
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
    parser.add_argument("--work", type=Path, default=Path("/work/bench-data"), help="folder for src, copy and out")
    parser.add_argument("--layers", type=int, help=f"generate only this many layers (default: all {FULL_LAYERS})")
    parser.add_argument("--repeat", type=int, default=1, help="back-to-back runs of cp, convert and verify")
    parser.add_argument("--shard-size", default="5GB", help="repack convert --shard-size")
    parser.add_argument("--no-verify", action="store_true", help="skip timing repack verify --source")
    parser.add_argument("--no-results", action="store_true", help=f"print only, do not append to {RESULTS.name}")
    parser.add_argument("--keep", action="store_true", help="keep the generated source and the output")
    args = parser.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    machine = machine_description(args.work)
    generated = args.src is None
    src = args.src or args.work / "src-57b"
    out, copy = args.work / "out-57b", args.work / "cp-57b"
    for path in (out, copy):
        shutil.rmtree(path, ignore_errors=True)
    layers = args.layers or FULL_LAYERS
    if not generated and (src / "config.json").is_file():
        layers = json.loads((src / "config.json").read_text()).get("num_hidden_layers", "?")
    figures: dict = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "label": f"synthetic Qwen2-57B-A14B GPTQ int4, {layers} of {FULL_LAYERS} layers",
    }
    # The `repack` of this interpreter's environment (`make bench-convert` does not put .venv/bin on PATH).
    beside = Path(sys.executable).parent / "repack"
    repack = str(beside) if beside.exists() else shutil.which("repack") or "repack"
    repeats: list[Repeat] = []
    try:
        if generated:
            shutil.rmtree(src, ignore_errors=True)
            source_bytes = FIXED_BYTES + layers * LAYER_BYTES
            check_disk_space(args.work, 2 * source_bytes + 4 * 10**9)  # source, then its copy or the output
            generate = [sys.executable, str(REPO / "benchmarks" / "make_synthetic_57b.py"), str(src)]
            if args.layers:
                generate += ["--layers", str(args.layers)]
            run_child(generate)
        else:
            check_disk_space(args.work, folder_bytes(src) + 10**9)
        files = weight_files(src)
        figures["source_files"] = len(files)
        figures["source_bytes"] = sum(p.stat().st_size for p in files)
        figures["cache_dropped"] = drop_page_cache(src)
        for _ in range(args.repeat):
            repeats.append(run_repeat(src, out, copy, repack, args.shard_size, not args.no_verify))
        figures["output_bytes"] = folder_bytes(out)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            if generated:
                shutil.rmtree(src, ignore_errors=True)

    block = markdown(figures, machine, repeats)
    print(block)
    if not args.no_results:
        append_results(RESULTS, block)
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
