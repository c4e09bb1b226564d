"""Converted checkpoints for the vLLM tests, built once per session from the installed wheel of this project.

These tests run in the vLLM environment (`make test-vllm`), where ``repack`` must be the wheel installed there,
not this source tree: the plugin reaches vLLM through the wheel's entry point, which is what users get.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: one less fork per LLM

from tests.support.fixtures import FIXTURES_DIR  # noqa: E402

SOURCE_TREE = Path(__file__).parents[2]


def pytest_sessionstart(session) -> None:
    import repack.runtime

    # The venv may live inside the tree (.venv-vllm): what must not be imported is the source package folder itself.
    if Path(repack.runtime.__file__).resolve().parent == (SOURCE_TREE / "runtime").resolve():
        raise pytest.UsageError(
            f"repack is imported from the source tree ({repack.runtime.__file__}), not an installed wheel; run "
            "`make test-vllm` (pytest --import-mode=append from the vLLM venv)"
        )


def convert(source: Path, out: Path) -> Path:
    from repack.convert import convert as convert_checkpoint

    convert_checkpoint(str(source), out, quiet=True)
    return out


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """name -> converted checkpoint folder: the real fixtures, a Mixtral, DeepSeek-V2/V3 and a Qwen2-MoE whose shared
    expert joins."""
    from repack.formats.gptq import GptqScheme
    from repack.synthetic import write_demo_checkpoint, write_synthetic_checkpoint
    from tests.support.checkpoints import VLLM_MLA_DIMS

    root = tmp_path_factory.mktemp("vllm-checkpoints")
    cache: dict[str, Path] = {}
    small = dict(  # 4-bit g128, 8 experts of 128 in a 256-wide model
        scheme=GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq"),
        hidden_size=256,
        intermediate_size=128,
        num_experts=8,
        top_k=2,
        vocab_size=512,
    )

    def get(name: str) -> Path:
        if name in cache:
            return cache[name]
        if name == "mixtral":  # transformers 5 names (mlp.experts.*.gate_proj), 4-bit g128
            source = write_synthetic_checkpoint(root / "mixtral-source", family="mixtral", mixtral_naming="v5", **small)
        elif name in ("deepseek_v2", "deepseek_v3"):  # a dense first layer, MLA attention, a stacked shared expert
            source = write_synthetic_checkpoint(
                root / f"{name}-source",
                family=name,
                dense_first_layers=1,
                **VLLM_MLA_DIMS,  # what vLLM's MLA takes, on the CPU and on the H200
                **small,
            )
        elif name == "qwen2moe-joined-actorder":  # shared expert = 2 routed-size chunks, stored joinable; act-order
            source = write_demo_checkpoint(root / "demo-source")
        else:
            source = FIXTURES_DIR / name
        cache[name] = convert(source, root / name)
        return cache[name]

    return get
