"""The plugin's vLLM names, per tested version (internals.VLLM_API), without installing vLLM.

CI can install one vLLM (the CPU build, 0.32): tests/vllm resolves 0.32's list against it, and the GPU script's
preflight resolves 0.26's against the carried GPU build. Here: (1) every ``from vllm... import`` in the plugin's
source and every internal attribute it reads through ``vllm_attribute`` is on each version's list, so the lists
are what the plugin uses; (2) the plugin imports against stand-in ``vllm`` modules holding exactly one version's
names (nothing more), and takes the path that version needs for its checkpoint renames (0.26 has no
``get_checkpoint_weight_mapper``: the renames go through ``get_cache_scale_mapper``, which its loader calls at
the same place).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import repack.runtime.integrations.vllm as plugin
from repack.runtime.integrations.vllm.internals import MOE_PARALLEL_FIELDS, VLLM_API
from tests.support.vllm_stand_ins import install_stand_ins

PLUGIN_DIR = Path(plugin.__file__).parent
REPO = Path(__file__).parents[2]
VERSIONS = sorted(VLLM_API)


def plugin_trees() -> list[ast.Module]:
    return [ast.parse(path.read_text()) for path in sorted(PLUGIN_DIR.glob("*.py"))]


def vllm_imports() -> set[str]:
    """``module:Name`` for each ``from vllm... import Name``, ``module`` for each ``import vllm...``."""
    found = set()
    for tree in plugin_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                found |= {f"{node.module}:{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"}
    return found


def attribute_reads() -> set[str]:
    """The names read from vLLM objects through ``vllm_attribute(owner, "name")``; the one read by a variable is
    internals.moe_parallel's loop over MOE_PARALLEL_FIELDS."""
    found, variables = set(), set()
    for tree in plugin_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "vllm_attribute":
                name = node.args[1]
                if isinstance(name, ast.Constant):
                    found.add(name.value)
                else:
                    variables.add(ast.unparse(name))
    assert variables == {"name"}, variables
    return found | set(MOE_PARALLEL_FIELDS)


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{v[0]}.{v[1]}")
def test_every_vllm_import_of_the_plugin_is_on_the_list(version):
    assert vllm_imports(), "no vLLM import found: the scan is broken"
    assert vllm_imports() - set(VLLM_API[version]) == set()


@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{v[0]}.{v[1]}")
def test_every_internal_attribute_the_plugin_reads_is_on_the_list(version):
    reads = attribute_reads()
    assert {"moe_config", "routed_scaling_factor", "e_score_correction_bias", "_layer", "_output"} <= reads
    listed = {entry.rpartition(".")[2] for entry in VLLM_API[version] if "." in entry.partition(":")[2]}
    assert reads - listed == set()


@pytest.mark.parametrize(
    ("version", "takes_hook", "cache_mapper_renames"), [((0, 26), False, True), ((0, 32), True, False)], ids=str
)
def test_the_plugin_imports_against_one_versions_names_and_takes_its_rename_path(
    version, takes_hook, cache_mapper_renames
):
    code = f"import tests.runtime.test_vllm_api as t; t.run_against_stand_ins({version!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"missing": [], "takes_hook": takes_hook, "cache_mapper_renames": cache_mapper_renames}


# ------------------------------------------------------------------------------ stand-ins (in a child process)


def run_against_stand_ins(version: tuple[int, int]) -> None:
    install_stand_ins(version)
    from repack.runtime.integrations.vllm import internals
    from repack.runtime.integrations.vllm.config import RepackVllmConfig

    config = RepackVllmConfig.__new__(RepackVllmConfig)  # the mapper reads only these two fields
    config.model_type, config.gptq_methods = None, []
    patterns = [getattr(key, "pattern", key) for key in config.get_cache_scale_mapper().orig_to_new_regex]
    result = {
        "missing": internals.missing_vllm_api(version),
        "takes_hook": internals.vllm_takes_checkpoint_weight_mapper(),
        "cache_mapper_renames": any("experts" in pattern for pattern in patterns),
    }
    print(json.dumps(result))
