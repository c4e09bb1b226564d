"""What `repack tune` searches (runtime/tune.py): the Gluon sm_90 tiles where they run, and tl candidates that
run, and are written as, the tl kernels there."""

from __future__ import annotations

import pytest
import torch

from benchmarks.make_configs import code_path
from repack.formats.errors import RepackError
from repack.formats.stacks import GPTQ_ORDER
from repack.runtime.fused_moe import GLUON_ENV, PORTABLE_ENV, choose_kernels
from repack.runtime.kernel_config import KernelConfig, Kernels
from repack.runtime.kernels import gluon_sm90
from repack.runtime.tune import GLUON_CONFIGS, GLUON_TILES, WEIGHT_MAJOR_CONFIGS, candidate_configs, tune
from tests.support.stacks import zero_stack

LARGE_M = 4096  # with 2 experts and top-2: every token tile is a candidate


def _sm90(monkeypatch, runs: bool) -> None:
    """The backend check answering as a Hopper GPU with Gluon would (True) or any other device (False)."""
    monkeypatch.setattr("repack.runtime.tune.gluon_sm90_runs", lambda device: runs)
    monkeypatch.setattr("repack.runtime.fused_moe.gluon_sm90_runs", lambda device: runs)


def _aligned_tl(configs: list[KernelConfig]) -> list[KernelConfig]:
    return [c for c in configs if c.kernels is not Kernels.DECODE and not c.direct and c.gluon is None]


def test_gluon_tiles_are_searched_where_the_gluon_kernels_run(monkeypatch):
    _sm90(monkeypatch, True)
    configs = candidate_configs(LARGE_M, 2, zero_stack())
    assert {c.gluon for c in configs if c.gluon is not None} == set(GLUON_TILES)
    assert set(gluon_sm90.SHIPPED_TILES) <= set(GLUON_TILES)
    assert len(GLUON_TILES) <= 10  # each tile is a few seconds of compiles per M
    assert {c.reduce for c in configs if c.gluon is not None} == {"pairs"}
    assert {c.reduce for c in candidate_configs(1, 2, zero_stack()) if c.gluon is not None} == {"pairs", "atomic"}


def test_few_rows_per_expert_search_only_the_small_gluon_tiles(monkeypatch):
    _sm90(monkeypatch, True)
    tiles = {c.gluon for c in candidate_configs(1, 2, zero_stack()) if c.gluon is not None}
    assert tiles == {t for t in GLUON_TILES if t.block_m == 16} and tiles


def test_every_candidate_runs_what_its_table_entry_says_on_sm90(monkeypatch):
    """A tl candidate is PORTABLE (else an aligned entry would run the Gluon heuristic's tile there); a Gluon one
    runs its tile; decode and one-block-per-pair candidates never meet Gluon. Also once written and read back."""
    _sm90(monkeypatch, True)
    stack, device = zero_stack(), torch.device("cpu")
    for m in (1, LARGE_M):
        configs = candidate_configs(m, 2, stack)
        assert _aligned_tl(configs) and all(c.portable for c in _aligned_tl(configs))
        for config in configs:
            written = KernelConfig.from_dict(config.to_dict())
            assert written == config
            for dtype in (torch.float16, torch.bfloat16):
                kernels = choose_kernels(stack, written, device, dtype, m * 2)
                assert (kernels is Kernels.GLUON_SM90) == (config.gluon is not None), config


def test_gluon_configs_fall_back_to_a_searched_weight_major_tile():
    """Where Gluon cannot run, a Gluon entry's tl family runs: a weight-major tile of the same shape."""
    searched = [c.meta() for c in WEIGHT_MAJOR_CONFIGS]
    for config in GLUON_CONFIGS:
        assert config.kernels is Kernels.WEIGHT_MAJOR and config.meta() in searched
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
def test_no_gluon_tiles_and_no_portable_marks_where_gluon_is_not_searched(monkeypatch, stack):
    _sm90(monkeypatch, stack.w13_perm is not None or not stack.mma_order)
    for m in (1, LARGE_M):
        configs = candidate_configs(m, 2, stack)
        assert _aligned_tl(configs)
        assert not any(c.gluon is not None or c.portable for c in configs)


@pytest.mark.parametrize("variable", [GLUON_ENV, PORTABLE_ENV])
def test_tune_refuses_to_run_with_a_kernel_override_set(monkeypatch, tmp_path, variable):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(RepackError, match=f"\\${variable} is set"):
        tune([(2, 256, 128, 2)], torch.float16, tmp_path)


def test_gluon_entries_are_their_own_code_path_in_the_table_maker():
    """benchmarks/make_configs.py lets a later sweep's timings of a path replace earlier ones: Gluon timings must
    not replace the weight-major ones."""
    assert code_path(GLUON_CONFIGS[0].to_dict()) == "gluon"
    assert code_path(KernelConfig.from_dict(dict(GLUON_CONFIGS[0].to_dict(), GLUON=None)).to_dict()) == "weight-major"
