"""Conversion benchmark at Qwen2-57B scale: `repack convert` and `repack verify --source` against `cp -r` of the
same checkpoint, measured back to back in one run.

Why `cp`: a converter reads every source byte and writes as many, so the physical limit on a machine is a copy of
the same files to the same disk (reads and writes share it), not `cat` (reads only). The targets (issue 22, items
6 and 7) are relative: convert <= 1.2x `cp -r SRC DST` (including the sync that makes the copy durable: the
converter fsyncs its output too), verify --source <= convert, peak RSS <= 2 GB for both.

Each repeat runs, back to back: `cp -r SRC DST` + `sync` of the copy, `repack convert SRC OUT`, `repack verify OUT
--source SRC`. The previous repeat's output is deleted before the `cp` and the copy right after its `sync`, so
each of the two timed writers starts beside the source alone (a full-size source, its copy and the output do not
fit on 80 GB together). Before every step, timed or not, the disk is settled the same way (``settle_disk``):
`sync`, the page cache dropped (all of it where permitted, else the files' pages with ``POSIX_FADV_DONTNEED``),
then a wait until /proc/meminfo's Dirty + Writeback are near zero and the disk under --work (/proc/diskstats) has
written and discarded next to nothing for a few seconds, at most --settle-timeout seconds. Why: a step must not
pay for writes it did not make: the generator's 17-31 GB just before the first repeat (a 2.26x first repeat once
used 30 CPU-s in 55 s), the discards of a folder deleted a moment before (file systems mounted with ``discard``),
or other sessions' dirty pages. The wait is not timed; it is recorded per step, with whether it timed out. It
sees only what this machine's kernel sees: a virtual disk's host may still be busy after it.
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

try:
    from bench_load import evict  # run as a script: benchmarks/ is sys.path[0]
except ImportError:  # imported as benchmarks.bench_convert (the tests)
    from benchmarks.bench_load import evict

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
SECTION = "## Conversion (CPU)"
TARGET_RATIO = 1.2  # wall time of convert / wall time of cp -r (+ sync)
TARGET_RSS_BYTES = 2 * 10**9
FULL_LAYERS = 28
LAYER_BYTES = 1.05 * 10**9  # synthetic Qwen2-57B: routed + shared experts + attention of one layer
FIXED_BYTES = 2.2 * 10**9  # embeddings and lm_head
SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own sector size
SETTLE_TIMEOUT_S = 300.0
SETTLE_QUIET_S = 5.0  # the disk must have been quiet this long
SETTLE_MAX_DIRTY_BYTES = 64 * 2**20  # Dirty + Writeback (machine-wide: other sessions write too)
SETTLE_MAX_WRITE_RATE = 4 * 2**20  # bytes/s written + discarded over the quiet window: logs, not a checkpoint


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


def meminfo_dirty_bytes(text: str) -> int:
    """Dirty + Writeback of /proc/meminfo's ``text``, in bytes: what the kernel has yet to write, or is writing."""
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.split()
    missing = [name for name in ("Dirty", "Writeback") if name not in fields]
    if missing:
        raise ValueError(f"/proc/meminfo has no {', '.join(missing)}")
    total = 0
    for name in ("Dirty", "Writeback"):
        value = fields[name]
        if len(value) != 2 or value[1] != "kB":
            raise ValueError(f"/proc/meminfo {name}: expected '<n> kB', got {' '.join(value)!r}")
        total += int(value[0]) * 1024
    return total


def diskstats_written_bytes(text: str, device: tuple[int, int] | None) -> int:
    """Bytes written plus bytes discarded so far by ``device`` (major, minor) in /proc/diskstats's ``text``, or by
    every device listed when ``device`` is None or not listed (a folder on overlayfs or tmpfs has no block device).
    Discards count: on a file system mounted with ``discard``, deleting a 17 GB copy keeps the disk busy after
    ``unlink`` returns. Kernels before 4.18 list no discard fields: written bytes only there."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 14:
            continue
        written = int(parts[9])  # field 7: sectors written
        discarded = int(parts[16]) if len(parts) >= 18 else 0  # field 14: sectors discarded
        rows.append(((int(parts[0]), int(parts[1])), (written + discarded) * SECTOR_BYTES))
    if not rows:
        raise ValueError("/proc/diskstats lists no device")
    mine = [value for key, value in rows if key == device]
    return mine[0] if mine else sum(value for _, value in rows)


def block_device(folder: Path) -> tuple[int, int]:
    """(major, minor) of the device holding ``folder``."""
    dev = folder.stat().st_dev
    return os.major(dev), os.minor(dev)


@dataclass
class Settle:
    """How long a step waited for a quiet disk, and the state it started in."""

    wait_s: float
    settled: bool  # False: the wait hit its timeout
    dirty_bytes: int  # Dirty + Writeback when the wait ended
    write_rate: float  # bytes/s written + discarded over the last quiet window (or what was seen of it)

    def cell(self) -> str:
        """The table's cell: the wait, and the state it ended in where it timed out."""
        if self.settled:
            return f"{self.wait_s:.0f} s"
        return (
            f"{self.wait_s:.0f} s, timed out ({self.dirty_bytes / 2**20:.0f} MiB dirty, "
            f"{self.write_rate / 2**20:.1f} MiB/s)"
        )


def wait_until_quiet(
    sample: Callable[[], tuple[int, int]],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    sync: Callable[[], None] = os.sync,
    timeout_s: float = SETTLE_TIMEOUT_S,
    quiet_s: float = SETTLE_QUIET_S,
    max_dirty_bytes: int = SETTLE_MAX_DIRTY_BYTES,
    max_write_rate: float = SETTLE_MAX_WRITE_RATE,
    poll_s: float = 1.0,
) -> Settle:
    """Wait until the disk is quiet: ``sample()`` returns (Dirty + Writeback bytes, bytes written + discarded so
    far); quiet means the dirty bytes at most ``max_dirty_bytes`` now and the disk's write rate at most
    ``max_write_rate`` over the last ``quiet_s`` seconds. Each poll syncs first, so dirty pages left by other
    work go out now rather than during the next timed step. Gives up after ``timeout_s`` and says so."""
    start = clock()
    window: deque[tuple[float, int]] = deque()
    while True:
        sync()
        now = clock()
        dirty, written = sample()
        window.append((now, written))
        while len(window) > 1 and now - window[1][0] >= quiet_s:
            window.popleft()  # keep one sample at least quiet_s old
        span = now - window[0][0]
        rate = (written - window[0][1]) / span if span > 0 else float("inf")
        if span >= quiet_s and dirty <= max_dirty_bytes and rate <= max_write_rate:
            return Settle(now - start, True, dirty, rate)
        if now - start >= timeout_s:
            return Settle(now - start, False, dirty, rate)
        sleep(poll_s)


def settle_disk(work: Path, *folders: Path, timeout_s: float = SETTLE_TIMEOUT_S) -> tuple[bool, Settle]:
    """Before a step: drop the page cache (``drop_page_cache``), then wait until the disk under ``work`` is quiet
    (``wait_until_quiet``). Returns whether the cache was dropped, and the wait."""
    dropped = drop_page_cache(*folders)
    device = block_device(work)
    meminfo, diskstats = Path("/proc/meminfo"), Path("/proc/diskstats")

    def sample() -> tuple[int, int]:
        return meminfo_dirty_bytes(meminfo.read_text()), diskstats_written_bytes(diskstats.read_text(), device)

    return dropped, wait_until_quiet(sample, timeout_s=timeout_s)


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
    """One back-to-back run of the anchor, the conversion and the verification, and the settling before each."""

    cp: ChildRun
    sync: ChildRun
    convert: ChildRun
    verify: ChildRun | None
    settles: dict[str, Settle]  # "cp", "convert", "verify": the wait for a quiet disk before that step
    cache_dropped: bool  # before every step

    @property
    def anchor_s(self) -> float:
        return self.cp.wall_s + self.sync.wall_s

    @property
    def ratio(self) -> float:
        return self.convert.wall_s / self.anchor_s


def run_repeat(
    src: Path, out: Path, copy: Path, repack: str, shard_size: str, verify: bool, settle_timeout_s: float
) -> Repeat:
    """cp + sync, convert, verify; every step after the same settling, none of which is timed."""
    work = copy.parent
    settles: dict[str, Settle] = {}
    dropped: list[bool] = []

    def settle(step: str, *folders: Path) -> None:
        cache_dropped, settles[step] = settle_disk(work, *folders, timeout_s=settle_timeout_s)
        dropped.append(cache_dropped)
        print(f"settled before {step}: {settles[step].cell()}", flush=True)

    shutil.rmtree(out, ignore_errors=True)  # the previous repeat's: cp starts beside the source alone, as convert
    settle("cp", src)
    copied = run_child(["cp", "-r", str(src), str(copy)])
    synced = run_child(["sync", *map(str, sorted(copy.iterdir()))])
    shutil.rmtree(copy)  # before converting: source, copy and output of full size do not fit together
    print(f"cp -r: {copied.wall_s:.1f} s + sync {synced.wall_s:.1f} s (load {copied.load})", flush=True)
    settle("convert", src)
    converted = run_child([repack, "convert", str(src), str(out), "--shard-size", shard_size, "--quiet"])
    ratio = converted.wall_s / (copied.wall_s + synced.wall_s)
    print(f"convert: {converted.wall_s:.1f} s ({ratio:.2f}x), peak RSS {converted.max_rss_bytes / 1e9:.2f} GB")
    verified = None
    if verify:
        settle("verify", src, out)
        verified = run_child([repack, "verify", str(out), "--source", str(src), "--quiet"], quiet=True)
        print(f"verify --source: {verified.wall_s:.1f} s, peak RSS {verified.max_rss_bytes / 1e9:.2f} GB", flush=True)
    return Repeat(copied, synced, converted, verified, settles, all(dropped))


def markdown(figures: dict, machine: dict[str, str], repeats: list[Repeat]) -> str:
    """The run as a markdown block: context lines, then one row per repeat."""
    source_gb = figures["source_bytes"] / 1e9
    cache = (
        "dropped before each step (the whole cache, or the files' pages with POSIX_FADV_DONTNEED)"
        if all(r.cache_dropped for r in repeats)
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
        f"- settled before each step, untimed: `sync`, page cache dropped, then a wait until Dirty + Writeback <= "
        f"{SETTLE_MAX_DIRTY_BYTES / 2**20:.0f} MiB and the disk under --work ({figures['device']}) wrote + "
        f"discarded <= {SETTLE_MAX_WRITE_RATE / 2**20:.0f} MiB/s for {SETTLE_QUIET_S:.0f} s, at most "
        f"{figures['settle_timeout_s']:.0f} s (the `wait` columns)",
        *(
            [f"- source generated just before repeat 1 ({figures['generate_s']:.1f} s, make_synthetic_57b.py)"]
            if "generate_s" in figures
            else []
        ),
        f"- command: `{figures['command']}`",
        f"- anchor: `{shlex.join(first.cp.command)}` then `sync` of the copy's files, deleted before converting",
        f"- convert: `{shlex.join(first.convert.command)}`",
        *([f"- verify: `{shlex.join(first.verify.command)}`"] if first.verify else []),
        "- load: 1, 5 and 15 minute load averages (`uptime`) just before each step; 2 cores shared with other work",
        "",
        "| repeat | wait before cp | load before cp | `cp -r` + sync | wait before convert | load before convert "
        "| convert wall (CPU) | convert / cp | convert peak RSS | wait before verify | load before verify "
        "| verify --source wall (CPU) | verify / convert | verify peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, repeat in enumerate(repeats, 1):
        convert, verify = repeat.convert, repeat.verify
        verify_cells = (
            [repeat.settles["verify"].cell(), verify.load, f"{verify.wall_s:.1f} s ({verify.cpu_s:.0f} s)",
             f"{verify.wall_s / convert.wall_s:.2f}x", f"{verify.max_rss_bytes / 1e9:.2f} GB"]
            if verify else ["", "", "not run", "", ""]
        )  # fmt: skip
        cells = [
            str(index),
            repeat.settles["cp"].cell(),
            repeat.cp.load,
            f"{repeat.cp.wall_s:.1f} + {repeat.sync.wall_s:.1f} s",
            repeat.settles["convert"].cell(),
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
    parser.add_argument(
        "--settle-timeout",
        type=float,
        default=SETTLE_TIMEOUT_S,
        help="seconds to wait at most for a quiet disk before each step (the wait is recorded, not timed)",
    )
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
        "device": "{}:{}".format(*block_device(args.work)),
        "settle_timeout_s": args.settle_timeout,
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
            figures["generate_s"] = run_child(generate).wall_s
        else:
            check_disk_space(args.work, folder_bytes(src) + 10**9)
        files = weight_files(src)
        figures["source_files"] = len(files)
        figures["source_bytes"] = sum(p.stat().st_size for p in files)
        for _ in range(args.repeat):
            repeats.append(run_repeat(src, out, copy, repack, args.shard_size, not args.no_verify, args.settle_timeout))
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
