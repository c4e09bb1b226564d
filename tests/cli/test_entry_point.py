"""The installed `repack` entry point, run as a user runs it (a subprocess): help, version, flags shown as flags,
and the commands that need no tensors do not pay for importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from repack import __version__
from repack.convert import convert
from repack.formats.constants import FORMAT_VERSION
from tests.support.fixtures import FIXTURES_DIR

REPACK = Path(sys.executable).parent / "repack"
# Runs the console script's own function and reports, at exit, whether torch was ever imported.
IMPORTS_AT_EXIT = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr))\n"
    "from repack.cli import main\n"
    "sys.argv = ['repack', *sys.argv[1:]]\n"
    "main()\n"
)


def run_entry_point(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", IMPORTS_AT_EXIT, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("entry") / "out"
    convert(str(FIXTURES_DIR / "qwen3moe-g128-sym"), out, quiet=True)
    return out


@pytest.mark.parametrize(
    "args",
    [["--help"], ["-h"], ["convert", "--help"], ["push", "-h"], ["convert", "--no-such-option"], ["verify"]],
    ids=["help", "h", "convert-help", "push-h", "wrong-option", "missing-argument"],
)
def test_help_and_usage_errors_do_not_import_torch(args: list[str]):
    result = run_entry_point(*args)
    assert "torch imported: False" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_push_dry_run_does_not_import_torch(converted: Path, tmp_path: Path):
    result = run_entry_point("push", "me/model", converted, "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "would upload to me/model" in result.stdout
    assert "torch imported: False" in result.stderr


def test_version_and_short_help_from_the_installed_script():
    version = subprocess.run([REPACK, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0
    assert version.stdout.strip() == f"repack (moe-repack) {__version__}, writes repack-moe v{FORMAT_VERSION}"
    short = subprocess.run([REPACK, "-h"], capture_output=True, text=True, timeout=60)
    assert short.returncode == 0 and "Usage: repack" in short.stdout


def test_convert_help_names_the_format_written_and_shows_flags_as_flags():
    wide = {"COLUMNS": "160", "TERM": "dumb"}
    result = subprocess.run([REPACK, "convert", "--help"], capture_output=True, text=True, timeout=60, env=wide)
    assert result.returncode == 0
    assert f"repack-moe v{FORMAT_VERSION} layout" in result.stdout
    assert "v1 layout" not in result.stdout
    assert "<bool>" not in result.stdout
    for flag in ("--force", "--dry-run", "--quiet", "--private", "--include", "--exclude", "--base-model"):
        assert flag in result.stdout, flag


@pytest.mark.parametrize("command", ["", "convert", "verify", "inspect", "push", "demo", "tune"])
def test_help_ends_with_examples_that_use_only_real_options(command: str):
    """Like `hf upload --help`: an Examples section of whole command lines, each naming this command and only
    options it has, every line inside 80 columns."""
    args = [command, "--help"] if command else ["--help"]
    narrow = {"COLUMNS": "80", "TERM": "dumb", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([REPACK, *args], capture_output=True, text=True, timeout=60, env=narrow)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "Examples:" in text, text
    lines = [line.strip() for line in text.split("Examples:", 1)[1].splitlines() if line.strip()]
    assert lines and all(line.startswith(f"repack {command}".rstrip()) for line in lines), lines
    for line in lines:
        used = [word for word in line.split("#")[0].split() if word.startswith("--")]
        if command:
            assert all(option in text.split("Examples:")[0] for option in used), (line, used)
    assert max(len(line) for line in text.splitlines()) <= 80
