"""`repack push` without network: a fake Hub client records every call, and the tests assert them exactly.

The checkpoint folders here are built by hand in the shape SPEC section 5 describes (shards, index, config
with the repack quantization_config, the source's README kept as SOURCE_README.md, repack_manifest.json with the
sha256 of every file), so these tests do not depend on the converter.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import save_file
from typer.testing import CliRunner

import repack.push as push_module
from repack.card import is_generated_card
from repack.cli import app
from repack.formats.errors import RepackError
from repack.formats.manifest import SELF_CHECKSUM, self_checksum
from repack.push import (
    HubAccess,
    check_hub_access,
    plan_push,
    push_after_convert,
    push_checkpoint,
)
from tests.support.fixtures import FIXTURES_DIR
from tests.support.hub_client import HTTP, TOKEN, FakeHub, NoNetwork, http_error, pull_request, upload_call

SOURCE_REPO = "Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4"
SOURCE_REVISION = "f" * 40
SOURCE_CARD = "---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n\n# Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4\n"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_checkpoint(out: Path, *, source: dict | None = None, source_card: str = "SOURCE_README.md") -> Path:
    """A small repack-moe v1 folder as `repack convert` leaves it, manifest included (older converters copied the
    source's card as README.md: ``source_card="README.md"``)."""
    out.mkdir(parents=True)
    config = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "quantization_config": {
            "quant_method": "repack",
            "format": "repack-moe",
            "format_version": 1,
            "bits": 4,
            "group_size": 128,
            "sym": True,
            "stacks": [{"prefix": "model.layers.0.mlp.experts", "kind": "routed", "num_experts": 4}],
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({"model.layers.0.mlp.experts.w13_qweight": torch.arange(64, dtype=torch.int32)}, out / SHARDS[0])
    save_file({"model.embed_tokens.weight": torch.ones(4, 8, dtype=torch.float16)}, out / SHARDS[1])
    weight_map = {"model.layers.0.mlp.experts.w13_qweight": SHARDS[0], "model.embed_tokens.weight": SHARDS[1]}
    index = {"weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")
    (out / "tokenizer.json").write_text('{"version": "1.0"}\n')
    (out / source_card).write_text(SOURCE_CARD)
    output_names = ["config.json", *SHARDS, "model.safetensors.index.json", "tokenizer.json", source_card]
    manifest = {
        "format": "repack-moe",
        "format_version": 1,
        "converter_version": "0.1.0",
        "source": source or {"repo_id": SOURCE_REPO, "revision": SOURCE_REVISION},
        "source_files": {"model.safetensors": {"sha256": "e" * 64, "size": 1000}},
        "output_files": {
            name: {"sha256": sha256_of(out / name), "size": (out / name).stat().st_size} for name in output_names
        },
        "created": "2025-01-02T03:04:05Z",
    }
    manifest[SELF_CHECKSUM] = self_checksum(manifest)
    (out / "repack_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def expected_patterns() -> list[str]:
    """Every manifest file except README.md (sorted, as verified), then the manifest, then our card."""
    listed = sorted(["config.json", *SHARDS, "model.safetensors.index.json", "tokenizer.json", "SOURCE_README.md"])
    return [*listed, "repack_manifest.json", "README.md"]


def expected_commit_message(out: Path) -> str:
    digest = sha256_of(out / "repack_manifest.json")[:12]
    return f"Upload repack-moe v1 of {SOURCE_REPO}@{SOURCE_REVISION[:12]} (manifest {digest})"


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return build_checkpoint(tmp_path / "out")


@pytest.fixture
def no_cached_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No HF_TOKEN and an empty token file location, so huggingface_hub's own lookup finds nothing."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))


def assert_one_line(error: RepackError, *fragments: str) -> None:
    message = str(error)
    assert "\n" not in message and message.strip() == message
    for fragment in fragments:
        assert fragment in message, message


def test_push_to_main_makes_exactly_these_calls(out: Path):
    hub = FakeHub()
    result = push_checkpoint(out, "model", api=hub, token=TOKEN)

    assert hub.calls[:2] == [
        ("whoami", (), {"token": TOKEN}),
        ("create_repo", ("me/model",), {"token": TOKEN, "private": False, "exist_ok": True, "repo_type": "model"}),
    ]
    assert hub.method_names() == ["whoami", "create_repo", "upload_folder"]
    assert upload_call(hub) == {
        "repo_id": "me/model",
        "folder_path": str(out),
        "commit_message": expected_commit_message(out),
        "commit_description": "Converted by moe-repack 0.1.0; checksums of every file in repack_manifest.json.",
        "token": TOKEN,
        "repo_type": "model",
        "revision": "main",
        "create_pr": False,
        "allow_patterns": expected_patterns(),
    }
    assert result.revision == "main" and result.commit_url.endswith("/commit/abc")


@pytest.mark.parametrize("source_card", ["SOURCE_README.md", "README.md"])
def test_push_writes_the_card_and_keeps_the_source_cards_license(tmp_path: Path, source_card: str):
    """From the source card kept as SOURCE_README.md, or (older outputs) copied as README.md, which is replaced."""
    out = build_checkpoint(tmp_path / "out", source_card=source_card)
    push_checkpoint(out, "myorg/model", api=FakeHub(), token=TOKEN)
    card = (out / "README.md").read_text()
    assert is_generated_card(card)
    metadata = yaml.safe_load(card.split("---\n")[1])
    assert metadata["license"] == "apache-2.0"
    assert metadata["base_model"] == SOURCE_REPO
    assert "myorg/model" in card


def test_private_push_to_a_branch_creates_the_branch_first(out: Path):
    hub = FakeHub()
    push_checkpoint(out, "myorg/model", api=hub, token=TOKEN, private=True, revision="int4-repack")
    assert hub.calls[1] == (
        "create_repo",
        ("myorg/model",),
        {"token": TOKEN, "private": True, "exist_ok": True, "repo_type": "model"},
    )
    assert hub.calls[2] == (
        "create_branch",
        ("myorg/model",),
        {"branch": "int4-repack", "token": TOKEN, "exist_ok": True, "repo_type": "model"},
    )
    upload = upload_call(hub)
    assert (upload["revision"], upload["create_pr"]) == ("int4-repack", False)


def test_create_pr_without_an_open_pr_opens_one(out: Path):
    title = expected_commit_message(out)
    hub = FakeHub(discussions=[pull_request(2, title, status="closed"), pull_request(5, "Some other upload")])
    result = push_checkpoint(out, "me/model", api=hub, token=TOKEN, create_pr=True)
    assert hub.calls[2] == (
        "get_repo_discussions",
        ("me/model",),
        {"author": "me", "discussion_type": "pull_request", "token": TOKEN},
    )
    upload = upload_call(hub)
    assert (upload["revision"], upload["create_pr"]) == (None, True)
    assert result.pr_url == "https://huggingface.co/me/model/discussions/3"


@pytest.mark.parametrize("status", ["open", "draft"])
def test_create_pr_resumes_into_the_pr_opened_for_this_checkpoint(out: Path, status: str):
    title = expected_commit_message(out)
    hub = FakeHub(discussions=[pull_request(5, "Some other upload"), pull_request(7, title, status=status)])
    result = push_checkpoint(out, "me/model", api=hub, token=TOKEN, create_pr=True)
    upload = upload_call(hub)
    assert (upload["revision"], upload["create_pr"]) == ("refs/pr/7", False)
    assert upload["commit_message"] == title
    assert result.revision == "refs/pr/7"


def test_an_interrupted_push_resumes_with_the_same_upload(out: Path):
    hub = FakeHub()
    hub.fail["upload_folder"] = HTTP.ReadTimeout("timed out")
    with pytest.raises(RepackError) as interrupted:
        push_checkpoint(out, "me/model", api=hub, token=TOKEN)
    assert_one_line(interrupted.value, "cannot reach the Hugging Face Hub", "me/model", "resumes")
    first = upload_call(hub)

    hub.calls.clear()
    del hub.fail["upload_folder"]
    push_checkpoint(out, "me/model", api=hub, token=TOKEN)  # our card from the first run is not "edited"
    assert upload_call(hub) == first


def test_create_pr_cannot_target_another_branch(out: Path):
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=NoNetwork(), token=TOKEN, create_pr=True, revision="dev")
    assert_one_line(error.value, "--create-pr", "--revision dev")


def test_dry_run_touches_no_network_and_writes_nothing(out: Path, no_cached_token: None):
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    result = push_checkpoint(out, "myorg/model", api=NoNetwork(), dry_run=True)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert result.dry_run and result.plan.write_card
    assert [upload.name for upload in result.plan.files] == expected_patterns()


def test_dry_run_command_prints_files_sizes_and_the_card(out: Path, no_cached_token: None):
    result = CliRunner().invoke(app, ["push", "myorg/model", str(out), "--dry-run"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for name in expected_patterns():
        assert name in result.output
    shard_size = (out / SHARDS[0]).stat().st_size
    assert f"{shard_size} bytes" in result.output
    assert "verified 6 files" in result.stderr  # the progress bar of the hashing, on stderr
    narrow = CliRunner().invoke(app, ["push", "myorg/model", str(out), "--dry-run"], terminal_width=60)
    card = plan_push(out, "myorg/model").card
    assert card in narrow.output  # printed verbatim: long lines are not re-wrapped to the terminal


def test_command_pushes_with_the_token_from_the_environment(out: Path, monkeypatch: pytest.MonkeyPatch):
    hub = FakeHub()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(push_module, "HfApi", lambda: hub)
    result = CliRunner().invoke(app, ["push", str(out), "myorg/model", "--private"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert hub.calls[0] == ("whoami", (), {"token": TOKEN})
    assert upload_call(hub)["repo_id"] == "myorg/model"
    assert "pushed 8 files" in result.output


def test_missing_token_is_one_line_before_any_network(out: Path, no_cached_token: None):
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=NoNetwork())
    assert_one_line(error.value, "no Hugging Face token", "HF_TOKEN", "hf auth login")


def test_invalid_token_is_one_line(out: Path):
    hub = FakeHub()
    hub.fail["whoami"] = http_error(401, "Unauthorized")
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=hub, token="hf_wrong")
    assert_one_line(error.value, "rejected the token (401 Unauthorized)", "me/model")
    assert hub.method_names() == ["whoami"]


def test_read_only_token_is_refused_before_uploading(out: Path):
    hub = FakeHub(role="read")
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=hub, token=TOKEN)
    assert_one_line(error.value, "read-only", "write access")
    assert hub.method_names() == ["whoami"]


@pytest.mark.parametrize(
    ("method", "status", "reason"), [("create_repo", 409, "Conflict"), ("upload_folder", 403, "Forbidden")]
)
def test_name_owned_by_someone_else_is_one_line(out: Path, method: str, status: int, reason: str):
    hub = FakeHub()
    hub.fail[method] = http_error(status, reason)
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "Qwen/model", api=hub, token=TOKEN)
    assert_one_line(error.value, "user 'me' may not write to Qwen/model", f"({status} {reason})", "me, myorg")


@pytest.mark.parametrize(
    "failure", [HTTP.ConnectError("[Errno -3] Temporary failure in name resolution"), ConnectionError("refused")]
)
def test_no_network_is_one_line(out: Path, failure: Exception):
    hub = FakeHub()
    hub.fail["whoami"] = failure
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=hub, token=TOKEN)
    assert_one_line(error.value, "cannot reach the Hugging Face Hub", "network")


def test_offline_mode_is_one_line(out: Path):
    hub = FakeHub()
    hub.fail["create_repo"] = OfflineModeIsEnabled("offline")
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=hub, token=TOKEN)
    assert_one_line(error.value, "HF_HUB_OFFLINE")


def test_a_bug_keeps_its_traceback(out: Path):
    hub = FakeHub()
    hub.fail["upload_folder"] = KeyError("programming error")
    with pytest.raises(KeyError):
        push_checkpoint(out, "me/model", api=hub, token=TOKEN)


def test_corrupt_shard_is_refused_before_creating_the_repo(out: Path):
    shard = out / SHARDS[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    hub = FakeHub()
    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=hub, token=TOKEN)
    assert_one_line(error.value, SHARDS[1], "sha256", "repack convert")
    assert hub.method_names() == ["whoami"]
    assert not (out / "README.md").exists()


def test_truncated_and_missing_files_are_refused(out: Path):
    (out / SHARDS[0]).write_bytes((out / SHARDS[0]).read_bytes()[:-10])
    with pytest.raises(RepackError) as truncated:
        plan_push(out, "me/model")
    assert_one_line(truncated.value, SHARDS[0], "truncated")
    (out / SHARDS[0]).unlink()
    with pytest.raises(RepackError) as missing:
        plan_push(out, "me/model")
    assert_one_line(missing.value, SHARDS[0], "missing")


def test_manifest_naming_a_file_outside_the_folder_is_refused(out: Path):
    manifest_path = out / "repack_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["output_files"]["../secrets.txt"] = {"sha256": "0" * 64, "size": 1}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(RepackError) as error:
        plan_push(out, "me/model")
    assert_one_line(error.value, "outside the folder", "../secrets.txt")


def test_not_a_converted_folder_is_refused(tmp_path: Path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text("{}")
    with pytest.raises(RepackError) as no_manifest:
        plan_push(tmp_path / "plain", "me/model")
    assert_one_line(no_manifest.value, "repack_manifest.json not found", "repack convert")
    with pytest.raises(RepackError) as no_folder:
        plan_push(tmp_path / "nowhere", "me/model")
    assert_one_line(no_folder.value, "no such folder")


def test_unknown_format_version_is_refused(out: Path):
    manifest_path = out / "repack_manifest.json"
    manifest_path.write_text(json.dumps(dict(json.loads(manifest_path.read_text()), format_version=99)))
    with pytest.raises(RepackError) as error:
        plan_push(out, "me/model")
    assert_one_line(error.value, "format_version 99", "upgrade moe-repack")


def test_edited_readme_is_kept_unless_forced(out: Path):
    hub = FakeHub()
    push_checkpoint(out, "me/model", api=hub, token=TOKEN)
    edited = (out / "README.md").read_text().replace("## How to load", "## How to load (my notes)")
    (out / "README.md").write_text(edited)

    with pytest.raises(RepackError) as error:
        push_checkpoint(out, "me/model", api=hub, token=TOKEN)
    assert_one_line(error.value, "README.md was edited by hand", "--force")
    assert (out / "README.md").read_text() == edited
    assert hub.method_names().count("upload_folder") == 1

    push_checkpoint(out, "me/model", api=hub, token=TOKEN, force=True)
    assert is_generated_card((out / "README.md").read_text())


def test_a_hand_written_readme_is_refused_but_our_older_card_is_regenerated(out: Path, tmp_path: Path):
    (out / "README.md").write_text("# my notes\n")
    with pytest.raises(RepackError):
        plan_push(out, "me/model")

    speeds = tmp_path / "speeds.md"
    speeds.write_text("| M | us |\n|---|---|\n| 1 | 40 |\n")
    push_checkpoint(out, "me/model", api=FakeHub(), token=TOKEN, force=True)
    plan = plan_push(out, "me/model", speed_table=speeds)  # older generated card: no --force needed
    assert plan.write_card and "| 1 | 40 |" in plan.card
    assert plan_push(out, "me/model").write_card is False  # identical card: nothing to write


def test_stray_files_are_not_uploaded(out: Path):
    (out / "notes.txt").write_text("scratch")
    (out / ".cache").mkdir()
    (out / ".cache" / "upload.lock").write_text("")
    plan = plan_push(out, "me/model")
    assert plan.not_uploaded == ("notes.txt",)
    assert "notes.txt" not in plan.allow_patterns


def test_speed_table_goes_into_the_card_and_a_missing_one_is_an_error(out: Path, tmp_path: Path):
    speeds = tmp_path / "RESULTS.md"
    speeds.write_text("| M | ours | Marlin |\n|---|---|---|\n| 1 | 40 us | 68 us |\n")
    hub = FakeHub()
    push_checkpoint(out, "me/model", api=hub, token=TOKEN, speed_table=speeds)
    assert "| 1 | 40 us | 68 us |" in (out / "README.md").read_text()
    with pytest.raises(RepackError) as error:
        plan_push(out, "me/model", speed_table=tmp_path / "missing.md")
    assert_one_line(error.value, "missing.md", "speed table")


def test_invalid_repo_id_is_one_line(out: Path):
    with pytest.raises(RepackError) as error:
        plan_push(out, "me/model/extra")
    assert_one_line(error.value, "'me/model/extra' is not a valid Hub repo id")


def test_local_source_card_has_no_base_model(tmp_path: Path):
    out = build_checkpoint(tmp_path / "out", source={"path": "/data/my-gptq-moe", "revision": None})
    plan = plan_push(out, "me/model")
    metadata = yaml.safe_load(plan.card.split("---\n")[1])
    assert "base_model" not in metadata
    assert "of a local checkpoint (manifest" in plan.commit_message


def test_convert_then_push_checks_access_first_and_pushes_without_asking_again(out: Path):
    hub = FakeHub()
    access = check_hub_access("model", token=TOKEN, api=hub)
    assert access == HubAccess(token=TOKEN, user="me", orgs=("myorg",))
    push_after_convert(out, "model", access, api=hub)
    assert hub.method_names() == ["whoami", "create_repo", "upload_folder"]
    assert upload_call(hub)["repo_id"] == "me/model"


def test_allow_patterns_select_exactly_the_planned_files(out: Path):
    """Hub patterns are globs: checked with huggingface_hub's own matcher on every file in OUT."""
    (out / "notes.txt").write_text("scratch")
    (out / "model-00001-of-00002.safetensors.bak").write_text("old")
    plan = plan_push(out, "me/model")
    on_disk = sorted([*(path.name for path in out.iterdir()), "README.md"])  # the card is written at upload
    selected = list(filter_repo_objects(on_disk, allow_patterns=plan.allow_patterns))
    assert sorted(selected) == sorted(upload.name for upload in plan.files)


def test_command_error_is_one_line_on_stderr_with_a_nonzero_exit(tmp_path: Path):
    result = CliRunner().invoke(app, ["push", "me/model", str(tmp_path / "missing"), "--dry-run"])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "no such folder" in result.stderr


def test_push_of_a_real_conversion(tmp_path: Path):
    """The converter's own output (a GPTQModel fixture converted) passes verification and uploads whole."""
    from repack.convert import convert

    out = tmp_path / "out"
    manifest = convert(str(FIXTURES_DIR / "qwen3moe-g128-sym"), out, shard_size="200KB", quiet=True)
    hub = FakeHub()
    push_checkpoint(out, "myorg/tiny-qwen3moe", api=hub, token=TOKEN)
    expected = sorted(manifest.checked_output_files)
    assert upload_call(hub)["allow_patterns"] == [*expected, "repack_manifest.json", "README.md"]
    assert len([name for name in expected if name.endswith(".safetensors")]) > 1
    assert is_generated_card((out / "README.md").read_text())


def hub_reachable() -> bool:
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=3):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not os.environ.get("HF_TOKEN") or not hub_reachable(), reason="needs HF_TOKEN and the Hub")
def test_live_push_to_the_real_hub(out: Path):
    """The only test that talks to huggingface.co: push privately, read the files back, delete the repo."""
    from huggingface_hub import HfApi

    api = HfApi()
    access = check_hub_access("x", api=api)
    repo_id = f"{access.user}/repack-push-test-{uuid.uuid4().hex[:8]}"
    try:
        result = push_checkpoint(out, repo_id, api=api, private=True, access=access)
        remote = set(api.list_repo_files(repo_id, token=access.token))
        assert set(expected_patterns()) <= remote
        assert result.commit_url
    finally:
        api.delete_repo(repo_id, token=access.token, missing_ok=True)


def test_both_argument_orders_name_the_same_push(out: Path, no_cached_token: None):
    """`repack push REPO_ID [LOCAL_PATH]` as `hf upload`, and the older `repack push LOCAL_PATH REPO_ID`."""
    hf_order = CliRunner().invoke(app, ["push", "myorg/model", str(out), "--dry-run"], terminal_width=200)
    old_order = CliRunner().invoke(app, ["push", str(out), "myorg/model", "--dry-run"], terminal_width=200)
    assert hf_order.exit_code == old_order.exit_code == 0, hf_order.output + old_order.output
    assert "would upload to myorg/model" in hf_order.output
    assert hf_order.stdout == old_order.stdout


def test_local_path_defaults_to_the_current_folder(out: Path, no_cached_token: None, monkeypatch):
    monkeypatch.chdir(out)
    result = CliRunner().invoke(app, ["push", "myorg/model", "--dry-run"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "would upload to myorg/model" in result.output


def test_include_exclude_and_commit_message(out: Path):
    hub = FakeHub()
    push_checkpoint(
        out, "me/model", api=hub, token=TOKEN, exclude=["tokenizer*", "SOURCE_README.md"], commit_message="int4 MoE"
    )
    upload = upload_call(hub)
    assert "tokenizer.json" not in upload["allow_patterns"] and "SOURCE_README.md" not in upload["allow_patterns"]
    assert SHARDS[0] in upload["allow_patterns"] and "README.md" in upload["allow_patterns"]
    assert upload["commit_message"] == "int4 MoE"
    only_weights = plan_push(out, "me/model", include=["*.safetensors", "*.json"])
    assert "tokenizer.json" in [upload.name for upload in only_weights.files]
    assert "SOURCE_README.md" in only_weights.not_uploaded
    with pytest.raises(RepackError) as error:
        plan_push(out, "me/model", exclude=["*.safetensors"])
    assert_one_line(error.value, "would leave out", SHARDS[0])


def test_base_model_option_and_invalid_ids_are_one_line(out: Path):
    plan = plan_push(out, "me/model", base_model="Qwen/Qwen1.5-MoE-A2.7B")
    assert "base_model: Qwen/Qwen1.5-MoE-A2.7B\n" in plan.card
    with pytest.raises(RepackError) as error:
        plan_push(out, "me/model", base_model="/home/me/model")
    assert_one_line(error.value, "--base-model", "not a valid Hub repo id")
