"""Compile every shipped and heuristic kernel config for sm_90 (H100/H200) on the CPU.

The interpreter accepts code the GPU compiler may reject, and a config that needs more shared memory
than Hopper's opt-in maximum (232448 bytes) would raise OutOfResources at the first launch. Triton's
nvidia backend (with the ptxas its wheel ships) compiles for ``GPUTarget("cuda", 90, 32)`` without a
GPU. It runs in a subprocess because the test session sets TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from repack.runtime.kernel_config import Family, KernelConfig

SM90_SHARED_LIMIT = 232448  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200


def tl_config(config: KernelConfig) -> KernelConfig:
    """The tl config an entry runs where the Gluon kernels do not: a gluon_sm90 entry's tile on the weight-major
    kernels (the Gluon tiles themselves are test_gluon_compile_sm90.py's)."""
    if config.family is Family.GLUON_SM90:
        return replace(config, family=Family.WEIGHT_MAJOR, gluon=None)
    return config


def all_configs() -> list[KernelConfig]:
    """Every tl config shipped in runtime/configs/*.json plus every one the heuristics return."""
    from repack.runtime.fused_moe import heuristic_configs
    from repack.runtime.kernel_config import CONFIG_DIR

    configs = dict.fromkeys(heuristic_configs())
    for path in sorted(CONFIG_DIR.glob("*.json")):
        for entry in json.loads(path.read_text()).values():
            configs[tl_config(KernelConfig.from_dict(entry))] = None
    return list(configs)


def _signature(kernel, pointer_types: dict[str, str], constexprs: dict) -> dict[str, str]:
    return {name: "constexpr" if name in constexprs else pointer_types.get(name, "i32") for name in kernel.arg_names}


def _compile(kernel, pointer_types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget

    signature = _signature(kernel, pointer_types, constexprs)
    # Pointers and strides are 16-byte aligned at run time; say so, as the JIT's specialisation does.
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(kernel.arg_names)
        if n.endswith("_ptr") or n.startswith("stride")
    }
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def compile_config(cfg: KernelConfig, act: str, variant: str, mma_order: bool = True) -> dict[str, int]:
    """Compile the w13 and w2 kernels a config selects (decode or tensor-core); shared memory bytes each."""
    import triton.language as tl

    from repack.runtime.kernels.decode import _prepare_kernel, _w2_decode_kernel, _w13_decode_kernel
    from repack.runtime.kernels.gptq_order import _w2_kernel, _w13_kernel
    from repack.runtime.kernels.weight_major import _w2_weight_major_kernel, _w13_weight_major_kernel

    asym = variant == "asym_actorder"
    ptr = "*bf16" if act == "bfloat16" else "*fp16"
    word = "*i32" if cfg.family is not Family.GPTQ_ORDER else "*i16"
    types = dict(
        x_ptr=ptr,
        inter_ptr=ptr,
        out_ptr=ptr,
        qw_ptr=word,
        scales_ptr="*fp16",
        zeros_ptr="*u8" if asym else "*fp16",
        perm_ptr="*i32",
        sorted_pairs_ptr="*i32",
        block_experts_ptr="*i32",
        num_blocks_ptr="*i32",
        topk_ids_ptr="*i32",
        topk_weights_ptr="*fp32",
        sums_ptr="*fp32",
        arrivals_ptr="*i32",
    )
    atomic = cfg.reduce == "atomic"
    types2 = dict(types, out_ptr="*fp32" if atomic else ptr)
    common = dict(TOP_K=8, BITS=4, SYM_ZERO=8, HAS_ZEROS=asym, ACT_DTYPE=getattr(tl, act), EVEN_K=True)
    tiles = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    launch = (cfg.num_warps, cfg.num_stages)
    if cfg.family is Family.WEIGHT_MAJOR:
        direct = cfg.direct
        wm = {k: v for k, v in common.items() if k not in ("BITS", "EVEN_K")}
        wm.update(SCALE_ACC=cfg.scale_acc, DIRECT=direct, QUANT_AHEAD=cfg.quant_ahead, MMA_ORDER=mma_order)
        wm.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, GROUP_LEN=128, INLINE_PTX=True)
        flags13 = {**wm, "HAS_PERM": asym, "NIBBLE_MAJOR_X": not (asym or direct or mma_order)}
        w13 = _compile(_w13_weight_major_kernel, types, flags13, *launch)
        w2 = _compile(_w2_weight_major_kernel, types2, {**wm, "ATOMIC": atomic}, *launch)
        if act == "bfloat16" and not wm["SCALE_ACC"]:
            # weight_major.BF16_SCALES_IN_WEIGHTS = False: exact fp32 scales, on a tile half as wide.
            exact = dict(SCALE_ACC=True, BLOCK_N=max(32, cfg.block_n // 2))
            _compile(_w13_weight_major_kernel, types, {**flags13, **exact}, *launch)
            _compile(_w2_weight_major_kernel, types2, {**wm, **exact, "ATOMIC": atomic}, *launch)
    elif cfg.family is Family.DECODE:
        # The decode kernels read fp32 prepared activations and write w2's the same way (runtime/kernels/decode.py).
        prepared = dict(types, xp_ptr="*fp32", inter_ptr="*fp32", scratch_ptr="*i32")
        # as launched on sm_90: dependent launches (kernels/backend.py dependent_launch)
        decode = dict(common, PREFETCH=cfg.prefetch, MMA_ORDER=mma_order, DEPENDENT=True, **tiles)
        split = cfg.split_k > 1
        w13 = _compile(_w13_decode_kernel, prepared, {**decode, "HAS_PERM": asym, "SPLIT_K": split}, *launch)
        w2 = _compile(_w2_decode_kernel, prepared, {**decode, "REDUCE": True}, *launch)
        prepare = dict(TOP_K=8, BITS=4, HAS_PERM=asym, MMA_ORDER=mma_order, BLOCK_K=cfg.block_k, ZERO_BLOCK=256,
                       DEPENDENT=True)  # fmt: skip
        routing = dict(ROUTE=True, RENORMALIZE=True, BLOCK_E=128)  # routes in it, act-order stacks too
        field_major = dict(prepare, **routing, PREPARED="field_major")
        first = _compile(_prepare_kernel, dict(prepared, logits_ptr=ptr), field_major, 1, 1)
        check_dependent_launches(first.asm["ptx"], w13.asm["ptx"], w2.asm["ptx"])
        # the tensor-core decode's (kernels/decode_mma.py): act-order rows in the activation dtype, or none
        tensor_core = dict(prepare, **routing, PREPARED="rows" if asym else "none", BLOCK_K=128)
        rows = _compile(_prepare_kernel, dict(prepared, logits_ptr=ptr, xp_ptr=ptr), tensor_core, 1, 1)
        assert before_dependency_wait_untouched(rows.asm["ptx"])
    else:
        mma = dict(common, EXPONENT_TRICK=True, BLOCK_M=cfg.block_m, GROUP_M=cfg.group_m, **tiles)
        w13 = _compile(_w13_kernel, types, {**mma, "HAS_PERM": asym}, *launch)
        w2 = _compile(_w2_kernel, types2, {**mma, "ATOMIC": atomic}, *launch)
    shared = {"w13": w13.metadata.shared, "w2": w2.metadata.shared}
    if cfg.family is Family.WEIGHT_MAJOR and not mma_order:
        # A gptq-order stack the weight-major kernels cannot run (groups under 128, 8-bit) takes the same config
        # through the gptq-order kernels (fused_moe.choose_family): those must compile and fit as well.
        fallback = compile_config(replace(cfg, family=Family.GPTQ_ORDER, direct=False), act, variant, mma_order)
        shared.update({f"{name} fallback": size for name, size in fallback.items()})
    return shared


def before_dependency_wait_untouched(ptx: str) -> bool:
    """Whether a kernel touches no global memory before its dependent launch's wait."""
    from tests.support.sm90 import before_dependency_wait

    return before_dependency_wait(ptx) == {"waits": 1, "loads": 0, "l2_loads": 0, "writes": 0}


def check_dependent_launches(prepare_ptx: str, w13_ptx: str, w2_ptx: str) -> None:
    """The decode launches as dependent launches (kernels/backend.py dependent_launch): prepare and w13 touch global
    memory only after their wait; w2 reads its weights before (w13 still running), its pair's expert id and routing
    weight past L1 (written two launches back; the weight loaded after the K loop was one more round trip at the end
    of every program), and writes nothing before."""
    from tests.support.sm90 import before_dependency_wait

    untouched = {"waits": 1, "loads": 0, "l2_loads": 0, "writes": 0}
    assert before_dependency_wait(prepare_ptx) == untouched
    assert before_dependency_wait(w13_ptx) == untouched
    w2 = before_dependency_wait(w2_ptx)
    assert w2["waits"] == 1 and w2["writes"] == 0 and w2["l2_loads"] == 2 and w2["loads"] > w2["l2_loads"], w2


# (activation dtype, scheme variant, mma128 word order): g128 stacks, act-order or not, are mma128 (what the
# converter writes); gptq order is what v1 checkpoints and the weight-major kernels' nibble-major path read.
VARIANTS = (("float16", "sym", True), ("bfloat16", "asym_actorder", True), ("float16", "sym", False))


def variants_of(cfg: KernelConfig) -> list[tuple[str, str, bool]]:
    """The variants a config's kernels differ in: the older tensor-core kernels read only gptq order, so the
    word order would compile the same code twice for them."""
    reads_word_order = cfg.family is not Family.GPTQ_ORDER
    return [v for v in VARIANTS if reads_word_order or v[2]]


def _worker() -> None:
    """Subprocess entry: compile all configs, print one JSON line per (config, variant)."""
    for cfg in all_configs():
        for act, variant, mma_order in variants_of(cfg):
            shared = compile_config(cfg, act, variant, mma_order)
            print(json.dumps({"config": cfg.to_dict(), "act": act, "variant": variant, "shared": shared}), flush=True)


def test_nvidia_backend_ships_ptxas():
    import triton.backends.nvidia

    assert (Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas").exists()


@pytest.mark.slow
def test_every_config_compiles_for_sm90_within_shared_memory():
    from tests.support.sm90 import run_compile_worker

    results = run_compile_worker(__file__)
    assert len(results) == sum(len(variants_of(cfg)) for cfg in all_configs())
    too_big = [r for r in results if max(r["shared"].values()) > SM90_SHARED_LIMIT]
    assert not too_big, too_big


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
