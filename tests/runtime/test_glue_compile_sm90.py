"""The glue kernels around the GEMMs (routing, alignment, top-k sum) compile for sm_90 on the CPU.

They run in Triton's interpreter in the other tests, which accepts code the GPU compiler may reject
(tl.histogram, atomics, the sort-free scatter). Runs in a subprocess: the test session sets TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys

import pytest

EXPERTS = (8, 60, 128, 256)


def _compile(kernel, constexprs: dict, types: dict[str, str]):
    import triton
    from triton.backends.compiler import GPUTarget

    signature = {
        n: "constexpr" if n in constexprs else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
        for n in kernel.arg_names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr")}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def _worker() -> None:
    import triton
    import triton.language as tl

    from repack.runtime.kernels import align, routing, topk_sum

    for experts in EXPERTS:
        block_e = triton.next_power_of_2(experts)
        tile_b = max(16, align.SCAN_TILE // block_e)
        sizes = dict(BLOCK_E=block_e, CHUNK=align.MAX_CHUNK)
        route = dict(TOP_K=8, RENORMALIZE=True, BLOCK_T=routing.token_block(experts))
        one_chunk = dict(BLOCK_M=16, FILL=1024, TILE_B=tile_b, **route, **sizes)
        kernels = {
            "one_chunk": (align._align_one_chunk_kernel, dict(one_chunk, ROUTE=False)),
            "one_chunk routed": (align._align_one_chunk_kernel, dict(one_chunk, ROUTE=True)),
            "count": (align._count_kernel, dict(FILL=1024, ROUTE=False, **route, **sizes)),
            "count routed": (align._count_kernel, dict(FILL=1024, ROUTE=True, **route, **sizes)),
            "scan": (align._scan_kernel, dict(BLOCK_M=128, BLOCK_E=block_e, TILE_C=align.SCAN_TILE // block_e)),
            "scatter": (align._scatter_kernel, dict(BLOCK_M=128, TILE_B=tile_b, **sizes)),
            "route": (routing._route_kernel, dict(route, BLOCK_T=16, BLOCK_E=block_e)),
        }
        for name, (kernel, constexprs) in kernels.items():
            types = {"logits_ptr": "*fp16", "weights_ptr": "*fp32"}
            compiled = _compile(kernel, constexprs, types)
            print(json.dumps({"kernel": name, "experts": experts, "shared": compiled.metadata.shared}), flush=True)
    for dtype in ("fp16", "bf16"):
        consts = dict(TOP_K=8, OUT_DTYPE=tl.float16 if dtype == "fp16" else tl.bfloat16, BLOCK_T=2, BLOCK_H=1024)
        compiled = _compile(topk_sum._topk_sum_kernel, consts, {"rows_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"})
        print(json.dumps({"kernel": f"topk_sum {dtype}", "shared": compiled.metadata.shared}), flush=True)


@pytest.mark.slow
def test_glue_kernels_compile_for_sm90():
    from tests.support.sm90 import SM90_SHARED_LIMIT, run_compile_worker

    results = run_compile_worker(__file__, timeout=600)
    assert len(results) == 7 * len(EXPERTS) + 2
    assert all(r["shared"] <= SM90_SHARED_LIMIT for r in results), results


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
