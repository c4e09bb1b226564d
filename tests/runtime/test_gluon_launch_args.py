"""The Gluon kernels' host side, on the CPU: every launch path (one program per tile; warp-specialized and
persistent, its w2 either way) under each top-k sum binds each of its kernel's arguments, none missing and none
unknown, with the constexprs and cleared buffers its sum needs. Gluon has no interpreter and device time is scarce: a
launch that cannot bind its arguments would cost a device call to find out."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
import triton

from repack.runtime.kernels import gluon_sm90, gluon_ws_sm90, schedule
from repack.runtime.kernels.align import Alignment
from repack.runtime.kernels.family import Work
from repack.runtime.tune import GLUON_CONFIGS
from tests.support.stacks import zero_stack

pytestmark = pytest.mark.skipif(not gluon_sm90.available(), reason="this Triton has no Gluon Hopper API")

M, TOP_K, H, INTER = 6, 2, 256, 1024  # I past gluon_ws_sm90.W2_PERSISTENT_MIN_K: w2 persistent too
LAUNCH_OPTIONS = {"num_warps", "maxnreg", "launch_pdl"}


class Recorder:
    """Stands in for a jit kernel: ``kernel[grid](*args, **kwargs)`` binds the arguments to the kernel's parameters
    (launch options aside) and records them."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            signature = inspect.signature(self.kernel.fn)
            options = {name: kwargs.pop(name) for name in list(kwargs) if name not in signature.parameters}
            assert set(options) <= LAUNCH_OPTIONS, f"{self.kernel.fn.__name__}: unknown arguments {set(options)}"
            bound = signature.bind(*args, **kwargs)  # TypeError where one is missing or one too many
            self.launches.append((self.kernel.fn.__name__, grid, bound.arguments))

        return launch


@pytest.fixture
def launches(monkeypatch) -> list:
    """The launches of one call, recorded instead of run (the persistent grid as 4 programs, its TMA views stubbed)."""
    recorded: list = []
    for module, name in [(gluon_sm90, "_w13_kernel"), (gluon_sm90, "_w2_kernel"), (gluon_ws_sm90, "_w13_ws_kernel"),
                         (gluon_ws_sm90, "_w2_ws_kernel")]:  # fmt: skip
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), recorded))
    monkeypatch.setattr(gluon_ws_sm90, "programs", lambda tiles, device, per_sm: max(1, min(tiles, 4)))
    monkeypatch.setattr(gluon_ws_sm90, "words_descriptor", lambda qweight, tiled: "descriptor")
    return recorded


def _call(tile, reduce: str, dtype: torch.dtype) -> Work:
    weights = zero_stack(4, H, INTER)  # mma128 rows: both kernel kinds read them
    blocks = triton.cdiv(M * TOP_K, tile.block_m) + 4
    rows = Alignment(torch.zeros(blocks * tile.block_m, dtype=torch.int32), torch.zeros(blocks, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32), tile.block_m)  # fmt: skip
    out = torch.empty(M, H, dtype=dtype)
    target = {"out": out, "atomic": torch.empty(M, H), "pairs": torch.empty(M * TOP_K, H, dtype=dtype)}
    ids = torch.zeros(M, TOP_K, dtype=torch.int32)
    return Work(torch.empty(M, H, dtype=dtype), weights, ids, torch.ones(M, TOP_K), out, rows,
                target.get(reduce, target["pairs"]))  # fmt: skip


SUMS = [("out", torch.float16), ("pairs", torch.bfloat16), ("last", torch.bfloat16), ("atomic", torch.bfloat16)]
CASES = [(config, reduce, dtype) for config in GLUON_CONFIGS for reduce, dtype in SUMS]


@pytest.mark.parametrize(("config", "reduce", "dtype"), CASES, ids=lambda v: str(getattr(v, "gluon", v)))
def test_every_gluon_launch_binds_its_kernels_arguments(launches, config, reduce, dtype):
    work = _call(config.gluon, reduce, dtype)
    gluon_sm90.FAMILY.run(work, replace(config, reduce=reduce))
    (w13, _, w13_args), (w2, _, w2_args) = launches
    persistent = bool(config.gluon.per_sm)
    assert w13 == ("_w13_ws_kernel" if persistent else "_w13_kernel")
    w2_persistent = w2 == "_w2_ws_kernel"
    assert w2_persistent <= persistent
    w2_rows = gluon_ws_sm90.w2_rows(config.gluon) if w2_persistent else config.gluon.w2_rows
    assert w2_args["BLOCK_N"] == w2_rows
    # What w13 clears: the [M, H] target w2 adds into, the tickets of "last", or nothing.
    cleared, numel = w13_args["zero_ptr"], w13_args["zero_numel"]
    assert w13_args["ZERO_OUT"] == (reduce != "pairs")
    if reduce == "last":
        assert cleared.dtype == torch.int32 and numel == cleared.numel() == M * triton.cdiv(H, w2_rows)
        assert w2_args["counts_ptr"] is cleared and w2_args["sum_ptr"] is work.out
    elif reduce != "pairs":
        assert cleared is work.target and numel == M * H
    assert w2_args.get("SUM_LAST", False) == (reduce == "last")
    assert w2_args["ATOMIC"] == (reduce in ("out", "atomic"))
    if w2_persistent:  # pieces of tiles only where the sum is added
        assert w2_args["SPLIT"] == int(schedule.STREAM_K if w2_args["ATOMIC"] else schedule.WHOLE_TILES)


def test_whole_waves_are_asked_of_the_persistent_w2_that_adds(launches, monkeypatch):
    monkeypatch.setattr(gluon_ws_sm90, "W2_WHOLE_WAVES", True)
    config = next(c for c in GLUON_CONFIGS if c.gluon.per_sm == 4)
    gluon_sm90.FAMILY.run(_call(config.gluon, "out", torch.float16), replace(config, reduce="out"))
    assert launches[-1][0] == "_w2_ws_kernel" and launches[-1][2]["SPLIT"] == int(schedule.WAVES_THEN_STREAM_K)
