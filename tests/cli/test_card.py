"""The generated model card: valid YAML front matter the Hub understands, markdown with provenance and
working load snippets, and a marker that tells a generated card from an edited one."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import tomllib
import yaml
from markdown_it import MarkdownIt

from repack.card import is_generated_card, render_model_card
from repack.convert import convert
from repack.formats.manifest import SELF_CHECKSUM, Manifest, self_checksum
from tests.support.entry_point import run_repack
from tests.support.fixtures import FIXTURES_DIR

SOURCE_FILES = {
    "config.json": {"sha256": "a" * 64, "size": 1234},
    "model.safetensors": {"sha256": "b" * 64, "size": 987654},
    "tokenizer.json": {"sha256": "c" * 64, "size": 4321},
}
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_manifest(**source) -> Manifest:
    data = {
        "format": "repack-moe",
        "format_version": 2,
        "converter_version": "0.1.0",
        "source": {"repo_id": "Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4", "revision": REVISION},
        "source_files": SOURCE_FILES,
        "output_files": {"config.json": {"sha256": "d" * 64, "size": 99}},
        "created": "2025-01-02T03:04:05Z",
    }
    if source:
        data["source"] = source
    return parse_manifest(data)


def parse_manifest(data: dict) -> Manifest:
    """A manifest written by hand, with the checksum of itself that every manifest carries."""
    data = {key: value for key, value in data.items() if key != SELF_CHECKSUM}
    return Manifest.parse(json.dumps({**data, SELF_CHECKSUM: self_checksum(data)}).encode())


def repack_config(act_order: bool = False) -> dict:
    stack = {
        "prefix": "model.layers.0.mlp.experts",
        "kind": "routed",
        "num_experts": 64,
        "hidden_size": 3584,
        "intermediate_size": 2560,
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "act_order_w13": act_order,
        "act_order_w2": act_order,
        "word_order": "mma128",
    }
    shared = dict(stack, prefix="model.layers.0.mlp.shared_experts", kind="shared", num_experts=8)
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "quantization_config": {
            "quant_method": "repack",
            "format": "repack-moe",
            "format_version": 2,
            "bits": 4,
            "group_size": 128,
            "sym": True,
            "stacks": [stack, shared],
        },
    }


def split_card(card: str) -> tuple[dict, str]:
    """Front matter as the Hub reads it (YAML between the first two `---` lines) and the markdown body."""
    match = re.match(r"---\n(.*?)\n---\n(.*)\Z", card, flags=re.DOTALL)
    assert match is not None, "the card must start with YAML front matter"
    return yaml.safe_load(match.group(1)), match.group(2)


def fenced_code(markdown: str, language: str) -> list[str]:
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [token.content for token in tokens if token.type == "fence" and token.info == language]


def test_front_matter_declares_a_quantized_derivative_of_the_source():
    metadata, _ = split_card(
        render_model_card(hub_manifest(), repack_config(), repo_id="myorg/qwen-repack", speed_table=None)
    )
    assert metadata == {
        "base_model": "Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4",
        "base_model_relation": "quantized",
        "library_name": "repack",
        "pipeline_tag": "text-generation",
        "tags": ["moe", "gptq", "int4", "repack"],
    }


def test_body_states_format_source_revision_and_every_source_checksum():
    _, body = split_card(
        render_model_card(hub_manifest(), repack_config(), repo_id="myorg/qwen-repack", speed_table=None)
    )
    assert "repack-moe v2" in body
    assert "moe-repack 0.1.0" in body
    assert "Qwen2MoeForCausalLM" in body
    assert "GPTQ int4, group size 128, symmetric" in body
    assert f"`{REVISION}`" in body
    for name, entry in SOURCE_FILES.items():
        row = f"| {name.replace('_', chr(92) + '_')} | {entry['size']} | `{entry['sha256']}` |"
        assert row in body
    tokens = MarkdownIt("commonmark").enable("table").parse(body)
    assert sum(token.type == "table_open" for token in tokens) == 2  # format table + checksum table


def test_load_snippets_use_the_runtime_and_plain_transformers():
    _, body = split_card(
        render_model_card(hub_manifest(), repack_config(), repo_id="myorg/qwen-repack", speed_table=None)
    )
    runtime_snippet, transformers_snippet = fenced_code(body, "python")
    assert "from repack.runtime import load" in runtime_snippet
    assert 'snapshot_download("myorg/qwen-repack")' in runtime_snippet
    assert "repack" not in transformers_snippet.replace("myorg/qwen-repack", "")  # moe-repack registers itself
    assert 'AutoModelForCausalLM.from_pretrained("myorg/qwen-repack"' in transformers_snippet
    for snippet in (runtime_snippet, transformers_snippet):
        compile(snippet, "<card snippet>", "exec")


def test_the_install_line_installs_this_project_from_its_source_url_in_pyproject():
    """Someone who has only the card can install the tool: the line is pip, the project's name and extra as
    pyproject declares them, from the Source URL of pyproject's [project.urls]."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    _, body = split_card(render_model_card(hub_manifest(), repack_config(), repo_id="o/r", speed_table=None))
    (line,) = re.findall(r"`(pip install [^`]*)`", body)
    assert line == f"pip install '{project['name']}[hf] @ git+{project['urls']['Source']}'"
    assert "hf" in project["optional-dependencies"]
    assert f"[moe-repack]({project['urls']['Source']})" in body
    assert "make wheel" not in body


def test_the_card_repack_push_shows_carries_that_line(tmp_path):
    """The card as a user gets it from the installed script: `repack push --dry-run` of a real conversion."""
    out = tmp_path / "out"
    convert(str(FIXTURES_DIR / "qwen3moe-g128-sym"), out, quiet=True)
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    run = run_repack("push", "me/tiny", out, "--dry-run", env=dict(os.environ, COLUMNS="400"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"`pip install '{project['name']}[hf] @ git+{project['urls']['Source']}'`" in run.stdout


def test_speed_table_is_embedded_only_when_given():
    table = "| M | ours (us) | Marlin (us) |\n|---:|---:|---:|\n| 1 | 40 | 68 |\n"
    with_table = render_model_card(hub_manifest(), repack_config(), repo_id="o/r", speed_table=table)
    without = render_model_card(hub_manifest(), repack_config(), repo_id="o/r", speed_table=None)
    assert "## Measured speed" in with_table and table.strip() in with_table
    assert "## Measured speed" not in without
    tokens = MarkdownIt("commonmark").enable("table").parse(split_card(with_table)[1])
    assert sum(token.type == "table_open" for token in tokens) == 3


def test_local_source_has_no_base_model_and_never_publishes_its_path():
    manifest = hub_manifest(path="/data/my-gptq-moe", revision=None)
    card = render_model_card(manifest, repack_config(), repo_id="o/r", speed_table=None)
    metadata, body = split_card(card)
    assert "base_model" not in metadata and "base_model_relation" not in metadata
    assert "/data" not in card and "my-gptq-moe" not in card
    assert "a local folder (its path is not published)" in body


def test_local_source_with_a_known_base_model_links_it():
    manifest = hub_manifest(path="my-gptq-moe", revision=None, base_model="Qwen/Qwen2-57B-A14B")
    metadata, body = split_card(render_model_card(manifest, repack_config(), repo_id="o/r", speed_table=None))
    assert metadata["base_model"] == "Qwen/Qwen2-57B-A14B"
    assert metadata["base_model_relation"] == "quantized"
    assert "[Qwen/Qwen2-57B-A14B](https://huggingface.co/Qwen/Qwen2-57B-A14B)" in body
    override = render_model_card(manifest, repack_config(), repo_id="o/r", speed_table=None, base_model="a/b")
    assert split_card(override)[0]["base_model"] == "a/b"


def test_source_card_license_language_and_tags_carry_over():
    source_card = {"license": "other", "license_name": "qwen", "language": ["en", "zh"], "tags": ["chat", "moe"]}
    card = render_model_card(hub_manifest(), repack_config(), repo_id="o/r", speed_table=None, source_card=source_card)
    metadata, _ = split_card(card)
    assert metadata["license"] == "other" and metadata["license_name"] == "qwen"
    assert metadata["language"] == ["en", "zh"]
    assert metadata["tags"] == ["chat", "moe", "gptq", "int4", "repack"]


def test_source_names_cannot_inject_markup_into_the_card():
    """Architecture names and source file names are untrusted: no heading, link, HTML or code span escapes."""
    hostile = "</td><script>alert(1)</script>\n# Pwned [click](https://evil.example) `x` <img src=x>"
    config = repack_config()
    config["architectures"] = [hostile]
    data = json.loads(hub_manifest().raw)
    data["source_files"] = {hostile.replace("/", "_"): {"sha256": "f" * 64, "size": 1}}
    manifest = parse_manifest(data)
    _, body = split_card(render_model_card(manifest, config, repo_id="o/r", speed_table=None))
    tokens = MarkdownIt("commonmark").enable("table").parse(body)
    inline = [child for token in tokens for child in (token.children or [])]
    html = [t.content for t in [*tokens, *inline] if t.type in ("html_block", "html_inline")]
    assert all(part.startswith(("<details>", "</details>", "<!-- repack-card")) for part in html), html
    assert [t.content for t in tokens if t.type == "inline" and "Pwned" in t.content]  # shown, as text
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert not any("Pwned" in heading for heading in headings)
    links = [t.attrGet("href") for t in inline if t.type == "link_open"]
    assert "https://evil.example" not in links


def test_license_and_act_order_are_reported():
    card = render_model_card(
        hub_manifest(), repack_config(act_order=True), repo_id="o/r", speed_table=None, source_card={"license": "mit"}
    )
    metadata, body = split_card(card)
    assert metadata["license"] == "mit"
    assert "| act-order | resolved at conversion |" in body
    assert "| shared expert | stored as 8 routed-size chunk(s) |" in body


def test_generated_card_is_recognised_and_any_edit_is_detected():
    card = render_model_card(hub_manifest(), repack_config(), repo_id="o/r", speed_table=None)
    assert is_generated_card(card)
    assert is_generated_card(card + "\n")  # an editor adding a final newline is not an edit
    assert not is_generated_card(card.replace("## How to load", "## How to use"))
    marker = card.rstrip("\n").rpartition("\n")[2]
    assert not is_generated_card(card.replace(marker + "\n", ""))
    assert not is_generated_card("# my own card\n")


@pytest.mark.parametrize("repo_id", ["myorg/model", "someone/else"])
def test_rendering_is_deterministic(repo_id: str):
    first = render_model_card(hub_manifest(), repack_config(), repo_id=repo_id, speed_table=None)
    second = render_model_card(hub_manifest(), repack_config(), repo_id=repo_id, speed_table=None)
    assert first == second
