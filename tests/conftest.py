"""Test setup shared by every test file: run Triton kernels in the interpreter when there is no GPU.

The environment variable must be set before anything imports triton, so it sits at the very top.
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture
def device() -> str:
    """Where kernels run: the GPU when present, else the CPU through the Triton interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# tests/vllm run in their own environment (vLLM pins its own torch and transformers; `make test-vllm` builds it and
# installs this project's wheel there). Elsewhere there is no vLLM to test: that folder is not collected at all.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]
