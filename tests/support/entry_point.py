"""Run the installed ``repack`` console script as a user does, and see what it imported and how long it took; or
its ``main()`` after a few lines that inject a fault (a Ctrl-C at one step, a full disk) no real run could be timed
to hit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPACK = Path(sys.executable).parent / "repack"  # the installed console script: the real entry point
_MAIN = "\nfrom repack.cli import main\nsys.argv = ['repack', *sys.argv[1:]]\nmain()\n"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _run(command: list[str], timeout: float, **popen) -> Run:
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen)
    return Run(result.returncode, result.stdout, result.stderr, time.monotonic() - start)


def run_repack(*args: object, env: dict | None = None, cwd: Path | None = None, timeout: float = 300, **popen) -> Run:
    """The installed ``repack ARGS``; ``popen``: more ``subprocess.run`` arguments (``preexec_fn`` for a limit)."""
    return _run([str(REPACK), *map(str, args)], timeout, env=env, cwd=cwd, **popen)


def run_repack_after(setup: str, *args: object, timeout: float = 300, **popen) -> Run:
    """``repack ARGS`` through the console script's own ``main()``, after the Python lines ``setup`` (patches)."""
    return _run([sys.executable, "-c", "import sys\n" + setup + _MAIN, *map(str, args)], timeout, **popen)


def imported_modules(*args: object, env: dict | None = None) -> set[str]:
    """The top-level modules a run of ``repack ARGS`` imported (Python's own ``-X importtime`` report)."""
    result = run_repack(*args, env=dict(env or os.environ, PYTHONPROFILEIMPORTTIME="1"))
    names = set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def error_line(run, *must_contain: str, code: int | None = None) -> str:
    """The one ``error:`` line of a failed run (asserting there is exactly that and no traceback), containing every
    ``must_contain``; with ``code``, the exit status too."""
    assert run.returncode != 0, run.stdout + run.stderr
    if code is not None:
        assert run.returncode == code, (run.returncode, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr[-3000:]
    for text in must_contain:
        assert text in lines[0], (text, lines[0])
    return lines[0]
