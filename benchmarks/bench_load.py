"""Time `repack.runtime.load` of a converted Qwen2-57B-scale checkpoint against a plain read of the same bytes.

On the GPU machine: ``python benchmarks/bench_load.py --layers 20 --work /tmp/bench-load --out $OUT``. Generates
the synthetic GPTQ checkpoint (benchmarks/make_synthetic_57b.py), converts it with `repack convert`, then for
each repeat evicts the output files from the page cache (``posix_fadvise(DONTNEED)`` after ``sync``) and times
(a) reading every shard into host memory, (b) ``load(out, device="cuda")`` until the GPU has every byte.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache so the next read comes from the disk."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(files: list[Path]) -> float:
    """Seconds to read every file into one reused 256 MiB buffer (what `cat > /dev/null` does)."""
    buf = bytearray(256 << 20)
    view = memoryview(buf)
    start = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - start


def runtime_load(path: Path, device: str) -> float:
    import torch

    from repack.runtime import load

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    ckpt = load(path, device=device)
    sync()
    elapsed = time.perf_counter() - start
    del ckpt
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--work", default="/tmp/bench-load")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scale", default="full", choices=["full", "small"], help="small: a tiny shape, to test here")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    work = Path(args.work).resolve()
    src, out = work / "src", work / "out"
    if not (src / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_synthetic_57b.py"), str(src), "--layers", str(args.layers),
                        "--scale", args.scale],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    if not (out / "config.json").exists():
        start = time.perf_counter()
        cli = "from repack.cli import main; main()"
        command = [sys.executable, "-c", cli, "convert", str(src), str(out), "--quiet"]
        # cwd: not the repo root, whose source `repack/` folder would shadow the installed package (`-c` puts the
        # working directory first on sys.path), as it did on the GPU machine.
        done = subprocess.run(command, capture_output=True, text=True, cwd=work)
        if done.returncode:
            raise SystemExit(f"repack convert failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        print(f"convert: {time.perf_counter() - start:.1f} s", flush=True)
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    rows = []
    for r in range(args.repeats):
        evict(files)
        t_read = plain_read(files)
        evict(files)
        t_load = runtime_load(out, args.device)
        rows.append(dict(repeat=r, read_s=t_read, load_s=t_load, ratio=t_load / t_read))
        print(f"repeat {r}: read {t_read:.2f} s ({size / t_read / 1e9:.2f} GB/s), load to GPU {t_load:.2f} s "
              f"({size / t_load / 1e9:.2f} GB/s), load/read {t_load / t_read:.2f}", flush=True)  # fmt: skip
    Path(args.out, "bench_load.json").write_text(json.dumps(dict(bytes=size, layers=args.layers, rows=rows), indent=1))


if __name__ == "__main__":
    main()
