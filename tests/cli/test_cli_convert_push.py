"""`repack convert SRC OUT --push REPO`: the token is checked before converting, the upload follows it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import repack.push as push_module
from repack.cli import app
from tests.support.fixtures import FIXTURES_DIR
from tests.support.hub_client import TOKEN, FakeHub, upload_call

SOURCE = FIXTURES_DIR / "qwen3moe-g128-sym"


def test_convert_then_push(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    hub = FakeHub()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(push_module, "HfApi", lambda: hub)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["convert", str(SOURCE), str(out), "--quiet", "--push", "myorg/model", "--private"]
    )
    assert result.exit_code == 0, result.output
    assert hub.method_names()[0] == "whoami"
    assert (out / "repack_manifest.json").exists()
    upload = upload_call(hub)
    assert upload["repo_id"] == "myorg/model" and Path(upload["folder_path"]) == out
    create = next(kwargs for method, _, kwargs in hub.calls if method == "create_repo")
    assert create["private"] is True


def test_bad_token_stops_before_any_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    hub = FakeHub(role="read")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(push_module, "HfApi", lambda: hub)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["convert", str(SOURCE), str(out), "--push", "myorg/model"])
    assert result.exit_code != 0
    assert not out.exists()
    assert hub.method_names() == ["whoami"]


def test_tune_without_a_gpu_is_one_line(tmp_path: Path):
    """`repack tune` needs the GPU it tunes for; here it must say so in one line, not a traceback."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tune would run for minutes")
    out = tmp_path / "out"
    assert CliRunner().invoke(app, ["convert", str(SOURCE), str(out), "--quiet"]).exit_code == 0
    result = CliRunner().invoke(app, ["tune", str(out), "--out", str(tmp_path / "cfg")])
    assert result.exit_code != 0
    assert "no CUDA GPU visible" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "cfg").exists()
