"""Shared by the converter tests: run the CLI in-process and assert the one-line-error contract."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from repack.cli import app


def run_cli(*args: str):
    """Invoke ``repack ARGS`` in-process; stdout and stderr are captured separately."""
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *must_contain: str) -> str:
    """Non-zero exit, exactly one ``error:`` line on stderr naming what it should, no traceback."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.output
    for text in must_contain:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def convert_fails(src: Path, tmp_path: Path, *must_contain: str) -> str:
    """``repack convert SRC tmp_path/out`` fails with one line naming ``must_contain``, and writes nothing: no OUT,
    no temp folder left beside it."""
    out = tmp_path / "out"
    line = assert_one_line_error(run_cli("convert", src, out, "--quiet"), *must_contain)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    return line


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_weights(folder: Path, edit) -> None:
    """Load ``model.safetensors``, let ``edit(dict)`` change it in place, save it back."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
