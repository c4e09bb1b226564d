"""The tensor-core decode (runtime/kernels/decode_mma.py): where it runs, what runs in its place, its prepare launch,
and what ptxas makes of its kernels for sm_90.

Gluon does not run in Triton's interpreter: the kernels' numbers are checked on the GPU (benchmarks/anchor_run.py
checks every cell of every variant against float32; `project:decode_mma.PREFERRED=True` runs them). Here: the
plumbing, the prepare launch's gathered act-order rows (tl, interpreted), and the compiled code: no spills, nothing
through shared memory but the epilogue, and a K loop of about two instructions a weight, against the 3.8 of the
CUDA-core decode (benchmarks/KERNEL_NOTES.md items 36-37).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from repack.runtime.fused_moe import choose_family, fused_moe, heuristic_config
from repack.runtime.kernel_config import Family, KernelConfig
from repack.runtime.kernels import decode, decode_mma, gluon_sm90, split_k
from repack.runtime.kernels.family import Call
from tests.support.sm90 import before_dependency_wait, compile_child, ptxas_spills
from tests.support.stacks import gpu_random_stack, on_device, zero_stack

CPU = torch.device("cpu")
MMA = dict(FAMILY="decode_mma", BLOCK_M=8, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=1, num_stages=1, SPLIT_K=4)


@pytest.fixture
def sm90(monkeypatch):
    """The Gluon kernels' device check answering as an H100/H200 with Gluon's Hopper API would."""
    monkeypatch.setattr(gluon_sm90, "runs_on", lambda device: True)


def test_a_config_reads_back_as_written_and_is_always_one_program_per_pair():
    from benchmarks.make_configs import code_path

    config = KernelConfig.from_dict(MMA)
    assert config.family is Family.DECODE_MMA and config.direct and config.split_k == 4
    assert config.to_dict() == MMA  # DIRECT implied, as for the CUDA-core decode
    assert code_path(MMA) == "decode-mma"  # a code path of its own in the table maker's sweeps


def test_the_cuda_core_decode_runs_its_configs_where_it_cannot(sm90):
    stack, config = zero_stack(), KernelConfig.from_dict(MMA)
    assert choose_family(stack, config, CPU, torch.float16, 2)[0].family is Family.DECODE_MMA
    assert choose_family(stack, config, CPU, torch.bfloat16, 2)[0].family is Family.DECODE_MMA
    wide = KernelConfig.from_dict(dict(MMA, BLOCK_N=128))  # not a tile of these kernels
    planned = choose_family(stack, wide, CPU, torch.float16, 2)
    assert planned[0].family is Family.DECODE and planned[1].block_n == 128
    gptq = zero_stack(word_order="gptq")  # words these kernels do not read
    assert choose_family(gptq, config, CPU, torch.float16, 2)[0].family is Family.DECODE


ON_THE_GPU = "the CPU's case (its tensors live on the CPU); on a Hopper GPU the test_on_hopper_ cases run the kernels"


@pytest.mark.skipif(torch.cuda.is_available(), reason=ON_THE_GPU)
def test_off_a_hopper_gpu_the_cuda_core_decode_runs_it_and_computes_the_same():
    """On the CPU (Triton's interpreter) a decode_mma entry runs the CUDA-core decode: the same numbers as its own."""
    torch.manual_seed(0)
    stack = zero_stack()
    stack.w13_qweight.random_(-(2**31), 2**31 - 1)
    stack.w2_qweight.random_(-(2**31), 2**31 - 1)
    stack.w13_scales.fill_(1 / 64)
    stack.w2_scales.fill_(1 / 64)
    x = torch.randn(1, stack.hidden_size, dtype=torch.float16)
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.75, 0.25]])
    assert choose_family(stack, KernelConfig.from_dict(MMA), CPU, torch.float16, 2)[0].family is Family.DECODE
    expected = fused_moe(x, stack, ids, weights, config=dict(MMA, FAMILY="decode"))
    assert torch.equal(fused_moe(x, stack, ids, weights, config=MMA), expected)


def test_the_heuristic_takes_the_decode_calls_only_once_preferred(sm90, monkeypatch):
    stack = zero_stack(experts=64)
    call = Call(stack, CPU, torch.float16, 8)
    assert decode_mma.FAMILY.heuristic(call) is None  # off: no faster, measured (KERNEL_NOTES.md item 39)
    monkeypatch.setattr(decode_mma, "PREFERRED", True)
    config = decode_mma.FAMILY.heuristic(call)
    assert config == KernelConfig(Family.DECODE_MMA, 8, 32, 128, 1, 1, 1, direct=True, split_k=8)
    assert heuristic_config(call) == config  # the first family of fused_moe.FAMILIES to claim the call
    tuned = KernelConfig.from_dict(dict(MMA, FAMILY="decode", BLOCK_M=16))  # a table's decode entry
    assert choose_family(stack, tuned, CPU, torch.float16, 8)[0].family is Family.DECODE_MMA
    many = Call(stack, CPU, torch.float16, 512)  # aligned tensor-core work: not a decode call
    assert decode_mma.FAMILY.heuristic(many) is None and decode.FAMILY.heuristic(many) is None
    assert decode_mma.FAMILY.heuristic(Call(zero_stack(word_order="gptq"), CPU, torch.float16, 8)) is None


def test_the_prepare_launch_gathers_each_act_order_pair_row_and_zeroes_the_scratch(device):
    """What decode_mma reads for an act-order stack: one row a pair, x's columns through its expert's permutation,
    in the activation dtype; the scratch zeroed."""
    torch.manual_seed(1)
    stack = zero_stack(act_order=True)
    k = stack.hidden_size
    stack = replace(stack, w13_perm=torch.stack([torch.randperm(k) for _ in range(stack.num_experts)]).to(torch.int32))
    x = torch.randn(2, k, dtype=torch.float16)
    ids = torch.tensor([[1, 0], [0, 1]], dtype=torch.int32)
    weights = torch.ones(2, 2)
    on = {name: t.to(device) for name, t in dict(x=x, ids=ids, weights=weights).items()}
    stack = on_device(stack, device)
    scratch = split_k.DecodeScratch(2, 4, k, stack.intermediate_size, 128, 2, 2, 64, True, True, torch.device(device),
                                    torch.float16)  # fmt: skip
    scratch.buffer.fill_(7)
    rows = decode.prepare(on["x"], stack, on["ids"], on["weights"], scratch, "rows", 128, None).cpu()
    assert rows.dtype == torch.float16 and rows.shape == (4, k)
    for pair in range(4):
        token, expert = pair // 2, int(ids.flatten()[pair])
        assert torch.equal(rows[pair], x[token, stack.w13_perm[expert].long().cpu()])
    assert not scratch.buffer[: scratch.zeroed_len].any()
    plain = on_device(zero_stack(), device)
    assert decode.prepare(on["x"], plain, on["ids"], on["weights"], scratch, "none", 128, None) is None


_CHILD = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from repack.runtime.kernels import decode_mma as d

act, block_n, warps = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
asym, route = sys.argv[2] == "1", sys.argv[5] == "1"
ptr = "*bf16" if act == "bfloat16" else "*fp16"
types = dict(x_ptr=ptr, inter_ptr=ptr, out_ptr=ptr, qw_ptr="*i32", scales_ptr="*fp16", zeros_ptr="*u8",
             topk_ids_ptr="*i32", topk_weights_ptr="*fp32", sums_ptr="*fp32", arrivals_ptr="*i32", logits_ptr=ptr)
shared = dict(TOP_K=8, GROUP_LEN=128, SYM_ZERO=8, HAS_ZEROS=asym, BLOCK_N=block_n,
              ROUTE=route, RENORMALIZE=True, BLOCK_E=128,
              DEPENDENT=True)  # as launched on sm_90 (kernels/backend.py dependent_launch)
report = {}
for name, kernel, extra in (("w13", d._w13_kernel, dict(ROW_PER_PAIR=asym, SPLIT_K=True)),
                            ("w2", d._w2_kernel, dict(REDUCE=True))):
    consts = dict(shared, **extra)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n.endswith("_ptr") or n.startswith("stride")}
    k = triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    report[name] = dict(shared=k.metadata.shared, ptx=k.asm["ptx"])
print(json.dumps(report))
"""


def _compile(act: str, asym: bool, block_n: int, warps: int, route: bool) -> dict:
    return compile_child(_CHILD, act, "1" if asym else "0", str(block_n), str(warps), "1" if route else "0")


def _k_loop_instructions(ptx: str) -> int:
    """SASS instructions of the longest loop (the K loop) ptxas builds from ``ptx`` for sm_90a."""
    from tests.support.sm90 import _assemble

    _, sass = _assemble(ptx, sass=True)
    code = [(int(at, 16), op) for at, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [
        (int(target.group(1), 16), at)
        for at, op in code
        if (target := re.search(r"\bBRA\s+0x([0-9a-f]+)", op)) and int(target.group(1), 16) <= at
    ]
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    return sum(first <= at <= last for at, _ in code)


# (activation dtype, asymmetric zeros and act-order rows, channels, warps, routing in the GEMMs): the heuristic's
# tile in fp16, routed by the prepare launch or by the GEMMs themselves (decode_mma.ROUTE_IN_GEMMS), and every tile
# repack tune searches (tune.DECODE_MMA_CONFIGS) in the costlier bf16 with zeros (act-order: the prepare launch
# routes, as it gathers the rows).
CASES = [("float16", False, 32, 1, False), ("float16", False, 32, 1, True)] + [
    ("bfloat16", True, bn, w, False) for bn, w in ((16, 1), (32, 1), (64, 2))
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("act", "asym", "block_n", "warps", "route"),
    CASES,
    ids=[f"{c[0]}-{c[2]}x{c[3]}" + ("-routed" if c[4] else "") for c in CASES],
)
def test_the_kernels_compile_for_sm90_with_every_operand_in_registers(act, asym, block_n, warps, route):
    report = _compile(act, asym, block_n, warps, route)
    for name, kernel in report.items():
        where = f"{name} {act} {block_n} channels, {warps} warps"
        assert ptxas_spills(kernel["ptx"]) == 0, f"{where}: spills to local memory"
        # only the epilogue's move of the accumulator to whole rows a thread goes through shared memory
        assert kernel["shared"] <= 256 * warps * max(1, block_n // 16), f"{where}: {kernel['shared']} bytes shared"
        assert "mma.sync.aligned.m16n8k16" in kernel["ptx"], where
        weights_a_step = (2 if name == "w13" else 1) * block_n * 128 // (32 * warps)  # per thread
        per_weight = _k_loop_instructions(kernel["ptx"]) / weights_a_step
        # the heuristic's tile at about 1.8, every tile a full instruction under the CUDA-core decode's 3.8 (a 16-row
        # w2 carries a step's activation loads and scale over half the weights)
        assert per_weight <= (2.8 if asym else 2.0), f"{where}: {per_weight:.2f} instructions a weight"
        atomics = re.findall(r"\batom\.[\w.]+", kernel["ptx"])
        assert atomics, f"{where}: the split-K and top-k sums have no atomics"
        before = before_dependency_wait(kernel["ptx"])
        assert before["waits"] == 1 and before["writes"] == 0, (where, before)  # no write before the wait
        if route:  # the logits (and w13's x) past L1, weights and scales as they come: its whole K slice
            logits = 128 // (32 * warps)  # a thread's share of the row, one load each
            x = 16 if name == "w13" else 0  # the K loop's body: 8 chunks, two fp16x2 loads a thread each
            assert before["l2_loads"] == logits + x and before["loads"] > before["l2_loads"], (where, before)
        elif name == "w13":  # the prepare launch routes: nothing before the wait
            assert before == {"waits": 1, "loads": 0, "l2_loads": 0, "writes": 0}, where
        else:  # the first step's words, the pair's id and routing weight (past L1) while w13 runs
            assert before["l2_loads"] == 2 and before["loads"] > 2, (where, before)


def _hopper_with_gluon() -> bool:
    return torch.cuda.is_available() and gluon_sm90.runs_on(torch.device("cuda"))


@pytest.mark.skipif(not _hopper_with_gluon(), reason="Gluon kernels: a compute capability 9.0 GPU only")
@pytest.mark.parametrize("asym_act_order", [False, True], ids=["sym", "asym-actorder"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("route", [False, True], ids=["prepare-routes", "gemms-route"])
def test_on_hopper_the_tensor_core_decode_computes_what_the_cuda_core_one_does(monkeypatch, dtype, asym_act_order,
                                                                             route):  # fmt: skip
    """Every tile repack tune searches, 1 and 3 tokens (split K and whole K), from router logits as MoeBlock calls:
    within the fp16/bf16 tolerance of the CUDA-core decode (both against float32 sums: 1e-3 and 5e-3 relative)."""
    from repack.runtime.fused_moe import routed_moe
    from repack.runtime.tune import DECODE_MMA_CONFIGS

    monkeypatch.setattr(decode_mma, "ROUTE_IN_GEMMS", route)
    stack = gpu_random_stack(asym_act_order)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for m in (1, 3):
        x = torch.randn(m, 512, device="cuda", generator=gen).to(dtype)
        logits = torch.randn(m, 8, device="cuda", generator=gen)
        expected = routed_moe(x, stack, logits, 2, True, config=dict(MMA, FAMILY="decode")).float()
        for config in DECODE_MMA_CONFIGS:
            assert choose_family(stack, config, torch.device("cuda"), dtype, 2 * m)[0].family is Family.DECODE_MMA
            got = routed_moe(x, stack, logits, 2, True, config=config).float()
            error = ((got - expected).norm() / expected.norm()).item()
            assert error <= (1e-3 if dtype == torch.float16 else 5e-3), (m, config, error)
