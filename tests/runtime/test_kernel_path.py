"""Which kernels a fused_moe call takes (fused_moe.kernel_path), and the GLUON and PORTABLE keys of a kernel
config."""

from __future__ import annotations

import json

import pytest
import torch

from repack.formats.errors import RepackError
from repack.runtime.fused_moe import GLUON_ENV, PORTABLE_ENV, choose_kernels, kernel_path
from repack.runtime.kernel_config import CONFIG_DIR, GluonTile, KernelConfig, Kernels, heuristic_configs
from repack.runtime.kernels import backend, gluon_sm90
from tests.support.stacks import zero_stack

TENSOR_CORE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, WEIGHT_MAJOR=True)


def test_decode_configs_take_the_decode_kernels():
    config = dict(TENSOR_CORE, DIRECT=True, WEIGHT_MAJOR=False)
    assert kernel_path(torch.zeros(1, 256), zero_stack(), 2, config) is Kernels.DECODE


def test_gluon_is_asked_for_but_runs_only_on_an_sm90_gpu(monkeypatch):
    """A GLUON tile or the opt-in variable asks for the Gluon kernels; on the CPU the tl kernels run instead."""
    x = torch.zeros(8, 256)
    assert gluon_sm90.supports(zero_stack())
    assert not backend.gluon_sm90_runs(x.device)
    assert kernel_path(x, zero_stack(), 2, dict(TENSOR_CORE)) is Kernels.WEIGHT_MAJOR
    assert kernel_path(x, zero_stack(), 2, dict(TENSOR_CORE, GLUON=[16, 64, 1])) is Kernels.WEIGHT_MAJOR
    monkeypatch.setenv(GLUON_ENV, "1")
    assert kernel_path(x, zero_stack(), 2, dict(TENSOR_CORE)) is Kernels.WEIGHT_MAJOR


def test_gluon_runs_where_it_is_faster_or_asked_on_a_gpu_that_can_run_it_unless_portable(monkeypatch):
    """The choice itself, with the backend check answering yes (as on an H100/H200 with Gluon's Hopper API):
    fp16 always, bf16 past 48 rows per expert, act-order as plain stacks while its rows are gathered first
    (gluon_sm90.ACT_ORDER_GATHER), else only when asked (gluon_sm90.preferred)."""
    monkeypatch.setattr("repack.runtime.fused_moe.gluon_sm90_runs", lambda device: True)
    stack, device, fp16, bf16 = zero_stack(), torch.device("cpu"), torch.float16, torch.bfloat16
    plain = KernelConfig.from_dict(TENSOR_CORE)
    tiled = KernelConfig.from_dict(dict(TENSOR_CORE, GLUON=[16, 64, 1]))
    assert choose_kernels(stack, plain, device, fp16, 16) is Kernels.GLUON_SM90
    assert choose_kernels(stack, plain, device, bf16, 2 * 48) is Kernels.WEIGHT_MAJOR  # two experts, 48 rows each
    assert choose_kernels(stack, plain, device, bf16, 2 * 49) is Kernels.GLUON_SM90
    assert choose_kernels(stack, tiled, device, bf16, 16) is Kernels.GLUON_SM90  # a tile asks for it
    direct = KernelConfig.from_dict(dict(TENSOR_CORE, DIRECT=True, GLUON=[16, 64, 1]))
    assert choose_kernels(stack, direct, device, fp16, 16) is Kernels.WEIGHT_MAJOR  # one block per pair: no Gluon
    act_order = zero_stack(act_order=True)
    assert choose_kernels(act_order, plain, device, fp16, 4096) is Kernels.GLUON_SM90
    monkeypatch.setattr(gluon_sm90, "ACT_ORDER_GATHER", False)
    assert choose_kernels(act_order, plain, device, fp16, 4096) is Kernels.WEIGHT_MAJOR
    monkeypatch.setenv(GLUON_ENV, "1")
    assert choose_kernels(act_order, plain, device, fp16, 16) is Kernels.GLUON_SM90
    monkeypatch.setenv(PORTABLE_ENV, "1")
    assert choose_kernels(stack, tiled, device, fp16, 16) is Kernels.WEIGHT_MAJOR


def test_the_heuristic_and_shipped_tables_never_ask_for_gluon():
    assert all(config.gluon is None for config in heuristic_configs())
    tables = sorted(CONFIG_DIR.glob("*.json"))
    assert tables
    for path in tables:
        assert all(KernelConfig.from_dict(e).gluon is None for e in json.loads(path.read_text()).values()), path


def test_gluon_key_round_trips_and_bad_tiles_are_one_line_errors():
    entry = dict(TENSOR_CORE, GLUON=[32, 128, 4, 3])
    config = KernelConfig.from_dict(entry)
    assert config.gluon == GluonTile(32, 128, 4, 3) and config.kernels is Kernels.WEIGHT_MAJOR
    assert config.to_dict() == entry
    assert KernelConfig.from_dict(dict(TENSOR_CORE, GLUON=[16, 64])).gluon == GluonTile(16, 64, 1, 4)
    two_warpgroups = dict(TENSOR_CORE, GLUON=[128, 128, 8, 4, 8])
    assert KernelConfig.from_dict(two_warpgroups).gluon.w2_rows == 256
    assert KernelConfig.from_dict(two_warpgroups).to_dict() == two_warpgroups
    with pytest.raises(RepackError, match="8 warps need"):
        KernelConfig.from_dict(dict(TENSOR_CORE, GLUON=[64, 64, 8, 4, 8]))
    assert "GLUON" not in KernelConfig.from_dict(TENSOR_CORE).to_dict()
    with pytest.raises(RepackError, match="unsupported tile"):
        KernelConfig.from_dict(dict(TENSOR_CORE, GLUON=[24, 64, 1]))
    with pytest.raises(RepackError, match="GLUON must be"):
        KernelConfig.from_dict(dict(TENSOR_CORE, GLUON="16,64"))


def test_heuristic_tiles_are_shipped():
    for pairs in (8, 64, 512, 4096, 65536):
        assert gluon_sm90.heuristic(pairs, 64) in gluon_sm90.SHIPPED_TILES


def test_portable_keeps_a_config_on_the_tl_kernels_where_gluon_would_run_by_default(monkeypatch):
    """A tuned tl entry (PORTABLE) runs the tl kernels it was timed on; a GLUON tile or $GLUON_ENV still win."""
    monkeypatch.setattr("repack.runtime.fused_moe.gluon_sm90_runs", lambda device: True)
    stack, device = zero_stack(), torch.device("cpu")
    plain = KernelConfig.from_dict(TENSOR_CORE)
    portable = KernelConfig.from_dict(dict(TENSOR_CORE, PORTABLE=True))
    for dtype, pairs in ((torch.float16, 16), (torch.bfloat16, 4096)):
        assert choose_kernels(stack, plain, device, dtype, pairs) is Kernels.GLUON_SM90
        assert choose_kernels(stack, portable, device, dtype, pairs) is Kernels.WEIGHT_MAJOR
    assert kernel_path(torch.zeros(8, 256, dtype=torch.float16), stack, 2, portable) is Kernels.WEIGHT_MAJOR
    monkeypatch.setenv(GLUON_ENV, "1")
    assert choose_kernels(stack, portable, device, torch.float16, 16) is Kernels.GLUON_SM90


def test_portable_key_round_trips_and_contradicting_a_gluon_tile_is_a_one_line_error():
    entry = dict(TENSOR_CORE, PORTABLE=True)
    config = KernelConfig.from_dict(entry)
    assert config.portable is True and config.gluon is None
    assert config.to_dict() == entry
    assert json.loads(json.dumps(config.to_dict()))["PORTABLE"] is True
    assert "PORTABLE" not in KernelConfig.from_dict(TENSOR_CORE).to_dict()
    assert KernelConfig.from_dict(dict(TENSOR_CORE, PORTABLE=False)).to_dict() == TENSOR_CORE
    with pytest.raises(RepackError, match="PORTABLE .* contradicts a GLUON tile"):
        KernelConfig.from_dict(dict(TENSOR_CORE, PORTABLE=True, GLUON=[16, 64, 1]))
