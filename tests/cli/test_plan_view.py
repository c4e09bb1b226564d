"""`repack convert --dry-run` at 80 columns: one line per output tensor, under one heading per layer, nothing cut."""

from __future__ import annotations

import json
import os

from safetensors import safe_open

from repack.convert import convert
from tests.support.entry_point import run_repack
from tests.support.fixtures import FIXTURES_DIR


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
    shown, prefix = {}, ""
    for line in lines:
        if line.startswith("  ") and "[" in line:  # a tensor: its name is the heading's prefix + the first word
            name = prefix + line.split()[0]
            assert name not in shown, name
            shown[name] = line
        elif line.strip() and not line.startswith(" "):  # a heading: "layer 3 (model.layers.3.*)", "other"
            prefix = line.split(" (", 1)[1].rstrip().rstrip(")*") if line.rstrip().endswith("*)") else ""
    assert set(shown) == set(index)
    for name, line in shown.items():
        with safe_open(out / index[name], "pt") as shard:
            assert str(list(shard.get_slice(name).get_shape())) in line, (name, line)
    assert f"{len(index)} tensors" in run.stdout
