"""The checkout's tracked files stay small enough for the device runs.

The device tool copies the working tree (its tracked files, plus untracked ones git does not ignore) to the GPU
machine together with the paths a run carries, at most 64 MiB in all. The vLLM GPU runs carry ../shared/vllm-gpu
(27,335,841 bytes, 26.1 MiB), which leaves 37.9 MiB for the tree; 36 MiB keeps room for a run's untracked files.
Fixtures are the usual way past it (tests/fixtures/README.md: the AWQ and compressed-tensors ones are kept at ~1 MB
each for this reason), so a new one that does not fit fails here rather than as a GPU run that cannot start.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM_GPU_CARRY_BYTES = 27_335_841  # ../shared/vllm-gpu
LIMIT_BYTES = 36 * 2**20  # + VLLM_GPU_CARRY_BYTES = 63.1 MiB of the 64
LARGEST_SHOWN = 8


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=False)


def tracked_files() -> list[Path]:
    """The files git tracks in this checkout; skips where the tree is not a git work tree of its own (an unpacked
    sdist or wheel: nothing there is sent to the device). A clean clone, as CI makes, is one and is checked."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot tell which files this checkout tracks")
    top = git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.decode().strip()).resolve() != REPO:
        pytest.skip(f"{REPO} is not the top of a git work tree (no tracked files to measure)")
    listed = git("ls-files", "-z")
    assert listed.returncode == 0, listed.stderr.decode()
    return [REPO / name for name in listed.stdout.decode().split("\0") if name]


def size(path: Path) -> int:
    """Bytes the copy sends for one tracked path: a file's or link's own size; none for one deleted in the tree, or
    for a submodule's gitlink (its files travel only when a run carries it)."""
    try:
        stat = path.lstat()
    except FileNotFoundError:
        return 0
    return 0 if path.is_dir() and not path.is_symlink() else stat.st_size


def largest_folders(sizes: dict[Path, int]) -> str:
    folders: Counter[str] = Counter()
    for path, nbytes in sizes.items():
        folders[str(path.parent.relative_to(REPO))] += nbytes
    return ", ".join(f"{folder}/ {nbytes:,}" for folder, nbytes in folders.most_common(LARGEST_SHOWN))


def test_tracked_files_fit_beside_the_vllm_gpu_carry():
    sizes = {path: size(path) for path in tracked_files()}
    total = sum(sizes.values())
    assert total <= LIMIT_BYTES, (
        f"tracked files total {total:,} bytes, over {LIMIT_BYTES:,} ({LIMIT_BYTES / 2**20:g} MiB): beside the "
        f"vLLM GPU carry ({VLLM_GPU_CARRY_BYTES:,}) they would not fit the device tool's 64 MiB; shrink or drop the "
        f"largest (tests/fixtures/make_source_fixtures.py makes small ones). Largest folders: {largest_folders(sizes)}"
    )
