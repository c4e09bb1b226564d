"""fused_moe against an independent float32 reference built from the SOURCE GPTQ linears.

The reference dequantizes each (gate, up, down) with formats.gptq.dequantize (GPTQ layout, not ours) and
runs the expert MLPs in float32; the kernel reads the packed stack. Runs in the Triton interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

from repack.formats.errors import RepackError
from repack.formats.gptq import GptqScheme, dequantize
from repack.runtime.fused_moe import fused_moe
from repack.runtime.weights import MoeWeights
from tests.support.stacks import Expert, make_stack, on_device


def reference(x: torch.Tensor, sources: list[Expert], scheme, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 sum_k w * down(silu(gate x) * up x) with the source expert of each pair."""
    x = x.float()
    mats = [tuple(dequantize(lin, scheme) for lin in expert) for expert in sources]
    out = torch.zeros_like(x)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up, down = mats[int(ids[m, j])]
            out[m] += float(w[m, j]) * (down @ (torch.nn.functional.silu(gate @ x[m]) * (up @ x[m])))
    return out


def chunked_reference(x, source: Expert, scheme, gate_w: torch.Tensor) -> torch.Tensor:
    gate, up, down = (dequantize(lin, scheme) for lin in source)
    xf = x.float()
    return gate_w[:, None] * ((torch.nn.functional.silu(xf @ gate.T) * (xf @ up.T)) @ down.T)


def random_routing(m: int, top_k: int, allowed: list[int], gen: torch.Generator):
    """Distinct experts per token drawn from ``allowed`` (so the others get no tokens), random weights."""
    picks = torch.stack([torch.randperm(len(allowed), generator=gen)[:top_k] for _ in range(m)])
    ids = torch.tensor(allowed, dtype=torch.int32)[picks]
    weights = torch.rand(m, top_k, generator=gen) + 0.1
    return ids, weights


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten rows?)"
    return float((out.float() - ref).norm() / ref.norm())


def run_case(weights, sources, scheme, m, top_k, allowed, config, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, weights.hidden_size, generator=gen)).to(torch.float16)
    ids, route_w = random_routing(m, top_k, allowed, gen)
    out = torch.full((m, weights.hidden_size), float("nan"), dtype=torch.float16, device=device)
    dev_weights = on_device(weights, device)
    got = fused_moe(x.to(device), dev_weights, ids.to(device), route_w.to(device), config=config, out=out)
    assert got is out and got.dtype == torch.float16
    return relative_error(got.cpu(), reference(x, sources, scheme, ids, route_w))


BIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=2)


def test_aligned_sym_v1_g64_tokens_exceed_block_and_idle_experts(device):
    scheme = GptqScheme(bits=4, group_size=64, sym=True, checkpoint_format="gptq")
    weights, sources = make_stack(8, 128, 128, scheme)
    # 70 tokens x top-2 over 3 experts: > 64 rows per expert (two blocks each), experts 0,1,3,5,7 idle.
    err = run_case(weights, sources, scheme, 70, 2, [2, 4, 6], BIG, device, seed=1)
    assert err <= 2e-3


def test_aligned_asym_v2_act_order_g32_atomic_reduce(device):
    scheme = GptqScheme(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    weights, sources = make_stack(4, 128, 64, scheme, act_order=True)
    assert weights.w13_perm is not None and weights.w13_zeros is not None
    config = dict(BIG, BLOCK_M=16, BLOCK_K=64, REDUCE="atomic")  # BLOCK_K shrinks to the group (32)
    err = run_case(weights, sources, scheme, 20, 3, [0, 1, 3], config, device, seed=2)
    assert err <= 2e-3


def test_gptq_order_adds_the_top_k_into_the_output(device):
    """REDUCE="out": w2 adds each pair's fp16 row straight into the cleared output (no sum launch); a stale
    output is cleared first."""
    scheme = GptqScheme(bits=4, group_size=64, sym=True, checkpoint_format="gptq")
    weights, sources = make_stack(8, 128, 128, scheme)
    err = run_case(weights, sources, scheme, 40, 3, [2, 4, 6], dict(BIG, REDUCE="out"), device, seed=11)
    assert err <= 2e-3


def _six_tokens_top2(device, seed: int) -> tuple:
    """(an mma128 stack of 4 experts, H 256, I 128; ids, routing weights and fp16 x of 6 tokens at top-2) on
    ``device``: a call the top-k sum tests compare bit for bit."""
    weights, _ = make_stack(4, 256, 128, GptqScheme(4, 128, True, "gptq"), word_order="mma128")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (6, 2), generator=gen).to(torch.int32)
    route_w = torch.rand(6, 2, generator=gen)
    x = torch.randn(6, 256, generator=gen).to(torch.float16)
    return on_device(weights, device), ids.to(device), route_w.to(device), x.to(device)


def test_reduce_out_falls_back_to_fp32_atomics_where_it_cannot_run(device):
    """bf16 (eight roundings per element) and a strided ``out`` take the fp32 atomic sum instead, bit for bit (on
    the tl kernels, which keep a config's REDUCE; the Gluon path takes its heuristic's with its tile)."""
    weights, ids, route_w, x = _six_tokens_top2(device, seed=12)
    config, atomic = dict(WEIGHT_MAJOR, REDUCE="out"), dict(WEIGHT_MAJOR, REDUCE="atomic")
    strided = torch.full((6, 512), float("nan"), dtype=torch.float16, device=device)[:, ::2]
    got = fused_moe(x, weights, ids, route_w, config=config, out=strided)
    assert torch.equal(got, fused_moe(x, weights, ids, route_w, config=atomic))
    assert not torch.isnan(strided).any()
    xb = x.to(torch.bfloat16)
    assert torch.equal(
        fused_moe(xb, weights, ids, route_w, config=config), fused_moe(xb, weights, ids, route_w, config=atomic)
    )


def test_reduce_last_runs_as_pairs_where_w2_does_not_sum(device):
    """REDUCE="last" (each token's rows summed by the w2 program that writes its last one: the Gluon kernels' own,
    kernels/gluon_sm90.py _sum_last_rows) runs as "pairs" on the tl kernels: the same bits, every row summed."""
    weights, ids, route_w, x = _six_tokens_top2(device, seed=13)
    out = torch.full((6, 256), float("nan"), dtype=torch.float16, device=device)
    got = fused_moe(x, weights, ids, route_w, config=dict(WEIGHT_MAJOR, REDUCE="last"), out=out)
    assert torch.equal(got, fused_moe(x, weights, ids, route_w, config=dict(WEIGHT_MAJOR, REDUCE="pairs")))


def test_direct_top1_group_all_partial_k_block(device):
    # H = 192 with BLOCK_K = 128: the second K step is half masked; group -1 = one scale row over K.
    scheme = GptqScheme(bits=4, group_size=-1, sym=False, checkpoint_format="gptq")
    weights, sources = make_stack(4, 192, 64, scheme)
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, DIRECT=True)
    err = run_case(weights, sources, scheme, 3, 1, [0, 1, 2, 3], config, device, seed=3)
    assert err <= 2e-3


def test_eight_bit_direct(device):
    scheme = GptqScheme(bits=8, group_size=64, sym=True, checkpoint_format="gptq")
    weights, sources = make_stack(4, 128, 64, scheme)
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, DIRECT=True)
    err = run_case(weights, sources, scheme, 2, 2, [1, 3], config, device, seed=4)
    assert err <= 2e-3


@pytest.mark.parametrize("prefetch", [1, 2])
def test_direct_asym_v1_act_order_g32_atomic_reduce(device, prefetch):
    """The decode kernels: zero points, act-order gather and the atomic top-k sum, one row per pair."""
    scheme = GptqScheme(bits=4, group_size=32, sym=False, checkpoint_format="gptq")
    weights, sources = make_stack(6, 128, 64, scheme, act_order=True)
    assert weights.w13_perm is not None and weights.w13_zeros is not None
    config = dict(
        BLOCK_M=16,
        BLOCK_N=32,
        BLOCK_K=64,
        GROUP_M=1,
        num_warps=2,
        num_stages=1,
        DIRECT=True,
        REDUCE="atomic",
        PREFETCH=prefetch,
    )
    err = run_case(weights, sources, scheme, 3, 2, [0, 2, 3, 5], config, device, seed=6)
    assert err <= 2e-3


@pytest.mark.parametrize(
    ("scheme", "act_order"),
    [(GptqScheme(4, 128, True, "gptq"), True), (GptqScheme(4, -1, False, "gptq_v2"), False)],
    ids=["sym-g128-actorder", "asym-per-channel"],
)
def test_aligned_gptq_order_steps_of_128_read_an_old_nibble_dots_entry(device, scheme, act_order):
    """The gptq-order kernels with K steps of 128 (one group per step, or a whole-K group), from an entry that asks
    for the retired per-nibble dots: the key is read, and the int16 reshape path runs."""
    weights, sources = make_stack(4, 256, 128, scheme, act_order=act_order)
    config = dict(BIG, BLOCK_M=16, BLOCK_K=128, NIBBLE_DOTS=True)
    err = run_case(weights, sources, scheme, 24, 2, [0, 1, 3], config, device, seed=7)
    assert err <= 2e-3


WEIGHT_MAJOR = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, FAMILY="weight_major")


@pytest.mark.parametrize(
    ("scheme", "act_order", "config"),
    [
        (GptqScheme(4, 128, True, "gptq"), False, WEIGHT_MAJOR),
        (GptqScheme(4, 128, True, "gptq"), True, dict(WEIGHT_MAJOR, SCALE_ACC=False)),
        (GptqScheme(4, -1, False, "gptq_v2"), False, dict(WEIGHT_MAJOR, BLOCK_M=32, BLOCK_N=128, REDUCE="atomic")),
        (GptqScheme(4, 128, True, "gptq"), False, dict(WEIGHT_MAJOR, REDUCE="out")),
    ],
    ids=["sym-g128", "sym-g128-actorder-fp16-scales", "asym-per-channel-atomic", "sym-g128-out"],
)
def test_weight_major_aligned(device, scheme, act_order, config):
    """The weight-major kernels: weights as the MMA's register operand, activations in nibble-major order (or
    gathered through the act-order permutation), intermediate written in that order; tokens > BLOCK_M."""
    weights, sources = make_stack(4, 256, 256, scheme, act_order=act_order)
    assert run_case(weights, sources, scheme, 24, 2, [0, 1, 3], config, device, seed=7) <= 2e-3


@pytest.mark.parametrize(
    ("scheme", "act_order", "m", "top_k", "reduce"),
    [
        (GptqScheme(4, 128, False, "gptq"), True, 3, 2, "pairs"),
        (GptqScheme(4, 128, True, "gptq"), False, 2, 3, "atomic"),
        (GptqScheme(4, 128, True, "gptq"), False, 2, 3, "out"),
    ],
    ids=["asym-actorder", "sym-atomic", "sym-out"],
)
def test_weight_major_direct(device, scheme, act_order, m, top_k, reduce):
    """DIRECT on the weight-major kernels: one block per pair, expert from topk_ids, activations gathered."""
    weights, sources = make_stack(4, 256, 128, scheme, act_order=act_order)
    config = dict(WEIGHT_MAJOR, BLOCK_N=32, DIRECT=True, REDUCE=reduce)
    assert run_case(weights, sources, scheme, m, top_k, [0, 1, 3], config, device, seed=9) <= 2e-3


def test_weight_major_config_on_a_stack_it_cannot_run_uses_the_other_kernels(device):
    """Groups of 64 break the one-scale-row-per-128-step rule: the config still gives the right answer."""
    scheme = GptqScheme(4, 64, True, "gptq")
    weights, sources = make_stack(4, 256, 128, scheme)
    assert run_case(weights, sources, scheme, 5, 2, [0, 1, 3], dict(WEIGHT_MAJOR), device, seed=10) <= 2e-3


MMA128_CASES = [
    (GptqScheme(4, 128, True, "gptq"), False, 24, 2, WEIGHT_MAJOR),
    (GptqScheme(4, 128, False, "gptq"), True, 24, 2, dict(WEIGHT_MAJOR, SCALE_ACC=False, BLOCK_M=32, BLOCK_N=128)),
    (GptqScheme(4, 128, True, "gptq"), False, 24, 2, dict(WEIGHT_MAJOR, SCALE_ACC=False, QUANT_AHEAD=True)),
    (GptqScheme(4, -1, False, "gptq_v2"), False, 20, 3, dict(BIG, BLOCK_K=128, REDUCE="atomic")),
    (GptqScheme(4, 128, False, "gptq"), True, 3, 2, dict(WEIGHT_MAJOR, BLOCK_N=32, DIRECT=True)),
    (GptqScheme(4, 128, True, "gptq"), False, 2, 3, dict(WEIGHT_MAJOR, BLOCK_N=32, DIRECT=True, REDUCE="atomic")),
]


@pytest.mark.parametrize(
    ("scheme", "act_order", "m", "top_k", "config"),
    MMA128_CASES,
    ids=[
        "sym-g128",
        "asym-actorder-fp16-scales",
        "sym-scales-a-step-ahead",
        "asym-per-channel-any-config",
        "direct-actorder",
        "direct-atomic",
    ],
)
def test_mma128_word_order_on_the_weight_major_kernels(device, scheme, act_order, m, top_k, config):
    """mma128 words (what the converter writes for g128 stacks): the weight-major kernels read them for every
    tensor-core config (also one tuned for the older kernels), aligned and DIRECT."""
    weights, sources = make_stack(4, 256, 128, scheme, act_order=act_order, word_order="mma128")
    assert weights.word_order == "mma128"
    assert run_case(weights, sources, scheme, m, top_k, [0, 1, 3], config, device, seed=12) <= 2e-3


@pytest.mark.parametrize("prefetch", [1, 2])
def test_mma128_word_order_on_the_cuda_core_decode_kernels(device, prefetch):
    scheme = GptqScheme(4, 128, False, "gptq")
    weights, sources = make_stack(4, 256, 128, scheme, act_order=True, word_order="mma128")
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=1, num_stages=1, DIRECT=True,
                  PREFETCH=prefetch, REDUCE="atomic" if prefetch == 2 else "pairs")  # fmt: skip
    assert run_case(weights, sources, scheme, 3, 2, [0, 1, 3], config, device, seed=13) <= 2e-3


def test_nibble_major_order():
    """Position 128b + 16s + j holds column 128b + 8j + s: field s of word j, the order a nibble dot reads."""
    from repack.runtime.kernels.weight_major import nibble_major

    x = torch.arange(2 * 256).reshape(2, 256)
    out = nibble_major(x)
    b, s, j = 1, 3, 5
    assert out[1, 128 * b + 16 * s + j] == x[1, 128 * b + 8 * j + s]
    assert sorted(out[0].tolist()) == x[0].tolist()


def test_default_and_heuristic_configs(device):
    """No config: the device's choice (tuned table, heuristic, or the interpreter's on CPU); and the heuristic
    an untuned GPU takes at decode (the direct path), run explicitly."""
    from repack.runtime.fused_moe import heuristic_config
    from repack.runtime.kernel_config import Family
    from repack.runtime.kernels.family import Call

    scheme = GptqScheme(bits=4, group_size=128, sym=True, checkpoint_format="gptq")
    weights, sources = make_stack(8, 128, 128, scheme)
    assert run_case(weights, sources, scheme, 1, 2, list(range(8)), None, device, seed=5) <= 2e-3
    decode = heuristic_config(Call(weights, torch.device("cuda"), torch.float16, 2))
    assert decode.family is Family.DECODE
    assert run_case(weights, sources, scheme, 1, 2, list(range(8)), decode, device, seed=8) <= 2e-3


def test_shared_expert_as_chunks_with_sigmoid_gate(device):
    """A shared expert of size 2I packed as 2 chunks equals the whole expert when every token takes both."""
    scheme = GptqScheme(bits=4, group_size=64, sym=True, checkpoint_format="gptq")
    weights, sources = make_stack(2, 128, 64, scheme, chunks=2)
    gen = torch.Generator().manual_seed(6)
    m = 5
    x = torch.randn(m, 128, generator=gen).to(torch.float16)
    gate_w = torch.sigmoid(torch.randn(m, generator=gen))
    ids = torch.arange(2, dtype=torch.int32).expand(m, 2)
    out = torch.full((m, 128), float("nan"), dtype=torch.float16)
    dev = lambda t: t.to(device)  # noqa: E731
    dev_weights = on_device(weights, device)
    got = fused_moe(dev(x), dev_weights, dev(ids), dev(gate_w[:, None].expand(m, 2)), config=BIG, out=dev(out))
    assert relative_error(got.cpu(), chunked_reference(x, sources[0], scheme, gate_w)) <= 2e-3


def test_bad_inputs_raise_one_line_repack_errors():
    scheme = GptqScheme(bits=4, group_size=64, sym=True, checkpoint_format="gptq")
    weights, _ = make_stack(2, 128, 64, scheme)
    ids = torch.zeros(3, 1, dtype=torch.int32)
    w = torch.ones(3, 1)
    cases = [
        (torch.zeros(3, 128, dtype=torch.float32), ids, w, "float16 or bfloat16"),
        (torch.zeros(3, 96, dtype=torch.float16), ids, w, "hidden size 128"),
        (torch.zeros(3, 128, dtype=torch.float16), ids[:2], w[:2], "[3, top_k]"),
    ]
    for x, i, rw, text in cases:
        with pytest.raises(RepackError, match=text.replace("[", r"\[")) as info:
            fused_moe(x, weights, i, rw)
        assert "\n" not in str(info.value)


def test_config_too_big_for_device_shrinks_at_run_time():
    from triton.runtime.errors import OutOfResources

    from repack.runtime.kernel_config import fit_config

    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg["num_stages"] * cfg["BLOCK_K"] > 128:  # pretend the device holds at most 2 stages of K 64
            raise OutOfResources(cfg["num_stages"] * cfg["BLOCK_K"] * 512, 65536, "shared memory")

    big = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    fitted = fit_config(big, "cuda:7", launch, "w13-test")
    assert fitted["num_stages"] == 2 and fitted["BLOCK_K"] == 64 and len(tried) == 3
    assert fit_config(big, "cuda:7", launch, "w13-test") == fitted and len(tried) == 4  # remembered


@pytest.mark.parametrize("direct", [False, True], ids=["aligned", "direct"])
def test_an_out_of_range_expert_id_only_affects_its_own_token(device, direct):
    """One token with a bad expert id (e.g. from NaN logits) must leave every other token's output intact."""
    scheme = GptqScheme(bits=4, group_size=64, sym=True, checkpoint_format="gptq")
    weights, _ = make_stack(4, 128, 64, scheme)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 128, generator=gen).half().to(device)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    w = torch.rand(3, 2, generator=gen)
    config = dict(BIG, BLOCK_M=16, BLOCK_K=64, DIRECT=direct)
    dev = on_device(weights, device)
    good = fused_moe(x, dev, ids.to(device), w.to(device), config=dict(config))
    bad_ids = ids.clone()
    bad_ids[2] = torch.tensor([4, 7], dtype=torch.int32)
    bad = fused_moe(x, dev, bad_ids.to(device), w.to(device), config=dict(config))
    assert torch.equal(bad[:2], good[:2])


@pytest.mark.parametrize(
    ("word_order", "h", "i", "group", "split_k"),
    [("gptq", 320, 128, 32, 3), ("gptq", 320, 160, 32, 3), ("mma128", 384, 256, 128, 2)],
    ids=["gptq-uneven-slices", "gptq-last-tile-short", "mma128"],
)
def test_split_k_decode(device, word_order, h, i, group, split_k):
    """Split-K decode: K cut into slices of whole blocks (the last one shorter), w13's slices meet in the fp32
    workspace and the last to arrive applies SiLU; w2's add into the fp32 output. I = 160 leaves w13's last
    64-channel tile half past I: its last arrivers read the padded sums' lanes past I too (split_k.totals)."""
    scheme = GptqScheme(4, group, False, "gptq")
    weights, sources = make_stack(4, h, i, scheme, act_order=True, word_order=word_order)
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=2, num_stages=1, DIRECT=True,
                  SPLIT_K=split_k, PREFETCH=1)  # fmt: skip
    assert run_case(weights, sources, scheme, 2, 2, [0, 1, 3], config, device, seed=14) <= 2e-3


TILED_CONFIGS = {
    "weight-major": dict(WEIGHT_MAJOR, SCALE_ACC=False, BLOCK_M=16, BLOCK_N=128),
    "weight-major-direct": dict(WEIGHT_MAJOR, BLOCK_N=32, DIRECT=True, REDUCE="atomic"),
    "decode-split-k": dict(
        BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=1, DIRECT=True, SPLIT_K=2, PREFETCH=2
    ),
}


@pytest.mark.parametrize("name", TILED_CONFIGS)
def test_tiled_words_run_bit_for_bit_as_their_rows(device, name):
    """The tiles the converter writes give exactly the output of the same words as "mma128" rows on every tl family
    that reads them: H = 384 and I = 256 put w13's up rows four bands of 64 below their gate rows,
    and w2 and w13 take 2-3 K steps, each from another tile."""
    scheme = GptqScheme(4, 128, False, "gptq")
    rows, sources = make_stack(4, 384, 256, scheme, act_order=True, word_order="mma128")
    tiles, _ = make_stack(4, 384, 256, scheme, act_order=True, word_order="mma128_tiles")
    assert rows.w13_qweight.dim() == 3 and tiles.w13_qweight.shape == (4, 8, 3, 64, 16)
    assert (tiles.hidden_size, tiles.intermediate_size) == (384, 256)
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(3, 384, generator=gen).to(torch.float16)
    ids, route_w = random_routing(3, 2, [0, 1, 3], gen)
    outs = [
        fused_moe(x.to(device), on_device(stack, device),
                  ids.to(device), route_w.to(device), config=dict(TILED_CONFIGS[name])).cpu()
        for stack in (rows, tiles)
    ]  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    assert relative_error(outs[1], reference(x, sources, scheme, ids, route_w)) <= 2e-3


def test_a_tiled_stack_with_row_major_words_is_one_line(device):
    scheme = GptqScheme(4, 128, True, "gptq")
    rows, _ = make_stack(2, 256, 128, scheme, word_order="mma128")
    wrong = MoeWeights(**{**vars(rows), "word_order": "mma128_tiles"})
    x, ids, w = torch.zeros(1, 256, dtype=torch.float16), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(RepackError, match="'mma128_tiles' words are 5-D, got w13 \\[2, 256, 32\\]"):
        fused_moe(x, wrong, ids, w)


def test_k_slices_are_never_empty():
    from repack.runtime.kernels.split_k import k_slices

    for k_blocks in range(1, 40):
        for split in range(1, 9):
            per, slices = k_slices(k_blocks * 128, 128, split)
            assert slices <= split and (slices - 1) * per < k_blocks <= slices * per


DECODE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=1, DIRECT=True)


@pytest.mark.parametrize(
    ("m", "top_k", "config", "act_order"),
    [
        (3, 2, dict(WEIGHT_MAJOR, BLOCK_N=32, DIRECT=True), False),  # one program per pair: plain routing
        (40, 2, WEIGHT_MAJOR, False),  # aligned, one launch routes and aligns
        (700, 2, BIG, False),  # aligned over many chunks: routing inside the count step
        (3, 3, DECODE, False),  # decode: routing inside the preparation launch
        (3, 3, DECODE, True),  # decode of an act-order stack: every preparation program routes its pair's token
        (2, 2, None, False),  # the heuristic's pick
    ],
    ids=["direct", "aligned-one-program", "aligned-chunks", "decode", "decode-actorder", "heuristic"],
)
def test_routed_moe_is_route_then_fused_moe(device, m, top_k, config, act_order):
    """routed_moe (routing fused into the call's first launch) computes what route() + fused_moe() compute, bit
    for bit, and returns the same expert choices."""
    from repack.runtime.fused_moe import routed_moe
    from repack.runtime.kernels.routing import route

    scheme = GptqScheme(4, 128, True, "gptq")
    weights, _ = make_stack(6, 256, 128, scheme, word_order="mma128", act_order=act_order)
    weights = on_device(weights, device)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=gen).to(torch.float16).to(device)
    logits = torch.randn(m, 6, generator=gen).to(device)
    ours = routed_moe(x, weights, logits, top_k, True, config=config)
    route_w, ids = route(logits, top_k, True)
    assert torch.equal(ours, fused_moe(x, weights, ids, route_w, config=config))


def test_routed_moe_refuses_logits_of_other_tokens():
    from repack.runtime.fused_moe import routed_moe

    weights, _ = make_stack(4, 128, 128, GptqScheme(4, 128, True, "gptq"))
    with pytest.raises(RepackError, match=r"router_logits \[3, 4\] must be \[2, 4\]"):
        routed_moe(torch.zeros(2, 128, dtype=torch.float16), weights, torch.zeros(3, 4), 2, True)
    with pytest.raises(RepackError, match=r"router_logits \[2, 5\] must be \[2, 4\]"):
        routed_moe(torch.zeros(2, 128, dtype=torch.float16), weights, torch.zeros(2, 5), 2, True)
