"""``repack.runtime.load``'s front door: Hub ids, one conversion per load, ``verify=``, and a clear word when the
kernels cannot run (issue 13: "The runtime's front door" and item 3)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from repack.convert import convert
from repack.formats.checkpoint import CONVERSION_ID_KEY, CheckpointReader
from repack.formats.errors import RepackError
from repack.formats.stacks import MANIFEST_FILE
from repack.runtime import load
from tests.support.fixtures import FIXTURES_DIR
from tests.support.hub import make_cache, offline_env

SYM = FIXTURES_DIR / "qwen2moe-g128-sym"


def converted(out: Path) -> Path:
    convert(str(SYM), out, shard_size="100kB", quiet=True)
    return out


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return converted(tmp_path_factory.mktemp("front") / "out")


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*-of-*.safetensors"))


def test_every_file_of_a_conversion_carries_its_id(out):
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    config = json.loads((out / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    conversion = manifest[CONVERSION_ID_KEY]
    assert len(conversion) == 32
    assert config["quantization_config"][CONVERSION_ID_KEY] == conversion
    assert index["metadata"][CONVERSION_ID_KEY] == conversion
    metadata = CheckpointReader(out).metadata
    assert len(metadata) > 1 and all(m[CONVERSION_ID_KEY] == conversion for m in metadata.values())


def test_a_mix_of_two_conversions_is_refused(out, tmp_path):
    mixed = shutil.copytree(out, tmp_path / "mixed")
    other = converted(tmp_path / "other")
    shutil.copy(shards(other)[1], mixed / shards(other)[1].name)  # same layout, another conversion
    with pytest.raises(RepackError, match="mixes two conversions"):
        load(mixed, "cpu")


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_load_accepts_a_hub_id_from_the_cache(out, tmp_path):
    env = offline_env(make_cache(tmp_path, out, "org/tiny-repack"))
    code = "from repack.runtime import load; c = load('org/tiny-repack', 'cpu'); print(len(c.tensors), c.path.name)"
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    count, name = result.stdout.split()
    assert int(count) == len(CheckpointReader(out).names()) and len(name) == 40  # the snapshot's commit


def test_mistyped_local_path_says_there_is_no_such_folder(tmp_path):
    env = offline_env(tmp_path / "empty-cache")
    code = (
        "from repack.runtime import load\ntry:\n    load('models/tyop', 'cpu')\nexcept ValueError as e:\n    print(e)"
    )
    result = run_python(code, env)
    assert "no such local folder" in result.stdout and "Hub" in result.stdout, result.stdout + result.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "repack.cli", "convert", "models/tyop", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode != 0 and "no such local folder" in cli.stderr, cli.stderr


def no_interpreter_env() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    return env


def test_cpu_load_after_triton_was_imported_without_the_interpreter_is_one_clear_error(out):
    code = (
        "import triton\nfrom repack.runtime import load\n"
        f"try:\n    load({str(out)!r}, 'cpu')\nexcept ValueError as e:\n    print('refused:', e)"
    )
    result = run_python(code, no_interpreter_env())
    assert "refused:" in result.stdout and "TRITON_INTERPRET=1" in result.stdout, result.stdout + result.stderr
    assert "active drivers" not in result.stdout + result.stderr


def test_cpu_load_runs_a_block_in_the_interpreter_by_itself(out):
    code = (
        "import torch\nfrom repack.runtime import load\n"
        f"c = load({str(out)!r}, 'cpu')\nlayer = c.moe_layers[0]\n"
        "hidden = int(c.text_config['hidden_size'])\n"
        "y = c.moe_block(layer)(torch.randn(2, hidden, dtype=torch.float16))\nprint('ok', tuple(y.shape))"
    )
    result = run_python(code, no_interpreter_env())
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_no_gpu_message_does_not_suggest_a_cpu_load_that_then_fails(out):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RepackError) as caught:
        load(out, "cuda")
    assert "no CUDA GPU" in str(caught.value) and "TRITON_INTERPRET=1" in str(caught.value)
