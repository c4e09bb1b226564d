"""A plain ``AutoModelForCausalLM.from_pretrained(out)`` in a fresh interpreter, with nothing of ours imported and no
TRITON_INTERPRET set, runs on the stored weights: the installed package registers the ``repack`` quantizer at
start-up (moe_repack.pth) and switches Triton's interpreter on where there is no GPU. Without that, transformers
skips the unknown quant_method and initialises the MoE weights at random (relative logit error 1.38)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from repack.convert import convert
from tests.support.fixtures import FIXTURES_DIR

REPO = Path(__file__).resolve().parents[2]
FIXTURE = "qwen3moe-g128-sym"
PLAIN = """
import sys
import torch
from transformers import AutoModelForCausalLM
{extra_import}
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16)
assert type(model.model.layers[0].mlp).__name__ == "RepackMoeBlock", type(model.model.layers[0].mlp)
sys.path.insert(0, sys.argv[2])
from tests.support.fixtures import assert_logits_match_reference
assert_logits_match_reference(model, "{fixture}", model.device)
print("logits match GPTQModel's reference")
"""


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plain") / "out"
    convert(str(FIXTURES_DIR / FIXTURE), out, quiet=True)
    return out


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # set by tests/conftest.py for this process, never by a user
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("extra_import", ["", "import repack.runtime  # noqa: F401"], ids=["plain", "imported"])
def test_from_pretrained_in_a_fresh_interpreter_runs_the_stored_weights(converted: Path, tmp_path, extra_import):
    code = PLAIN.format(extra_import=extra_import, fixture=FIXTURE)
    result = subprocess.run(
        [sys.executable, "-c", code, str(converted), str(REPO)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "logits match GPTQModel's reference" in result.stdout
