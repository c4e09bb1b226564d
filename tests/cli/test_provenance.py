"""Where a conversion comes from: base_model found for local sources, no local path published, and which
source files a converted folder carries (--include/--exclude, shown by the plan)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from repack.push import plan_push
from tests.support.cli import assert_one_line_error, run_cli
from tests.support.entry_point import run_repack
from tests.support.fixtures import FIXTURES_DIR
from tests.support.hub import COMMIT as HUB_COMMIT
from tests.support.hub import make_cache, offline_env

SRC = FIXTURES_DIR / "qwen3moe-g128-sym"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SOURCE_CARD = "---\nbase_model: Qwen/Qwen3-30B-A3B\nlicense: apache-2.0\nlanguage: [en]\ntags: [chat]\n---\n# tiny\n"


def card_metadata(out: Path) -> dict:
    card = plan_push(out, "me/model").card
    return yaml.safe_load(card.split("---\n")[1])


def convert_ok(*args) -> None:
    result = run_cli("convert", *args, "--quiet")
    assert result.exit_code == 0, result.output


def test_a_folder_inside_the_hub_cache_knows_its_repo_id(tmp_path: Path):
    snapshot = tmp_path / "hub" / "models--org--tiny-moe" / "snapshots" / COMMIT
    shutil.copytree(SRC, snapshot)
    out = tmp_path / "out"
    convert_ok(snapshot, out)
    manifest = json.loads((out / "repack_manifest.json").read_text())
    assert manifest["source"]["base_model"] == "org/tiny-moe"
    assert str(tmp_path) not in (out / "repack_manifest.json").read_text()
    metadata = card_metadata(out)
    assert metadata["base_model"] == "org/tiny-moe" and metadata["base_model_relation"] == "quantized"


def test_the_source_card_names_the_base_model_and_its_metadata_carries_over(tmp_path: Path):
    source = shutil.copytree(SRC, tmp_path / "my-gptq-moe")
    (source / "README.md").write_text(SOURCE_CARD)
    out = tmp_path / "out"
    convert_ok(source, out)
    assert (out / "SOURCE_README.md").read_text() == SOURCE_CARD and not (out / "README.md").exists()
    metadata = card_metadata(out)
    assert metadata["base_model"] == "Qwen/Qwen3-30B-A3B"
    assert metadata["license"] == "apache-2.0" and metadata["language"] == ["en"] and "chat" in metadata["tags"]
    card = plan_push(out, "me/model").card
    assert str(tmp_path) not in card and str(tmp_path) not in (out / "repack_manifest.json").read_text()
    assert "[SOURCE_README.md](SOURCE_README.md)" in card


def test_base_model_option_wins_and_a_bad_one_is_one_line(tmp_path: Path):
    out = tmp_path / "out"
    convert_ok(SRC, out, "--base-model", "Qwen/Qwen3-30B-A3B")
    assert card_metadata(out)["base_model"] == "Qwen/Qwen3-30B-A3B"
    bad = tmp_path / "bad"
    assert_one_line_error(run_cli("convert", SRC, bad, "--base-model", "/home/me/model"), "--base-model", "Hub repo id")
    assert not bad.exists()


def test_a_plain_local_folder_has_no_base_model(tmp_path: Path):
    out = tmp_path / "out"
    convert_ok(SRC, out)
    assert "base_model" not in card_metadata(out)
    assert json.loads((out / "repack_manifest.json").read_text())["source"]["path"] == SRC.name


def test_only_model_files_are_copied_unless_included(tmp_path: Path):
    out = tmp_path / "out"
    convert_ok(SRC, out)
    copied = {path.name for path in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= copied
    assert not {"reference.safetensors", "reference.json", "README.txt", "quantize_config.json"} & copied
    more = tmp_path / "more"
    convert_ok(SRC, more, "--include", "reference.*", "--exclude", "tokenizer*")
    copied = {path.name for path in more.iterdir()}
    assert {"reference.safetensors", "reference.json"} <= copied
    assert not {"tokenizer.json", "tokenizer_config.json"} & copied


def test_dry_run_shows_what_is_copied_and_what_is_left_behind(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    result = run_cli("convert", SRC, tmp_path / "out", "--dry-run", "--include", "README.txt")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any("README.txt" in line and "copy" in line for line in lines)
    assert any("reference.safetensors" in line and "not copied" in line for line in lines)


def hub_metadata(out: Path) -> dict:
    return {key: value for key, value in card_metadata(out).items() if key in ("base_model", "license")}


def test_one_base_model_rule_whatever_the_same_files_are_called(tmp_path: Path):
    """The same files, with a card and without, as a local folder, as a Hub id served from the cache and as that
    cache's snapshot folder: --base-model, else the source card's base_model, else the Hub repo, else none; the
    license only ever from the source's card."""
    with_card = shutil.copytree(SRC, tmp_path / "with-card")
    (with_card / "README.md").write_text(SOURCE_CARD)
    without_card = shutil.copytree(SRC, tmp_path / "without-card")
    expected = {
        "with-card": {"base_model": "Qwen/Qwen3-30B-A3B", "license": "apache-2.0"},
        "without-card": {},
    }
    for folder in (with_card, without_card):
        repo_id = f"org/{folder.name}-gptq"
        cache = make_cache(tmp_path / folder.name, folder, repo_id)
        snapshot = cache / f"models--org--{folder.name}-gptq" / "snapshots" / HUB_COMMIT
        env = offline_env(cache)
        from_hub = expected[folder.name] or {"base_model": repo_id}  # no card: the Hub repo is all that is known
        names = {"local folder": (folder, expected[folder.name]), "Hub id": (repo_id, from_hub)}
        names["cache snapshot"] = (snapshot, from_hub)
        for how, (src, wanted) in names.items():
            out = tmp_path / "outs" / folder.name / how.replace(" ", "-")
            run = run_repack("convert", src, out, "--quiet", env=env)
            assert run.returncode == 0, run.stderr[-2000:]
            assert hub_metadata(out) == wanted, (folder.name, how)
            overridden = plan_push(out, "me/model", base_model="a/b").card
            assert yaml.safe_load(overridden.split("---\n")[1])["base_model"] == "a/b"
