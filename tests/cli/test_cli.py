"""The repack CLI surface: help, dry-run, --force swap, inspect, quiet, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

from repack.formats.stacks import MANIFEST_FILE
from tests.support.cli import assert_one_line_error, run_cli
from tests.support.fixtures import FIXTURES_DIR

SRC = FIXTURES_DIR / "qwen3moe-g128-sym"


def test_help_lists_commands():
    result = run_cli("--help")
    assert result.exit_code == 0
    for command in ("convert", "verify", "inspect"):
        assert command in result.stdout


def test_dry_run_prints_plan_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    result = run_cli("convert", SRC, out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "repack plan" in result.stdout and "w13_qweight" in result.stdout
    assert not out.exists()


def test_convert_quiet_is_silent_and_inspect_shows_stacks(tmp_path):
    out = tmp_path / "out"
    result = run_cli("convert", SRC, out, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == ""
    shown = run_cli("inspect", out)
    assert shown.exit_code == 0
    for text in ("repack-moe v3", "qwen3_moe", "routed", "4-bit, group 128", SRC.name, "0.1.0", "mma128"):
        assert text in shown.stdout, text


def test_convert_shows_progress_on_stderr(tmp_path):
    result = run_cli("convert", SRC, tmp_path / "out")
    assert result.exit_code == 0
    assert "layers" in result.stderr and "wrote" in result.stderr


def test_force_replaces_existing_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    result = run_cli("convert", SRC, out, "--force", "--quiet")
    assert result.exit_code == 0, result.output
    assert not (out / "old.txt").exists() and (out / MANIFEST_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp or old folder left


def test_empty_existing_out_is_fine(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert run_cli("convert", SRC, out, "--quiet").exit_code == 0


def test_bad_shard_size(tmp_path):
    assert_one_line_error(run_cli("convert", SRC, tmp_path / "out", "--shard-size", "lots"), "--shard-size")


def test_inspect_refuses_unknown_format_version(tmp_path):
    out = tmp_path / "out"
    run_cli("convert", SRC, out, "--quiet")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["format_version"] = 99
    (out / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run_cli("inspect", out), "format_version 99", "config.json")


def test_inspect_refuses_a_gptq_folder():
    assert_one_line_error(run_cli("inspect", SRC), "not a repack-moe checkpoint")


def test_revision_on_local_folder_refused(tmp_path):
    assert_one_line_error(run_cli("convert", SRC, tmp_path / "o", "--revision", "main"), "--revision")


def test_the_cli_starts_without_importing_torch():
    """`repack --help` and `repack push` must not pay for torch (about 1.5 s): the format's constants and file
    hashing are torch-free modules, and the commands that need tensors import them when they run."""
    code = "import sys, repack.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
