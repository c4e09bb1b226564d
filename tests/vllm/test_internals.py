"""A vLLM that renamed what the plugin reads from its layer objects fails with the plugin's version-range line."""

from __future__ import annotations

import pytest
import torch

from repack.formats.errors import RepackError
from repack.runtime.integrations.vllm.internals import hand_shared_output, vllm_attribute


class RenamedSharedExperts:
    """A stand-in for a future ``SharedExperts`` whose output slot has another name."""

    outputs = [None, None]


def test_a_missing_attribute_is_the_version_line():
    with pytest.raises(RepackError) as error:
        hand_shared_output(RenamedSharedExperts(), torch.zeros(()))
    message = str(error.value)
    assert "\n" not in message
    assert "is not supported by moe-repack's vLLM plugin (RenamedSharedExperts has no '_output')" in message
    assert "tested: >=0.32,<0.33" in message


def test_a_present_attribute_is_read():
    assert vllm_attribute(RenamedSharedExperts(), "outputs") == [None, None]
