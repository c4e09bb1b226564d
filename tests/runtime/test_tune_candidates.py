"""What `repack tune` searches (runtime/tune.py): the Gluon sm_90 tiles where they run, and candidates whose table
entries run, once written and read back, the kernels that were timed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.make_configs import code_path
from repack.formats.errors import RepackError
from repack.formats.stacks import GPTQ_ORDER
from repack.runtime.fused_moe import choose_family
from repack.runtime.kernel_config import DECODE_FAMILIES, Family, KernelConfig
from repack.runtime.kernels import gluon_sm90
from repack.runtime.kernels.gluon_sm90 import GLUON_ENV, PORTABLE_ENV
from repack.runtime.tune import (
    GLUON_CONFIGS,
    GLUON_TILES,
    WEIGHT_MAJOR_CONFIGS,
    candidate_configs,
    tl_reference,
    tune,
)
from tests.support.stacks import zero_stack

LARGE_M = 4096  # with 2 experts and top-2: every token tile is a candidate


def _sm90(monkeypatch, runs: bool) -> None:
    """The Gluon kernels' device check answering as a Hopper GPU with Gluon would (True) or any other device."""
    monkeypatch.setattr(gluon_sm90, "runs_on", lambda device: runs)


def test_gluon_tiles_are_searched_where_the_gluon_kernels_run(monkeypatch):
    _sm90(monkeypatch, True)
    configs = candidate_configs(LARGE_M, 2, zero_stack())
    assert {c.gluon for c in configs if c.gluon is not None} == set(GLUON_TILES)
    assert set(gluon_sm90.SHIPPED_TILES) <= set(GLUON_TILES)
    assert len(GLUON_TILES) <= 16  # each a few seconds of compiles per M (15 with the persistent 32-128 token tiles)
    assert {c.reduce for c in configs if c.gluon is not None} == {"pairs"}
    assert {c.reduce for c in candidate_configs(1, 2, zero_stack()) if c.gluon is not None} == {"pairs", "atomic"}


def test_few_rows_per_expert_search_only_the_small_gluon_tiles(monkeypatch):
    _sm90(monkeypatch, True)
    tiles = {c.gluon for c in candidate_configs(1, 2, zero_stack()) if c.gluon is not None}
    assert tiles == {t for t in GLUON_TILES if t.block_m == 16} and tiles


@pytest.mark.parametrize("runs", [True, False], ids=["sm90", "elsewhere"])
def test_every_candidate_runs_the_family_its_table_entry_names(monkeypatch, runs):
    """No veto needed: a weight-major candidate stays on the weight-major kernels where the Gluon ones would run by
    default, a Gluon one runs its tile (where Gluon cannot: its weight-major tile), decode and one-block-per-pair
    candidates never meet Gluon. Checked on the entry as written and read back."""
    _sm90(monkeypatch, runs)
    stack, device = zero_stack(), torch.device("cpu")
    for m in (1, LARGE_M):
        configs = candidate_configs(m, 2, stack)
        decode = {Family.DECODE, *([Family.DECODE_MMA] if runs else [])}
        assert {c.family for c in configs} == (decode if m == 1 else set()) | {
            Family.WEIGHT_MAJOR,
            *([Family.GLUON_SM90] if runs else []),
        }
        for config in configs:
            written = KernelConfig.from_dict(config.to_dict())
            assert written == config
            for dtype in (torch.float16, torch.bfloat16):
                family, planned = choose_family(stack, written, device, dtype, m * 2)
                expected = Family.WEIGHT_MAJOR if config.family is Family.GLUON_SM90 and not runs else config.family
                assert family.family is expected, config
                ran = gluon_sm90.fitted_tile(config.gluon, stack, dtype) if expected is Family.GLUON_SM90 else None
                assert planned.gluon == ran  # a persistent tile runs one program per tile where it does not fit
                assert planned.reduce == config.reduce


def test_gluon_configs_fall_back_to_a_searched_weight_major_tile():
    """Where Gluon cannot run, a Gluon entry's tile runs on the weight-major kernels: one of the searched tiles."""
    searched = [c.meta() for c in WEIGHT_MAJOR_CONFIGS]
    for config in GLUON_CONFIGS:
        assert config.family is Family.GLUON_SM90 and config.meta() in searched
        assert (config.block_m, config.block_n, config.group_m) == (
            config.gluon.block_m,
            config.gluon.block_n,
            config.gluon.group_m,
        )


@pytest.mark.parametrize(
    "stack",
    [zero_stack(), zero_stack(act_order=True), zero_stack(word_order=GPTQ_ORDER)],
    ids=["not-sm90", "act-order", "gptq-order"],
)
def test_no_gluon_tiles_where_gluon_is_not_searched(monkeypatch, stack):
    _sm90(monkeypatch, stack.w13_perm is not None or not stack.mma_order)
    for m in (1, LARGE_M):
        configs = candidate_configs(m, 2, stack)
        assert any(c.family is not Family.DECODE and not c.direct for c in configs)
        assert not any(c.family is Family.GLUON_SM90 for c in configs)
        tl = {c.family for c in configs if c.family not in DECODE_FAMILIES}
        assert tl == ({Family.WEIGHT_MAJOR} if stack.mma_order else {Family.WEIGHT_MAJOR, Family.GPTQ_ORDER})


def test_candidates_are_checked_against_the_tl_heuristic(monkeypatch):
    """The reference every candidate must agree with: the CPU-tested tl kernels, never the Gluon ones."""
    _sm90(monkeypatch, True)
    assert tl_reference(zero_stack(64), 2, torch.float16).family is Family.DECODE
    # Two experts, two pairs: decode leaves such calls to the Gluon kernels (decode.gluon_streams_better), and the
    # reference is then the weight-major tl kernels, never the Gluon ones.
    assert tl_reference(zero_stack(), 2, torch.float16).family is Family.WEIGHT_MAJOR
    assert tl_reference(zero_stack(), LARGE_M * 2, torch.float16).family is Family.WEIGHT_MAJOR
    assert tl_reference(zero_stack(word_order=GPTQ_ORDER), LARGE_M * 2, torch.float16).family is Family.WEIGHT_MAJOR
    g64 = zero_stack(word_order=GPTQ_ORDER)
    g64.group_size = 64
    assert tl_reference(g64, LARGE_M * 2, torch.float16).family is Family.GPTQ_ORDER


@pytest.mark.parametrize("variable", [GLUON_ENV, PORTABLE_ENV])
def test_tune_refuses_to_run_with_a_kernel_override_set(monkeypatch, tmp_path, variable):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(RepackError, match=f"\\${variable} is set"):
        tune([(2, 256, 128, 2)], torch.float16, tmp_path)


def test_gluon_entries_are_their_own_code_path_in_the_table_maker():
    """benchmarks/make_configs.py lets a later sweep's timings of a path replace earlier ones: Gluon timings must
    not replace the weight-major ones, which the recorded sweeps' rows (tile-less Gluon entries now) are."""
    assert code_path(GLUON_CONFIGS[0].to_dict()) == "gluon"
    assert code_path(dict(GLUON_CONFIGS[0].to_dict(), GLUON=None)) == "weight-major"
    assert code_path(WEIGHT_MAJOR_CONFIGS[0].to_dict()) == "weight-major"
    old = {k: v for k, v in WEIGHT_MAJOR_CONFIGS[0].to_dict().items() if k != "FAMILY"}
    assert code_path(dict(old, WEIGHT_MAJOR=True)) == "weight-major"
    assert code_path(dict(old, WEIGHT_MAJOR=True, DIRECT=True)) == "weight-major direct"
    assert code_path(dict(old, DIRECT=True)) == "decode" and code_path(old) == "tensor-core"
