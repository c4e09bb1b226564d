"""Run the installed ``repack`` console script as a user does, and see what it imported and how long it took."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPACK = Path(sys.executable).parent / "repack"  # the installed console script: the real entry point


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_repack(*args: object, env: dict | None = None, cwd: Path | None = None, timeout: float = 300) -> Run:
    start = time.monotonic()
    result = subprocess.run(
        [str(REPACK), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    return Run(result.returncode, result.stdout, result.stderr, time.monotonic() - start)


def imported_modules(*args: object, env: dict | None = None) -> set[str]:
    """The top-level modules a run of ``repack ARGS`` imported (Python's own ``-X importtime`` report)."""
    result = run_repack(*args, env=dict(env or os.environ, PYTHONPROFILEIMPORTTIME="1"))
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def error_line(run: Run) -> str:
    """The one ``error:`` line of a failed run (asserting there is exactly that and no traceback)."""
    assert run.returncode != 0, run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr[-3000:]
    return lines[0]
