"""Every Gluon sm_90 tile `repack tune` searches (tune.GLUON_TILES: one program per tile, and the warp-specialized
persistent kernels of 16 to 128 tokens), and the 64- and 128-token ones with their MMAs as wide as each block's pairs
(gluon_sm90.RAGGED_TILES: shipped on the 128-token and the persistent tiles, here on all of them), against the float32
reference built from the source GPTQ linears.

On a Hopper GPU only: Gluon has no interpreter, so on the CPU the compile tests (test_gluon_compile_sm90.py,
test_gluon_ws_compile_sm90.py) hold these kernels to their instructions and this file is where their numbers are
checked, in the device runs (`pytest tests/runtime/test_gluon_tiles_on_hopper.py`). The routing gives the eight
experts 1 to 200 rows each, so blocks of 16 to 128 tokens end full, three-quarters, half and a quarter full or
emptier: every width a ragged tile chooses, and the last block of each expert padded.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from repack.formats.gptq import GptqScheme
from repack.runtime.fused_moe import fused_moe
from repack.runtime.kernel_config import GluonTile
from repack.runtime.kernels import gluon_sm90, gluon_ws_sm90
from repack.runtime.tune import GLUON_CONFIGS
from tests.runtime.test_fused_moe import reference, relative_error
from tests.support.stacks import make_stack, on_device

ROWS_PER_EXPERT = (1, 17, 33, 49, 65, 97, 128, 200)  # 590 pairs, one per token (top-1)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 5e-3}  # relative to float32, as the other fused_moe tests


def _hopper_with_gluon() -> bool:
    return torch.cuda.is_available() and gluon_sm90.runs_on(torch.device("cuda"))


pytestmark = pytest.mark.skipif(not _hopper_with_gluon(), reason="Gluon kernels: a compute capability 9.0 GPU only")


@pytest.fixture(scope="module")
def case():
    """(stack on the GPU, x, ids, routing weights, float32 reference): H = 512 and I = 256 give w13 and w2 two
    tiles of the widest rows (256) and two K steps (w2) to four (w13)."""
    scheme = GptqScheme(4, 128, True, "gptq")
    weights, sources = make_stack(8, 512, 256, scheme, word_order="mma128_tiles")
    gen = torch.Generator().manual_seed(43)
    experts = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(ROWS_PER_EXPERT)])
    ids = experts[torch.randperm(experts.numel(), generator=gen)][:, None]
    route_w = torch.rand(ids.shape, generator=gen) + 0.5
    x = torch.randn(ids.shape[0], 512, generator=gen).to(torch.float16)
    expected = reference(x, sources, scheme, ids, route_w)
    return on_device(weights, "cuda"), x, ids, route_w, expected


def _run(case, tile: GluonTile, dtype: torch.dtype, reduce: str) -> torch.Tensor:
    """The call's output on the CPU under ``tile``'s config and top-k sum ``reduce``."""
    weights, x, ids, route_w, _ = case
    config = replace(next(c for c in GLUON_CONFIGS if c.gluon == tile), reduce=reduce)
    out = torch.full((x.shape[0], x.shape[1]), float("nan"), dtype=dtype, device="cuda")  # unwritten rows show
    return fused_moe(x.to(dtype).cuda(), weights, ids.cuda(), route_w.cuda(), config=config, out=out).cpu()


def _error(case, tile: GluonTile, dtype: torch.dtype) -> float:
    """The call's error with the top-k sum as shipped (fp16: added into the output)."""
    return relative_error(_run(case, tile, dtype, gluon_sm90.heuristic_reduce(dtype)).float(), case[-1])


def _misses(case, tiles: list[GluonTile]) -> list[tuple[list[int], str, float]]:
    """(tile, dtype, error) of every tile and activation dtype past its tolerance."""
    errors = [(t, d, _error(case, t, d)) for t in tiles for d in TOLERANCE]
    return [(t.to_list(), str(d), e) for t, d, e in errors if not e <= TOLERANCE[d]]


def test_on_hopper_every_gluon_tile_computes_the_reference(case):
    assert not _misses(case, [c.gluon for c in GLUON_CONFIGS])


def test_on_hopper_ragged_tiles_compute_the_reference(monkeypatch, case):
    """Ragged on every 64- and 128-token tile, one program per tile too (RAGGED_ONE_PROGRAM_MIN_M = 64; shipped
    from 128), and w2 persistent at this short K and on the 128-token tile too (W2_PERSISTENT_MIN_K = 0,
    W2_PERSISTENT_MAX_M = 128; shipped: 1024 and 64): both GEMMs of every such tile at their four widths, as the
    anchor's variants run them."""
    monkeypatch.setattr(gluon_sm90, "RAGGED_TILES", True)
    monkeypatch.setattr(gluon_sm90, "RAGGED_ONE_PROGRAM_MIN_M", 64)
    monkeypatch.setattr(gluon_ws_sm90, "W2_PERSISTENT_MIN_K", 0)
    monkeypatch.setattr(gluon_ws_sm90, "W2_PERSISTENT_MAX_M", 128)
    tiles = [c.gluon for c in GLUON_CONFIGS if c.gluon.block_m >= 64]
    assert {t.per_sm > 0 for t in tiles} == {False, True}
    assert all(gluon_sm90.ragged(t, d) for t in tiles for d in TOLERANCE)
    assert not _misses(case, tiles)


@pytest.fixture(scope="module")
def top2_case():
    """As :func:`case` with two experts a token, so the top-k sum runs (top-1 skips it): 300 tokens, each drawing two
    experts in proportion to ROWS_PER_EXPERT (uneven blocks, every fill)."""
    scheme = GptqScheme(4, 128, True, "gptq")
    weights, sources = make_stack(8, 512, 256, scheme, word_order="mma128_tiles")
    gen = torch.Generator().manual_seed(44)
    ids = torch.multinomial(torch.tensor(ROWS_PER_EXPERT, dtype=torch.float).expand(300, -1), 2, generator=gen)
    route_w = torch.rand(ids.shape, generator=gen) + 0.5
    x = torch.randn(ids.shape[0], 512, generator=gen).to(torch.float16)
    expected = reference(x, sources, scheme, ids, route_w)
    return on_device(weights, "cuda"), x, ids.to(torch.int32), route_w, expected


def test_on_hopper_w2_sums_each_tokens_rows_where_the_last_arrives(monkeypatch, top2_case):
    """reduce "last" (gluon_sm90._sum_last_rows) on every tile of up to 64 tokens (SUM_LAST_MAX_M = 64, as the
    anchor's variant asks; shipped: 32), one program per tile and persistent, bf16 and fp16: the same bits as "pairs"
    (per-pair rows, then kernels/topk_sum.py: the same order of adds), and the reference."""
    monkeypatch.setattr(gluon_sm90, "SUM_LAST_MAX_M", 64)
    expected = top2_case[-1]
    for tile in [c.gluon for c in GLUON_CONFIGS if c.gluon.block_m <= 64]:
        for dtype in TOLERANCE:
            last = _run(top2_case, tile, dtype, "last")
            assert torch.equal(last, _run(top2_case, tile, dtype, "pairs")), (tile, dtype)
            assert relative_error(last.float(), expected) <= TOLERANCE[dtype], (tile, dtype)


@pytest.mark.parametrize("whole_waves", [False, True])
def test_on_hopper_persistent_w2_work_lists(monkeypatch, top2_case, whole_waves):
    """fp16 w2 adding into the output, persistent on every persistent tile (W2_PERSISTENT_MIN_K = 0,
    W2_PERSISTENT_MAX_M = 128), over a grid of 5 programs, so that its tiles fill two waves and more: stream-K
    ranges, and whole waves first (W2_WHOLE_WAVES, kernels/schedule.py) with split tiles after."""
    monkeypatch.setattr(gluon_ws_sm90, "W2_PERSISTENT_MIN_K", 0)
    monkeypatch.setattr(gluon_ws_sm90, "W2_PERSISTENT_MAX_M", 128)
    monkeypatch.setattr(gluon_ws_sm90, "W2_WHOLE_WAVES", whole_waves)
    monkeypatch.setattr(gluon_ws_sm90, "programs", lambda tiles, device, per_sm: max(1, min(tiles, 5)))
    expected = top2_case[-1]
    for tile in [c.gluon for c in GLUON_CONFIGS if c.gluon.per_sm]:
        got = _run(top2_case, tile, torch.float16, "out")
        assert relative_error(got.float(), expected) <= TOLERANCE[torch.float16], tile
