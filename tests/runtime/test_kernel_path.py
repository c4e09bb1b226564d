"""Which family a fused_moe call takes (fused_moe.choose_family, kernel_path): a config's FAMILY, the fallbacks
where that family cannot run, the Gluon rules on a GPU that runs them, and the FAMILY / GLUON keys (with the
spelling before FAMILY still read as it ran)."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace

import pytest
import torch

from repack.formats.errors import RepackError
from repack.formats.stacks import GPTQ_ORDER, MMA128_ORDER
from repack.runtime.fused_moe import FAMILIES, choose_family, heuristic_configs, kernel_path
from repack.runtime.kernel_config import CONFIG_DIR, Family, GluonTile, KernelConfig
from repack.runtime.kernels import gluon_sm90
from repack.runtime.kernels.gluon_sm90 import GLUON_ENV, PORTABLE_ENV
from repack.runtime.weights import MoeWeights
from tests.support.stacks import zero_stack

TILE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
WEIGHT_MAJOR = dict(TILE, FAMILY="weight_major")
GLUON = dict(TILE, FAMILY="gluon_sm90")  # no tile of its own: the Gluon heuristic's where it measured faster
FP16, BF16, CPU = torch.float16, torch.bfloat16, torch.device("cpu")


def family(stack, entry, dtype=FP16, pairs=16) -> Family:
    """The family the call runs under ``entry`` (a dict in the table spelling)."""
    return choose_family(stack, KernelConfig.from_dict(entry), CPU, dtype, pairs)[0].family


@pytest.fixture
def sm90(monkeypatch):
    """The Gluon kernels' device check answering as an H100/H200 with Gluon's Hopper API would."""
    monkeypatch.setattr(gluon_sm90, "runs_on", lambda device: True)


def test_families_are_walked_in_one_order_and_each_describes_itself():
    walked = [Family.DECODE_MMA, Family.DECODE, Family.GLUON_SM90, Family.WEIGHT_MAJOR, Family.GPTQ_ORDER]
    assert [f.family for f in FAMILIES] == walked
    assert [f.family for f in FAMILIES if f.runs_tl_tiles] == [Family.WEIGHT_MAJOR, Family.GPTQ_ORDER]
    assert [f.family for f in FAMILIES if not f.interpreted] == [Family.DECODE_MMA, Family.GLUON_SM90]
    assert [f.topk_sum.value for f in FAMILIES] == ["in_w2", "in_w2", "by_reduce", "by_reduce", "by_reduce"]
    assert [f.clears_target for f in FAMILIES] == [False, False, True, False, False]


def test_decode_configs_take_the_decode_kernels_on_any_stack():
    for entry in (dict(TILE, FAMILY="decode"), dict(TILE, DIRECT=True)):  # the second in the spelling before FAMILY
        for stack in (zero_stack(), zero_stack(word_order=GPTQ_ORDER, act_order=True)):
            assert kernel_path(torch.zeros(1, 256), stack, 2, entry) is Family.DECODE


def test_a_family_that_cannot_run_the_stack_hands_its_tile_to_the_first_tl_family_that_can():
    mma, gptq = zero_stack(), zero_stack(word_order=GPTQ_ORDER)
    g64 = zero_stack(word_order=GPTQ_ORDER)
    g64.group_size = 64  # groups under 128: no weight-major kernels
    assert family(mma, dict(TILE, FAMILY="gptq_order")) is Family.WEIGHT_MAJOR  # only weight-major reads mma128
    assert family(gptq, dict(TILE, FAMILY="gptq_order")) is Family.GPTQ_ORDER
    assert family(gptq, WEIGHT_MAJOR) is Family.WEIGHT_MAJOR  # version-1 words of a g128 shape
    assert family(g64, WEIGHT_MAJOR) is Family.GPTQ_ORDER
    planned = choose_family(g64, KernelConfig.from_dict(dict(WEIGHT_MAJOR, DIRECT=True)), CPU, FP16, 4)[1]
    assert planned.family is Family.GPTQ_ORDER and not planned.direct  # gptq-order blocks are always aligned
    tiled = dict(GLUON, GLUON=[16, 64, 1])
    for stack, expected in ((mma, Family.WEIGHT_MAJOR), (gptq, Family.WEIGHT_MAJOR), (g64, Family.GPTQ_ORDER)):
        planned = choose_family(stack, KernelConfig.from_dict(tiled), CPU, FP16, 16)[1]  # not on this CPU
        assert planned.family is expected and planned.gluon is None and planned.block_m == 16


def test_gluon_runs_only_on_an_sm90_gpu(monkeypatch):
    """A GLUON tile or the opt-in variable asks for the Gluon kernels; on the CPU the weight-major ones run."""
    x = torch.zeros(8, 256)
    assert gluon_sm90.reads(zero_stack()) and not gluon_sm90.runs_on(x.device)
    for entry in (WEIGHT_MAJOR, GLUON, dict(GLUON, GLUON=[16, 64, 1])):
        assert kernel_path(x, zero_stack(), 2, entry) is Family.WEIGHT_MAJOR
    monkeypatch.setenv(GLUON_ENV, "1")
    assert kernel_path(x, zero_stack(), 2, WEIGHT_MAJOR) is Family.WEIGHT_MAJOR


def test_a_gluon_config_without_a_tile_runs_them_where_they_measured_faster(sm90, monkeypatch):
    """fp16 and bf16, act-order as plain stacks while its rows are gathered first (gluon_sm90.ACT_ORDER_GATHER):
    gluon_sm90.preferred; with the heuristic's tile and top-k sum (bf16 keeping the 32-token tile, which scales
    each K step's sum, up to 48 rows per expert)."""
    stack = zero_stack()
    assert family(stack, GLUON, FP16, 16) is Family.GLUON_SM90
    for pairs in (2, 2 * 48, 2 * 49):  # two experts
        assert family(stack, GLUON, BF16, pairs) is Family.GLUON_SM90
    bf16 = choose_family(stack, KernelConfig.from_dict(GLUON), CPU, BF16, 2 * 48)[1]
    assert bf16.gluon == GluonTile(32, 64, 4) and gluon_sm90.scale_after(bf16.gluon, BF16)
    mid = GluonTile(64, 128, 8, 4, 8, per_sm=1)  # persistent, on 8 warps (zero points too)
    assert choose_family(stack, KernelConfig.from_dict(GLUON), CPU, FP16, 2 * 48)[1].gluon == mid
    assert not gluon_sm90.scale_after(GluonTile(16, 64, 1), FP16) and not gluon_sm90.scale_after(bf16.gluon, FP16)
    planned = choose_family(stack, KernelConfig.from_dict(GLUON), CPU, FP16, 2 * 49)[1]
    assert planned.gluon == gluon_sm90.heuristic_tile(98, 2) == GluonTile(128, 128, 8, 4, 8, per_sm=1)
    assert planned.reduce == gluon_sm90.heuristic_reduce(FP16) == "out"
    act_order = zero_stack(act_order=True)
    assert family(act_order, GLUON, FP16, 4096) is Family.GLUON_SM90
    monkeypatch.setattr(gluon_sm90, "ACT_ORDER_GATHER", False)
    assert family(act_order, GLUON, FP16, 4096) is Family.WEIGHT_MAJOR
    assert family(zero_stack(word_order=GPTQ_ORDER), GLUON, FP16, 16) is Family.WEIGHT_MAJOR  # reads mma128 only


def test_a_tile_or_the_variable_asks_for_gluon_and_portable_vetoes_it(sm90, monkeypatch):
    stack, tiled = zero_stack(), dict(GLUON, GLUON=[16, 64, 1], REDUCE="atomic")
    planned = choose_family(stack, KernelConfig.from_dict(tiled), CPU, BF16, 16)[1]  # not preferred: asked for
    assert planned.family is Family.GLUON_SM90 and planned.gluon == GluonTile(16, 64, 1) and planned.reduce == "atomic"
    assert family(stack, WEIGHT_MAJOR, FP16, 16) is Family.WEIGHT_MAJOR  # a weight-major entry runs what it names
    direct = dict(WEIGHT_MAJOR, DIRECT=True)
    monkeypatch.setenv(GLUON_ENV, "1")
    for entry in (WEIGHT_MAJOR, dict(TILE, FAMILY="gptq_order"), GLUON):
        planned = choose_family(stack, KernelConfig.from_dict(entry), CPU, BF16, 16)[1]
        tile = gluon_sm90.fitted_tile(gluon_sm90.heuristic_tile(16, 2), stack, BF16)
        assert planned.family is Family.GLUON_SM90 and planned.gluon == tile
    assert family(zero_stack(act_order=True), GLUON, FP16, 16) is Family.GLUON_SM90
    monkeypatch.setattr(gluon_sm90, "ACT_ORDER_GATHER", False)
    assert family(zero_stack(act_order=True), GLUON, FP16, 16) is Family.GLUON_SM90  # asked for: no preference
    assert family(stack, direct) is Family.WEIGHT_MAJOR  # one block per pair: no Gluon kernels
    assert family(zero_stack(word_order=GPTQ_ORDER), dict(TILE, FAMILY="gptq_order")) is Family.GPTQ_ORDER
    monkeypatch.setenv(PORTABLE_ENV, "1")
    assert family(stack, tiled) is Family.WEIGHT_MAJOR


def test_the_spelling_before_family_reads_as_it_ran(sm90):
    """WEIGHT_MAJOR without PORTABLE (the shipped tables' tl entries): the Gluon kernels where they measured faster;
    with PORTABLE (what `repack tune` wrote for a weight-major winner): the weight-major kernels; a GLUON tile: its
    tile; NIBBLE_DOTS (retired) is read and dropped."""
    old = dict(TILE, WEIGHT_MAJOR=True)
    assert KernelConfig.from_dict(old) == KernelConfig.from_dict(GLUON)
    assert KernelConfig.from_dict(dict(old, PORTABLE=True)) == KernelConfig.from_dict(WEIGHT_MAJOR)
    assert KernelConfig.from_dict(dict(old, GLUON=[32, 64, 4])).gluon == GluonTile(32, 64, 4)
    assert KernelConfig.from_dict(dict(TILE, DIRECT=True, WEIGHT_MAJOR=True)).family is Family.WEIGHT_MAJOR
    assert KernelConfig.from_dict(dict(TILE, NIBBLE_DOTS=True)) == KernelConfig.from_dict(
        dict(TILE, FAMILY="gptq_order")
    )
    assert family(zero_stack(), old, BF16, 16) is Family.GLUON_SM90
    assert family(zero_stack(), old, FP16, 16) is Family.GLUON_SM90
    assert family(zero_stack(), dict(old, PORTABLE=True), FP16, 16) is Family.WEIGHT_MAJOR
    with pytest.raises(RepackError, match="PORTABLE .* contradicts a GLUON tile"):
        KernelConfig.from_dict(dict(old, PORTABLE=True, GLUON=[16, 64, 1]))
    with pytest.raises(RepackError, match="GLUON tile is the gluon_sm90 family's, not weight_major's"):
        KernelConfig.from_dict(dict(old, DIRECT=True, GLUON=[16, 64, 1]))  # one block per pair has no Gluon tile
    with pytest.raises(RepackError, match="drop WEIGHT_MAJOR, PORTABLE"):
        KernelConfig.from_dict(dict(WEIGHT_MAJOR, WEIGHT_MAJOR=True, PORTABLE=True))


def test_family_and_gluon_keys_round_trip_and_bad_ones_are_one_line_errors():
    entry = dict(GLUON, GLUON=[32, 128, 4, 3])
    config = KernelConfig.from_dict(entry)
    assert config.gluon == GluonTile(32, 128, 4, 3) and config.family is Family.GLUON_SM90
    assert config.to_dict() == entry and list(config.to_dict())[0] == "FAMILY"
    assert KernelConfig.from_dict(dict(GLUON, GLUON=[16, 64])).gluon == GluonTile(16, 64, 1, 4)
    two_warpgroups = dict(GLUON, GLUON=[128, 128, 8, 4, 8])
    assert KernelConfig.from_dict(two_warpgroups).gluon.w2_rows == 256
    assert KernelConfig.from_dict(two_warpgroups).to_dict() == two_warpgroups
    assert KernelConfig.from_dict(dict(WEIGHT_MAJOR, DIRECT=True)).to_dict() == dict(WEIGHT_MAJOR, DIRECT=True)
    assert KernelConfig.from_dict(dict(TILE, FAMILY="decode", DIRECT=True)).to_dict() == dict(TILE, FAMILY="decode")
    assert "GLUON" not in KernelConfig.from_dict(GLUON).to_dict()
    persistent = dict(GLUON, GLUON=[16, 64, 1, 4, 4, 0, 3])
    assert KernelConfig.from_dict(persistent).gluon == GluonTile(16, 64, 1, per_sm=3)
    assert KernelConfig.from_dict(persistent).to_dict() == persistent
    bad = [
        (dict(GLUON, GLUON=[64, 64, 8, 4, 8]), "8 warps need"),
        (dict(GLUON, GLUON=[24, 64, 1]), "unsupported tile"),
        (dict(GLUON, GLUON="16,64"), "GLUON must be"),
        (dict(WEIGHT_MAJOR, GLUON=[16, 64, 1]), "GLUON tile is the gluon_sm90 family's"),
        (dict(TILE, FAMILY="marlin"), "FAMILY must be one of decode, decode_mma, gluon_sm90, weight_major, gptq_order"),
        (dict(TILE, FAMILY="decode", DIRECT=False), "decode kernels run one program per pair"),
        (dict(TILE, FAMILY="decode_mma", DIRECT=False), "decode kernels run one program per pair"),
        (dict(GLUON, DIRECT=True), "DIRECT .* is a decode or weight_major mode, not gluon_sm90's"),
        (dict(GLUON, GLUON=[16, 64, 1, 4, 4, 0, 5]), "per_sm 5 on 4 warps; use per_sm 0 .* per_sm 1 on 8 warps"),
        (dict(GLUON, GLUON=[64, 128, 8, 4, 8, 0, 2]), "per_sm 2 on 8 warps; use per_sm 0"),
        (dict(GLUON, GLUON=[16, 128, 1, 4, 4, 0, 4]), "takes 16 channels a warp .* block_n 128 on 4 warps"),
        (dict(GLUON, GLUON=[64, 64, 8, 4, 8, 0, 1]), "8 warps need|takes 16 channels a warp"),
        (dict(GLUON, GLUON=[16, 64, 1, 4, 4, 128, 4]), "takes 16 channels a warp .* w2_block_n 128"),
    ]
    wide = dict(GLUON, GLUON=[128, 128, 8, 4, 8, 0, 1])
    assert KernelConfig.from_dict(wide).gluon.registers == 168  # one program: two consumer warpgroups, a producer's
    for entry, message in bad:
        with pytest.raises(RepackError, match=message) as info:
            KernelConfig.from_dict(entry)
        assert "\n" not in str(info.value)


def test_the_heuristic_asks_no_gluon_tile_and_the_tables_name_their_families():
    """The heuristic's tl configs carry no Gluon tile (the Gluon heuristic's own are SHIPPED_TILES); every shipped
    entry names its family in the FAMILY spelling. The tensor-core entries are Gluon entries: tile-less where they
    were timed before the Gluon kernels existed (they run the Gluon heuristic's tile), with the tile a gluon_sm90
    sweep measured fastest otherwise (Qwen2-57B's M=4 and 16, sweep_v8_ws); a tile only on Gluon entries."""
    assert all(config.gluon is None for config in heuristic_configs())
    tables = sorted(CONFIG_DIR.glob("*.json"))
    assert tables
    tiled = 0
    for path in tables:
        for entry in json.loads(path.read_text()).values():
            config = KernelConfig.from_dict(entry)
            assert "FAMILY" in entry, path
            assert config.family in (Family.DECODE, Family.GLUON_SM90), (path, entry)
            if config.gluon is not None:
                assert config.family is Family.GLUON_SM90, (path, entry)
                tiled += 1
    assert tiled >= 1


def test_heuristic_tiles_are_shipped():
    for pairs in (8, 64, 512, 4096, 65536):
        assert gluon_sm90.heuristic_tile(pairs, 64) in gluon_sm90.SHIPPED_TILES


@pytest.mark.parametrize(("warps", "per_sm"), [(4, 0), (8, 0), (8, 1)])
def test_the_heuristics_numbers_move_its_tiles_and_stay_shipped(monkeypatch, warps, per_sm):
    """The anchor's variants patch WIDE_FROM_ROWS, MID_WARPS and MID_PER_SM (together: one program per tile on 4
    warps, as before the persistent 8-warp tile shipped): each choice is a tile the compile tests build."""
    monkeypatch.setattr(gluon_sm90, "MID_WARPS", warps)
    monkeypatch.setattr(gluon_sm90, "MID_PER_SM", per_sm)
    mid = gluon_sm90.heuristic_tile(64 * 40, 64)  # 40 rows an expert
    assert mid == GluonTile(64, 16 * warps, 8, 4, warps, per_sm=per_sm) in gluon_sm90.SHIPPED_TILES
    assert gluon_sm90.heuristic_tile(64 * 100, 64) == replace(gluon_sm90.WIDE_TILE, per_sm=1)
    monkeypatch.setattr(gluon_sm90, "WIDE_FROM_ROWS", 512)
    assert gluon_sm90.heuristic_tile(64 * 100, 64) == gluon_sm90.mid_tile() in gluon_sm90.SHIPPED_TILES


@pytest.mark.parametrize(("warps", "per_sm"), [(4, 2), (8, 1)])
def test_the_persistent_switches_pick_tiles_the_compile_tests_build(monkeypatch, warps, per_sm):
    """SMALL_PER_SM, MID_PER_SM and WIDE_PER_SM (the anchor's variants) send the 32-, 64- and 128-token tiles to the
    warp-specialized kernels: tiles `repack tune` searches, so tests/runtime/test_gluon_ws_compile_sm90.py compiles
    each."""
    from repack.runtime.tune import GLUON_TILES

    monkeypatch.setattr(gluon_sm90, "MID_WARPS", warps)
    monkeypatch.setattr(gluon_sm90, "MID_PER_SM", per_sm)
    monkeypatch.setattr(gluon_sm90, "WIDE_PER_SM", 1)
    monkeypatch.setattr(gluon_sm90, "SMALL_PER_SM", 2)
    small = gluon_sm90.heuristic_tile(64 * 20, 64)
    assert (small.block_m, small.per_sm) == (32, 2) and small in GLUON_TILES
    mid, wide = gluon_sm90.heuristic_tile(64 * 40, 64), gluon_sm90.heuristic_tile(64 * 100, 64)
    assert (mid.block_m, mid.warps, mid.per_sm) == (64, warps, per_sm) and mid in GLUON_TILES
    assert (wide.block_m, wide.warps, wide.per_sm) == (128, 8, 1) and wide in GLUON_TILES
    assert gluon_sm90.heuristic_tile(64 * 8, 64) == gluon_sm90.PERSISTENT_16  # the 16-token tile as before


def test_two_programs_an_sm_only_for_eight_warp_rings_that_fit_twice(monkeypatch):
    """TWO_PROGRAMS_MAXNREG caps the registers (a launch option) where two rings fit an SM's shared memory."""
    constants = lambda tile, kernel="w13": gluon_sm90.launch_constants(tile, kernel, top_k=8, group_len=128,
                                                                     has_zeros=False)  # noqa: E731 # fmt: skip
    three_stages = GluonTile(64, 128, 8, 3, 8)
    assert gluon_sm90.ring_bytes(three_stages, "w13") == 3 * (256 * 64 + 128 * 128)  # words + activations a stage
    assert "maxnreg" not in constants(three_stages)  # off by default
    monkeypatch.setattr(gluon_sm90, "TWO_PROGRAMS_MAXNREG", 128)
    assert constants(three_stages)["maxnreg"] == constants(three_stages, "w2")["maxnreg"] == 128
    assert "maxnreg" not in constants(GluonTile(64, 128, 8, 4, 8))  # 128 KB of ring: one program an SM
    assert "maxnreg" not in constants(GluonTile(64, 64, 8, 3, 4))  # four warps fit three programs uncapped


@pytest.mark.parametrize("m", [1, 4, 8, 16, 48, 64, 200, 256, 1024, 4096])
def test_the_shipped_tables_on_an_h200_run_what_they_always_ran(monkeypatch, sm90, m):
    """Qwen1.5-MoE's table (E=60, I=1408, top-4) on an H200 with the Gluon kernels: decode entries run decode; the
    tensor-core entries run the Gluon heuristic's tile and sum, fp16 and bf16."""
    from repack.runtime import kernel_config
    from repack.runtime.kernel_config import load_configs

    fused_moe = importlib.import_module("repack.runtime.fused_moe")  # the module (the package exports its function)
    monkeypatch.setattr(fused_moe, "device_name", lambda device: "NVIDIA_H200")
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    stack = MoeWeights(meta(60, 2816, 256), meta(60, 16, 2816), meta(60, 2048, 176), meta(60, 11, 2048), bits=4,
                       group_size=128, word_order=MMA128_ORDER)  # fmt: skip
    table = load_configs(60, 1408, "NVIDIA_H200")
    entry = table[min(table, key=lambda k: abs(k - m))]
    for dtype in (FP16, BF16):
        x = torch.empty(m, 2048, dtype=dtype, device="meta")
        plan = fused_moe._plan(x, stack, 4, None, x)
        assert kernel_config.get_config(stack, m, 4, dtype, x.device) == entry  # the old name answers too
        if entry.family is Family.DECODE:
            assert plan.family.family is Family.DECODE and plan.config == entry and plan.block_m is None
        else:
            tile = gluon_sm90.fitted_tile(gluon_sm90.heuristic_tile(m * 4, 60, dtype), stack, dtype)
            assert plan.family.family is Family.GLUON_SM90 and plan.config.gluon == tile
            assert plan.config.reduce == gluon_sm90.heuristic_reduce(dtype) and plan.block_m == tile.block_m


def test_w2_sums_the_last_rows_only_on_the_gluon_tiles_it_was_built_for(sm90, monkeypatch):
    """REDUCE "last" (gluon_sm90._sum_last_rows): planned on Gluon tiles up to SUM_LAST_MAX_M tokens, "pairs" on
    wider ones, at top-1 (the rows are the output) and on the tl families; the heuristic asks it of bf16 where
    BF16_REDUCE says so."""
    fused_moe = importlib.import_module("repack.runtime.fused_moe")
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    stack = MoeWeights(meta(8, 512, 64), meta(8, 4, 512), meta(8, 512, 32), meta(8, 2, 512), bits=4, group_size=128,
                       word_order=MMA128_ORDER)  # fmt: skip

    def planned(m: int, top_k: int, entry: dict | None, dtype=BF16) -> tuple[Family, str, int]:
        x = torch.empty(m, 512, dtype=dtype, device="meta")
        plan = fused_moe._plan(x, stack, top_k, None if entry is None else KernelConfig.from_dict(entry), x)
        return plan.family.family, plan.config.reduce, plan.block_m

    last = dict(GLUON, GLUON=[32, 64, 4], REDUCE="last")
    assert planned(8, 2, last) == (Family.GLUON_SM90, "last", 32)
    strided = torch.empty(8, 1024, dtype=BF16, device="meta")[:, ::2]  # w2 sums into rows of unit stride only
    x = torch.empty(8, 512, dtype=BF16, device="meta")
    assert fused_moe._plan(x, stack, 2, KernelConfig.from_dict(last), strided).config.reduce == "pairs"
    assert planned(8, 1, last)[1] == "pairs"
    assert planned(8, 2, dict(last, GLUON=[64, 64, 8]))[1:] == ("pairs", 64)  # past SUM_LAST_MAX_M tokens
    assert planned(8, 2, dict(WEIGHT_MAJOR, REDUCE="last"))[:2] == (Family.WEIGHT_MAJOR, "pairs")
    assert planned(8, 2, None)[1] == "pairs"
    assert planned(4096, 2, None)[1:] == ("pairs", 128)
    monkeypatch.setattr(gluon_sm90, "BF16_REDUCE", "last")
    assert planned(8, 2, None)[1:] == ("last", 16)
    assert planned(4096, 2, None)[1:] == ("pairs", 128)
    assert planned(8, 2, None, FP16)[1] == "out"


def test_decode_leaves_few_pairs_to_gluon_where_gluon_streams_them_faster(sm90, monkeypatch):
    """decode.gluon_streams_better: a hidden size of 6144 or more (DeepSeek-V3's 7168) at every M, and few experts
    shared by more pairs than half of them (Mixtral at M = 4), 10**8 weights streamed (Mixtral at M = 1); elsewhere
    direct_mode decides as before, and without the Gluon kernels ($REPACK_PORTABLE_KERNELS, a CPU, another GPU)
    nothing changes."""
    from repack.runtime.fused_moe import heuristic_config
    from repack.runtime.kernels.family import Call

    meta = lambda *shape: torch.empty(shape, dtype=torch.int32, device="meta")  # noqa: E731

    def stack(experts: int, hidden: int, inter: int = 128) -> MoeWeights:
        return MoeWeights(meta(experts, 2 * inter, hidden // 8), meta(experts, hidden // 128, 2 * inter),
                          meta(experts, hidden, inter // 8), meta(experts, inter // 128, hidden),
                          bits=4, group_size=128, word_order=MMA128_ORDER)  # fmt: skip

    def picked(weights: MoeWeights, pairs: int) -> Family:
        return heuristic_config(Call(weights, torch.device("cuda"), FP16, pairs)).family

    dsv3, mixtral, qwen = stack(256, 7168), stack(8, 4096), stack(128, 2048)
    assert picked(dsv3, 8) is Family.GLUON_SM90 and picked(dsv3, 128) is Family.GLUON_SM90
    assert picked(mixtral, 4) is Family.DECODE and picked(mixtral, 8) is Family.GLUON_SM90
    assert picked(qwen, 8) is Family.DECODE and picked(qwen, 16) is Family.DECODE
    assert picked(qwen, 24) is Family.GLUON_SM90 and picked(qwen, 64) is Family.GLUON_SM90
    # Streamed weights: Mixtral's full experts at M = 1 (2 x 4096 x 14336) go Gluon, Qwen3-235B's (8 x 4096 x 1536)
    # and Qwen3-30B's (8 x 2048 x 768) stay here.
    mixtral_full, qwen3_235b = stack(8, 4096, 14336), stack(128, 4096, 1536)
    assert picked(mixtral_full, 2) is Family.GLUON_SM90 and picked(mixtral_full, 1) is Family.DECODE
    assert picked(qwen3_235b, 8) is Family.DECODE and picked(stack(128, 2048, 768), 8) is Family.DECODE
    monkeypatch.setenv(PORTABLE_ENV, "1")
    assert picked(dsv3, 8) is Family.DECODE and picked(mixtral, 8) is Family.DECODE


def test_few_rows_per_expert_take_the_persistent_kernels_where_they_fit(sm90, monkeypatch):
    """Up to 8 rows per expert the heuristic's tile is the warp-specialized one (gluon_sm90.PERSISTENT_16); it runs
    at 4 programs per SM on symmetric stacks (fp16 and bf16), at 3 with asymmetric zeros (at 64 registers they spill),
    and $REPACK_GLUON_WS=0 (or act-order rows not gathered) turns it off for gluon_sm90's one program per tile of the
    same shape."""
    from repack.runtime.kernels.gluon_sm90 import WS_ENV

    sym, asym = zero_stack(), zero_stack()
    asym = MoeWeights(**{**asym.__dict__, "w13_zeros": torch.zeros(2, 2, 256, dtype=torch.uint8),
                         "w2_zeros": torch.zeros(2, 1, 256, dtype=torch.uint8)})  # fmt: skip
    plain = GluonTile(16, 64, 1)
    assert gluon_sm90.heuristic_tile(16, 2) == gluon_sm90.PERSISTENT_16 == GluonTile(16, 64, 1, per_sm=4)
    assert gluon_sm90.heuristic_tile(32, 2) == GluonTile(32, 64, 4)  # more rows: one program per tile
    assert choose_family(sym, KernelConfig.from_dict(GLUON), CPU, FP16, 16)[1].gluon == gluon_sm90.PERSISTENT_16
    three = GluonTile(16, 64, 1, per_sm=3)  # 80 registers: zeros fit
    assert choose_family(sym, KernelConfig.from_dict(GLUON), CPU, BF16, 16)[1].gluon == gluon_sm90.PERSISTENT_16
    assert choose_family(asym, KernelConfig.from_dict(GLUON), CPU, FP16, 16)[1].gluon == three
    wide = dict(GLUON, GLUON=[16, 64, 1, 4, 4, 0, 3])
    assert choose_family(asym, KernelConfig.from_dict(wide), CPU, BF16, 16)[1].gluon == three
    two = dict(GLUON, GLUON=[16, 64, 1, 4, 4, 0, 2])  # a tuned per_sm below 4 stays as it is
    assert choose_family(asym, KernelConfig.from_dict(two), CPU, BF16, 16)[1].gluon.per_sm == 2
    act_order = zero_stack(act_order=True)
    assert choose_family(act_order, KernelConfig.from_dict(wide), CPU, FP16, 16)[1].gluon.per_sm == 3  # rows gathered
    monkeypatch.setattr(gluon_sm90, "ACT_ORDER_GATHER", False)
    assert choose_family(act_order, KernelConfig.from_dict(wide), CPU, FP16, 16)[1].gluon == plain
    monkeypatch.setenv(WS_ENV, "0")
    assert choose_family(sym, KernelConfig.from_dict(GLUON), CPU, FP16, 16)[1].gluon == plain
    assert choose_family(asym, KernelConfig.from_dict(wide), CPU, BF16, 16)[1].gluon == plain


def test_a_step_scaled_sum_runs_at_four_programs_per_sm_only_beside_a_lean_producer(sm90, monkeypatch):
    """gluon_sm90.persistent_fits, as tests/runtime/test_gluon_ws_compile_sm90.py compiles it: bf16's step-scaled sum,
    and fp16's when SCALE_AFTER_FP16_PERSISTENT asks it of the persistent tiles, spill at 64 registers beside a
    40-register producer and fit beside a 32-register one; asymmetric zeros stay at 3 programs either way, and the
    one-program-per-tile kernels keep fp16's scale in the dequantization."""
    from repack.runtime.kernels import gluon_ws_sm90

    sym = zero_stack()
    asym = MoeWeights(**{**sym.__dict__, "w13_zeros": torch.zeros(2, 2, 256, dtype=torch.uint8),
                         "w2_zeros": torch.zeros(2, 1, 256, dtype=torch.uint8)})  # fmt: skip
    four = gluon_sm90.PERSISTENT_16

    def per_sm(stack, dtype) -> int:
        return gluon_sm90.fitted_tile(four, stack, dtype).per_sm

    monkeypatch.setattr(gluon_ws_sm90, "PRODUCER_REGS", 40)
    assert (per_sm(sym, FP16), per_sm(sym, BF16), per_sm(asym, FP16)) == (4, 3, 3)
    monkeypatch.setattr(gluon_sm90, "SCALE_AFTER_FP16_PERSISTENT", True)
    assert gluon_sm90.scale_after(four, FP16) and not gluon_sm90.scale_after(GluonTile(16, 64, 1), FP16)
    assert per_sm(sym, FP16) == 3
    monkeypatch.setattr(gluon_ws_sm90, "PRODUCER_REGS", 32)
    assert (per_sm(sym, FP16), per_sm(sym, BF16), per_sm(asym, FP16), per_sm(asym, BF16)) == (4, 4, 3, 3)
    monkeypatch.setattr(gluon_sm90, "SCALE_AFTER_FP16_PERSISTENT", False)
    assert not gluon_sm90.scale_after(four, FP16) and per_sm(sym, FP16) == 4


def test_each_tma_box_of_tiled_words_is_the_tile_the_producer_names():
    """ "mma128_tiles" words through gluon_ws_sm90's 2-D view: the box of rows r..r+63 (r counted over all experts)
    and K step s is the 64 rows from (r / 64 * K / 128 + s) * 64 on, the producer's TILES coordinate, and holds the
    "mma128" rows' words of that row band and step."""
    from repack.formats.word_order import to_tiles

    experts, rows, k = 2, 192, 512
    words = torch.randint(-(2**31), 2**31 - 1, (experts, rows, k // 8), dtype=torch.int32)
    tiled, flat, steps = to_tiles(words).view(-1, 16), words.reshape(-1, k // 8), k // 128
    assert tiled.shape == (experts * rows * steps, 16)
    for r in range(0, experts * rows, 64):
        for s in range(steps):
            assert torch.equal(tiled[(r // 64 * steps + s) * 64 :][:64], flat[r : r + 64, s * 16 : (s + 1) * 16])


def test_words_the_tma_cannot_read_as_one_run_are_one_line():
    """A tensor-parallel cut of w2's tiles (its K steps) is a strided view: the warp-specialized kernels refuse it in
    one line rather than copy it on every call (the vLLM plugin's parameters are dense)."""
    from repack.runtime.kernels import gluon_ws_sm90

    tiles = torch.zeros(2, 4, 6, 64, 16, dtype=torch.int32)
    gluon_ws_sm90.words_descriptor(tiles[:, :, :3].contiguous(), True)
    with pytest.raises(RepackError, match=r"not one dense run") as error:
        gluon_ws_sm90.words_descriptor(tiles[:, :, :3], True)
    assert "\n" not in str(error.value)
