"""Hub ids from a hand-made Hugging Face cache, offline: the manifest records the resolved commit."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.fixtures import FIXTURES_DIR
from tests.support.hub import COMMIT, offline_env
from tests.support.hub import make_cache as make_hub_cache

SRC = FIXTURES_DIR / "qwen3moe-g128-sym"


def make_cache(tmp_path):
    return make_hub_cache(tmp_path, SRC)


def repack(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "repack.cli", *map(str, args)], env=env, capture_output=True, text=True, timeout=120
    )


def test_convert_and_verify_hub_id_from_offline_cache(tmp_path):
    cache = make_cache(tmp_path)
    env = offline_env(cache)
    out = tmp_path / "out"
    result = repack("convert", "org/tiny-moe", out, "--quiet", env=env)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "repack_manifest.json").read_text())
    assert manifest["source"] == {
        "repo_id": "org/tiny-moe",
        "revision": COMMIT,
        "base_model": "org/tiny-moe",
        "quant_format": "gptq",
    }
    assert "model.safetensors" in manifest["source_files"]
    verified = repack("verify", out, "--source", "org/tiny-moe", env=env)
    assert verified.returncode == 0 and "bit-exact" in verified.stdout, verified.stderr


def test_unreachable_hub_id_offline_is_one_line(tmp_path):
    env = offline_env(tmp_path / "empty-cache")
    out = tmp_path / "out"
    result = repack("convert", "org/not-cached", out, env=env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: org/not-cached"), result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
