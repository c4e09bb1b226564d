"""Compile every Gluon sm_90 tile the runtime may run on the CPU and read what ptxas made of it.

Gluon does not run in Triton's interpreter, so this is the CI guard for runtime/kernels/gluon_sm90.py: each tile
the heuristic picks or `repack tune` may write (both kernels, fp16 and bf16, the plain and the asym act-order
variant) must compile for ``GPUTarget("cuda", 90, 32)`` with no local-memory spills and within Hopper's shared
memory, and its K loop must keep a wgmma in flight while it dequantizes: a ``wgmma.wait_group`` with N >= 1 inside
the loop (the reason these kernels exist: Triton's tl.dot waits with N = 0 after every register-operand MMA). Runs
in a subprocess because the test session sets TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from repack.runtime.kernels import gluon_sm90
from tests.support.sm90 import (
    SM90_SHARED_LIMIT,
    before_dependency_wait,
    check_last_rows_build,
    compile_child,
    local_memory_in_mma_loops,
    ptxas_spills,
)

VARIANTS = [("float16", False), ("bfloat16", True)]  # (activation dtype, asym with act-order)

_CHILD = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from repack.runtime.kernel_config import GluonTile
from repack.runtime.kernels import gluon_sm90 as g

cfg = GluonTile(*json.loads(sys.argv[1]))
act, asym = sys.argv[2], sys.argv[3] == "1"
g.RAGGED_TILES = sys.argv[4:5] == ["1"]  # benchmarks/ptx_dump.py passes three
g.RAGGED_ONE_PROGRAM_MIN_M = 64  # ragged: every 64- and 128-token tile, as the anchor's variants can ask
sum_last = sys.argv[5:6] == ["1"]  # w2 writes per-pair rows and sums each token's where its last one lands
ptr = "*bf16" if act == "bfloat16" else "*fp16"
types = dict(x_ptr=ptr, inter_ptr=ptr, out_ptr=ptr if sum_last else "*fp32", sum_ptr=ptr, qw_ptr="*i32",
             scales_ptr="*fp16", zeros_ptr="*u8" if asym else "*fp16", perm_ptr="*i32", sorted_pairs_ptr="*i32",
             block_experts_ptr="*i32", num_blocks_ptr="*i32", topk_weights_ptr="*fp32",
             zero_ptr="*i32" if sum_last else "*fp32", counts_ptr="*i32")  # w13 clears the tickets of "last"
report = {}
for name, kernel in (("w13", g._w13_kernel), ("w2", g._w2_kernel)):
    consts = g.launch_constants(cfg, name, top_k=8, group_len=128, has_zeros=asym, has_perm=asym,
                                atomic=not sum_last, zero_out=True, sum_last=sum_last, dtype=getattr(torch, act))
    num_warps = consts.pop("num_warps")
    consts["DEPENDENT"] = True  # as launched on sm_90 (kernels/backend.py dependent_launch)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")}
    k = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    report[name] = dict(shared=k.metadata.shared, ptx=k.asm["ptx"], scale_after=consts["SCALE_AFTER"])
print(json.dumps(report))
"""


def _compile(cfg, act: str, asym: bool, ragged: bool = False, sum_last: bool = False) -> dict:
    flags = ["1" if asym else "0", "1" if ragged else "0", "1" if sum_last else "0"]
    return compile_child(_CHILD, json.dumps(cfg.to_list()), act, *flags)


def loop_waits(ptx: str) -> list[int]:
    """The N of every ``wgmma.wait_group.sync.aligned N`` between a loop label and the branch back to it."""
    waits = []
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line.strip()))}
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:  # a backward branch: a loop
            body = lines[labels[m.group(1)] : i]
            waits += [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", "\n".join(body))]
    return waits


def test_loop_waits_finds_the_waits_inside_a_loop_only():
    ptx = "\n".join(
        [
            "wgmma.wait_group.sync.aligned 0;",
            "$L__BB0_1:                              // =>This Inner Loop Header: Depth=1",
            "wgmma.wait_group.sync.aligned 1;",
            "@%p1 bra $L__BB0_1;",
            "wgmma.wait_group.sync.aligned 0;",
        ]
    )
    assert loop_waits(ptx) == [1]


@pytest.mark.parametrize(("act", "asym"), VARIANTS, ids=[v[0] + ("-asym-actorder" if v[1] else "") for v in VARIANTS])
def test_shipped_and_tuned_gluon_configs_compile_for_sm90(act, asym):
    """Every tile the heuristic picks and every tile `repack tune` may write into a table (tune.GLUON_TILES)."""
    from repack.runtime.tune import GLUON_TILES

    for cfg in (t for t in GLUON_TILES if not t.per_sm):  # the warp-specialized ones: test_gluon_ws_compile_sm90
        report = _compile(cfg, act, asym)
        for name, kernel in report.items():
            where = f"{cfg} {name} {act}"
            assert kernel["shared"] <= SM90_SHARED_LIMIT, f"{where}: {kernel['shared']} bytes of shared memory"
            # the ring is all of it (the epilogue reuses it): what gluon_sm90.two_programs counts on
            assert kernel["shared"] == gluon_sm90.ring_bytes(cfg, name), f"{where}: shared memory beside the ring"
            assert ptxas_spills(kernel["ptx"]) == 0, f"{where}: spills to local memory"
            untouched = {"waits": 1, "loads": 0, "l2_loads": 0, "writes": 0}  # the kernel before ends first
            assert before_dependency_wait(kernel["ptx"]) == untouched, f"{where}: global memory before the wait"
            atomics = re.findall(r"\batom\.[\w.]+", kernel["ptx"])
            assert all(".relaxed." in a for a in atomics), f"{where}: ordered atomics fence every add ({atomics})"
            assert atomics or name == "w13", f"{where}: the atomic top-k sum has no atomics"
            # One MMA stays in flight while the next chunk is dequantized; a tile that scales each K step's sum
            # waits for that step's last MMA once (gluon_sm90.scale_after), never after every one.
            waits = loop_waits(kernel["ptx"])
            in_flight = [n for n in waits if n >= 1]
            assert len(in_flight) >= 7, f"{where}: the K loop waits for every wgmma ({waits})"
            assert waits.count(0) <= (1 if kernel["scale_after"] else 0), f"{where}: waits for all MMAs ({waits})"


@pytest.mark.parametrize(("act", "asym"), VARIANTS, ids=[v[0] + ("-asym-actorder" if v[1] else "") for v in VARIANTS])
def test_ragged_tiles_compile_for_sm90(act, asym):
    """gluon_sm90.RAGGED_TILES on: the 64- and 128-token tiles compile their four widths (the whole block's MMA, a
    half's, a quarter's, and a half's beside a quarter's, both kept in flight) with no spills and in the ring's
    shared memory (each width's epilogue reuses it)."""
    from repack.runtime.tune import GLUON_TILES

    tiles = [t for t in GLUON_TILES if not t.per_sm and t.block_m >= 64]
    assert tiles
    for cfg in tiles:
        for name, kernel in _compile(cfg, act, asym, ragged=True).items():
            where = f"{cfg} {name} {act} ragged"
            ptx = kernel["ptx"]
            assert kernel["shared"] == gluon_sm90.ring_bytes(cfg, name), f"{where}: shared memory beside the ring"
            spills = ptxas_spills(ptx)
            if asym:  # the in-loop column gather (act-order with ACT_ORDER_GATHER off): 20 bytes once a tile, bf16
                assert spills <= 32 and local_memory_in_mma_loops(ptx) == 0, f"{where}: {spills} bytes spilled"
            else:
                assert spills == 0, f"{where}: spills to local memory"
            widths = {int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)}
            assert widths == {cfg.block_m, cfg.block_m // 2, cfg.block_m // 4}, f"{where}: widths {sorted(widths)}"
            assert 2 in loop_waits(ptx), f"{where}: the two accumulators' MMAs are not kept in flight together"


@pytest.mark.parametrize("act", ["bfloat16", "float16"])
def test_w2_summing_last_rows_compiles_for_sm90(act):
    """reduce "last" (gluon_sm90._sum_last_rows) on every one-program tile `repack tune` may pick up to 64 tokens
    (SUM_LAST_MAX_M: 32 shipped, 64 in the anchor's variant; wider ones sum "pairs"): no spills, one acq_rel ticket
    at GPU scope per token of a tile (no other ordered atomic), and the rows read back past L1."""
    from repack.runtime.tune import GLUON_TILES

    assert gluon_sm90.SUM_LAST_MAX_M <= 64
    for cfg in (t for t in GLUON_TILES if not t.per_sm and t.block_m <= 64):
        ragged = gluon_sm90.ragged(cfg, getattr(torch, act))
        check_last_rows_build(_compile(cfg, act, False, ragged=ragged, sum_last=True), f"{cfg} {act} last")
