"""Every command and snippet of the README and of a generated model card runs as written.

The README's set-up (`make install`/`make demo`, then `source .venv/bin/activate`) is what this interpreter's venv
and the demo's tiny source already are, so the test puts this venv's `repack` on PATH and writes the demo source.
Hub ids are served offline from a hand-made Hugging Face cache. Kernels run in Triton's interpreter on a CPU, which
the snippets switch on themselves, as they do for a user (no TRITON_INTERPRET in their environment).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from repack.convert import convert
from repack.push import plan_push
from repack.synthetic import write_demo_checkpoint
from tests.support.fixtures import FIXTURES_DIR

README = Path(__file__).resolve().parents[2] / "README.md"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SETUP_COMMANDS = ("make ", "source ")  # the README's set-up, done by the fixtures here
README_FIXTURES = ("ct-qwen3moe-g128-sym", "awq-qwen2moe-g128-asym")


VLLM_SECTION = "## Serve with vLLM"  # installs vLLM's GPU build: tests/vllm runs that flow on its CPU build instead


def without_section(markdown: str, heading: str) -> str:
    """``markdown`` less the section that starts at ``heading`` (up to the next heading of the same level)."""
    start = markdown.index(heading)
    end = markdown.find("\n## ", start + len(heading))
    return markdown[:start] + (markdown[end:] if end != -1 else "")


def fenced(markdown: str, language: str) -> list[str]:
    return [t.content for t in MarkdownIt("commonmark").parse(markdown) if t.type == "fence" and t.info == language]


def commands(block: str) -> list[str]:
    lines = (line.split("  #", 1)[0].strip() for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def cache_repo(cache: Path, repo_id: str, folder: Path) -> None:
    """``folder`` as the snapshot of ``repo_id`` in a Hugging Face cache, as a download would leave it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(folder, repo / "snapshots" / COMMIT)


def user_env(cache: Path) -> dict[str, str]:
    """A shell after `source .venv/bin/activate`, offline. No TRITON_INTERPRET: on a machine without a GPU the
    snippets must switch Triton's interpreter on by themselves (repack.runtime does, on both doors)."""
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env.pop("HF_TOKEN", None)
    return env


def run_python(code: str, cwd: Path, env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_readme_commands_and_snippets_run_as_written(tmp_path: Path):
    text = without_section(README.read_text(), VLLM_SECTION)
    write_demo_checkpoint(tmp_path / "demo-out" / "source")
    cache_repo(tmp_path / "hub", "Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4", FIXTURES_DIR / "qwen2moe-g128-sym")
    for name in README_FIXTURES:  # the AWQ and compressed-tensors section names them as the repo's paths
        shutil.copytree(FIXTURES_DIR / name, tmp_path / "tests" / "fixtures" / name)
    env = user_env(tmp_path / "hub")
    ran = 0
    for block in fenced(text, "bash"):
        for command in commands(block):
            if command.startswith(SETUP_COMMANDS):
                continue
            result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
            assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
            ran += 1
    assert ran >= 7 and (tmp_path / "out" / "repack_manifest.json").is_file()
    (snippet,) = fenced(text, "python")
    run_python(snippet, tmp_path, env)


@pytest.mark.slow
def test_card_snippets_run_from_the_hub_on_a_clean_install(tmp_path: Path):
    """The card's snippets with the pushed repo served from the cache; nothing but moe-repack[hf] is needed (no
    accelerate: no device_map)."""
    out = tmp_path / "out"
    convert(str(FIXTURES_DIR / "qwen3moe-g128-sym"), out, quiet=True)
    card = plan_push(out, "me/tiny-moe").card
    cache_repo(tmp_path / "hub", "me/tiny-moe", out)
    env = user_env(tmp_path / "hub")
    snippets = fenced(card, "python")
    assert len(snippets) == 2 and "device_map" not in card
    for snippet in snippets:
        run_python(snippet, tmp_path, env)
