"""The family table (formats/families.py): torch-free, the one place that names each family's modules."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from repack.formats.families import (
    BLOCK_ALIASES,
    FAMILIES,
    SHARED_EXPERT_MODULES,
    SHARED_GATE_MODULES,
    family_for,
    num_routed_experts,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "formats" / "families.py"


def test_the_table_imports_without_torch():
    """Like gguf-py's tables: any tool reads it without the project's heavy dependencies."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('families', {str(TABLE)!r})\n"
        "module = sys.modules['families'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(module.SUPPORTED)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "qwen2_moe, qwen3_moe, mixtral, deepseek_v2, deepseek_v3"


def test_names_under_both_namings():
    mixtral = family_for("mixtral")
    assert mixtral.block_modules == ("block_sparse_moe", "mlp") and mixtral.model_block == "mlp"
    assert mixtral.projection_sets == (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
    assert BLOCK_ALIASES == ((".block_sparse_moe.", ".mlp."),)
    assert SHARED_EXPERT_MODULES == ("shared_expert", "shared_experts")
    assert SHARED_GATE_MODULES == ("shared_expert_gate",)
    assert family_for("llama") is None
    assert num_routed_experts({"num_local_experts": 8}) == 8 == num_routed_experts({"n_routed_experts": 8})


def test_sparse_layers_follow_each_familys_config_keys():
    qwen = family_for("qwen2_moe")
    assert [qwen.is_sparse({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, i) for i in range(4)] == [
        False, True, False, False,
    ]  # fmt: skip
    v3 = family_for("deepseek_v3")
    assert [v3.is_sparse({"model_type": "deepseek_v3"}, i) for i in range(5)] == [False] * 3 + [True] * 2
    assert all(family.model_types for family in FAMILIES)


def test_no_other_module_spells_the_table_again():
    """The family knowledge lives here only: no second definition of its names elsewhere in the sources."""
    spelled = re.compile(r"^(SHARED_EXPERT_MODULES|SHARED_GATE_MODULES?|FAMILIES|MIXTRAL_W|GATE_UP_DOWN)\s*=", re.M)
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("repack", "runtime", "formats")
        for path in (ROOT / folder).rglob("*.py")
        if path != TABLE and spelled.search(path.read_text())
    ]
    assert offenders == []
