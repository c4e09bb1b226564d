"""`repack convert --dry-run` at 80 columns: one line per output tensor, under one heading per layer, nothing cut."""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from repack.convert import convert
from tests.support.entry_point import run_repack
from tests.support.fixtures import FIXTURES_DIR
from tests.support.plan_text import tensor_lines


def test_the_plan_is_one_line_per_tensor_at_80_columns(tmp_path):
    src = FIXTURES_DIR / "qwen2moe-g128-sym"  # routed and joined shared stacks, biases, the longest names
    run = run_repack("convert", src, tmp_path / "planned", "--dry-run", env=dict(os.environ, COLUMNS="80"))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert "…" not in run.stdout  # nothing cut at 80 columns
    out = tmp_path / "out"
    convert(str(src), out, quiet=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shown = {name: lines[number] for name, number in tensor_lines(run.stdout).items()}
    assert set(shown) == set(index)
    for name, line in shown.items():
        with safe_open(out / index[name], "pt") as shard:
            assert str(list(shard.get_slice(name).get_shape())) in line, (name, line)
    assert f"{len(index)} tensors" in run.stdout
