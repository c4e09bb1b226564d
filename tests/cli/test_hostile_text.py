"""Names and values from a checkpoint are data, never markup or a crash: each odd one found by trying to break the
CLI either works (shown literally) or ends in one line, through the real `repack` script."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from repack.formats.errors import RepackError
from repack.runtime import load
from tests.support.entry_point import error_line, run_repack
from tests.support.fixtures import FIXTURES_DIR
from tests.support.manifests import restamp

SRC = FIXTURES_DIR / "qwen3moe-g128-sym"
MARKUP_TENSORS = ("model.extra[/].weight", "model.extra[bold red]x[/bold red].weight")
MARKUP_FILE = "LICENSE-[bold red]x"  # rich would eat the tag and print the name red
WIDE = dict(os.environ, COLUMNS="200")  # one table row per line


def edited_source(folder: Path, config_edit=None, tensors: dict | None = None, files: dict | None = None) -> Path:
    shutil.copytree(SRC, folder)
    if config_edit is not None:
        config = json.loads((folder / "config.json").read_text())
        config_edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    if tensors:
        weights = load_file(folder / "model.safetensors")
        weights.update(tensors)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    for name, data in (files or {}).items():
        (folder / name).write_bytes(data)
    return folder


def edit_output_config(out: Path, edit) -> Path:
    """Edit OUT/config.json and record the edit in the manifest: what is tested is the config's content, past the
    integrity checks that refuse any config the manifest does not record."""
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    restamp(out, "config.json")
    return out


@pytest.fixture(scope="module")
def markup_output(tmp_path_factory) -> Path:
    """A conversion whose tensor names, copied file name and folder name hold rich markup."""
    root = tmp_path_factory.mktemp("markup")
    extra = {name: torch.zeros(4, dtype=torch.float16) for name in MARKUP_TENSORS}
    source = edited_source(root / "src", tensors=extra, files={MARKUP_FILE: b"license"})
    (root / "w[").mkdir()
    out = root / "w[" / "]out"  # the path reads ".../w[/]out"
    run = run_repack("convert", source, out)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"wrote {out} (" in run.stderr
    return out


def test_dry_run_shows_markup_names_as_they_are(tmp_path):
    extra = {name: torch.zeros(4, dtype=torch.float16) for name in MARKUP_TENSORS}
    source = edited_source(tmp_path / "src", tensors=extra)
    # wide enough for whole names: at 80 columns the tensor column alone gives way (an ellipsis), as designed
    run = run_repack("convert", source, tmp_path / "out", "--dry-run", env=WIDE)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in MARKUP_TENSORS:
        assert name in run.stdout


def test_inspect_and_push_show_markup_names_as_they_are(markup_output: Path, tmp_path):
    inspected = run_repack("inspect", markup_output, env=WIDE)
    assert inspected.returncode == 0, inspected.stderr[-3000:]
    assert str(markup_output) in inspected.stdout
    pushed = run_repack("push", "me/model", markup_output, "--dry-run", env=WIDE)
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    (listed,) = [line for line in pushed.stdout.splitlines() if "LICENSE-" in line and "|" not in line[:2]][:1]
    assert MARKUP_FILE in listed, listed


def test_inspect_shows_a_stack_prefix_with_markup_and_refuses_a_string_count(markup_output: Path, tmp_path):
    odd = edit_output_config(
        shutil.copytree(markup_output, tmp_path / "odd"),
        lambda config: config["quantization_config"]["stacks"][0].update(prefix="model.layers.0.mlp[/]experts"),
    )
    run = run_repack("inspect", odd, env=WIDE)
    assert run.returncode == 0 and "model.layers.0.mlp[/]experts" in run.stdout, run.stderr[-3000:]
    string = edit_output_config(
        shutil.copytree(markup_output, tmp_path / "string"),
        lambda config: config["quantization_config"]["stacks"][0].update(num_experts="8"),
    )
    assert "num_experts '8' is not a JSON int" in error_line(run_repack("inspect", string))


def test_architectures_that_are_a_number_convert_inspect_and_push(tmp_path):
    source = edited_source(tmp_path / "src", lambda config: config.update(architectures=7))
    out = tmp_path / "out"
    assert run_repack("convert", source, out, "--quiet").returncode == 0
    inspected = run_repack("inspect", out)
    assert inspected.returncode == 0 and "qwen3_moe (7)" in inspected.stdout, inspected.stderr[-3000:]
    pushed = run_repack("push", "me/model", out, "--dry-run")
    assert pushed.returncode == 0 and "| architecture | 7 |" in pushed.stdout, pushed.stderr[-3000:]


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("checkpoint_format", ["gptq"], "checkpoint_format ['gptq'] is not a string"),
        ("sym", "false", "sym 'false' is not a JSON boolean"),
    ],
)
def test_quantization_values_of_the_wrong_type_are_one_line(tmp_path, key, value, expected):
    source = edited_source(tmp_path / "src", lambda config: config["quantization_config"].update({key: value}))
    line = error_line(run_repack("convert", source, tmp_path / "out"))
    assert expected in line and "config.json" in line, line
    assert not (tmp_path / "out").exists()


def test_a_file_name_that_is_not_utf8_is_one_line_in_push(tmp_path):
    source = edited_source(tmp_path / "src")
    with open(os.fsencode(source) + b"/LICENSE-\xff", "wb") as handle:  # a name no UTF-8 decoder accepts
        handle.write(b"license")
    out = tmp_path / "out"
    assert run_repack("convert", source, out, "--quiet").returncode == 0
    line = error_line(run_repack("push", "me/model", out, "--dry-run"))
    assert "LICENSE-\\udcff: the Hub takes only UTF-8 file names" in line, line
    left_out = run_repack("push", "me/model", out, "--dry-run", "--exclude", "LICENSE-*")
    assert left_out.returncode == 0 and "LICENSE-\\udcff" in left_out.stdout, left_out.stderr[-3000:]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda config: config.pop("num_experts_per_tok"), "'num_experts_per_tok' is missing"),
        (lambda config: config.update(num_experts_per_tok="two"), "wrong type"),
        (lambda config: config.update(text_config="qwen3"), "text_config is not an object"),
    ],
    ids=["missing-key", "string-top-k", "string-text-config"],
)
def test_moe_block_with_a_broken_router_config_is_one_line(markup_output: Path, tmp_path, edit, expected):
    broken = edit_output_config(shutil.copytree(markup_output, tmp_path / "broken"), edit)
    checkpoint = load(broken, device="cpu")
    with pytest.raises(RepackError, match=expected) as raised:
        checkpoint.moe_block(checkpoint.moe_layers[0])
    assert "\n" not in str(raised.value)
