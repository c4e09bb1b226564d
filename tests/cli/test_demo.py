"""`repack demo`: the README's first command runs end to end and its agreements hold.

The demo runs in a subprocess without ``TRITON_INTERPRET`` so that, on a CPU machine, the path a fresh
shell takes is tested too: the CLI imports the kernels before the demo can switch the interpreter on, so
the demo must notice and re-run itself. Greedy ``generate`` is left out (``--no-generate``) to keep the
test near 30 s; everything else is the default demo.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.cli import assert_one_line_error, run_cli

SUMMARY_LINES = (
    "layer 0: MoE block relative error",
    "layer 1: MoE block relative error",
    "logits of 2x32 tokens",
    "dry run: would upload to",
    "repack demo (",
    "source size",
    "converted size",
    "MoE blocks vs float32 source",
    "logits vs float32 model",
    "push --dry-run",
    "time: convert",
    "demo ok:",
)


def test_demo_runs_end_to_end_and_agrees(tmp_path):
    out = tmp_path / "demo-out"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["COLUMNS"] = "200"  # rich wraps table cells at the terminal width; keep each summary row on one line
    result = subprocess.run(
        [sys.executable, "-m", "repack.cli", "demo", str(out), "--no-generate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for line in SUMMARY_LINES:
        assert line in result.stdout, line
    for check in ("verify", "MoE blocks vs float32 source", "logits vs float32 model", "argmax match"):
        row = next(text for text in result.stdout.splitlines() if f"│ {check} " in text)
        assert row.rstrip(" │").endswith("ok"), row
    assert (out / "converted" / "repack_manifest.json").is_file()
    assert not (out / "converted" / "README.md").exists()  # a dry run writes no card


def test_non_empty_out_dir_needs_force(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    result = run_cli("demo", tmp_path)
    assert_one_line_error(result, str(tmp_path), "--force")
    assert (tmp_path / "keep.txt").read_text() == "user data"
