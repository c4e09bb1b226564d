"""The same-process run against Marlin (../shared/bench-marlin, copied to .bench-marlin/) on the call users get,
with every launch of every timed call.

    ANCHOR_DEV=.bench-marlin/dev ANCHOR_PROJ=. python3 benchmarks/anchor_run.py [bench_anchor.py's arguments]
    python3 benchmarks/anchor_report.py $OUT/anchor_results.json --launches

The harness is a tool beside the project, and its README asks each checkout to adapt its own copy; this script
makes the two changes without editing it, so every checkout measures the same way:

- the project variant runs the layer as MoeBlock and the vLLM plugin do, from router logits through
  ``repack.runtime.fused_moe.routed_moe`` (routing inside the call's first launch where that is faster:
  runtime/kernels/align.py, decode.py), not ``route()`` and then ``fused_moe``;
- ``project:NAME=VALUE[;NAME=VALUE]`` in ANCHOR_VARIANTS adds the project's call under those environment settings
  (``project:REPACK_GLUON_WS=0``: without the warp-specialized kernels) or module constants
  (``project:decode.GLUON_DECODE_HIDDEN=3584``), timed beside the others, in the bf16 and act-order cells too;
- ``project_rows`` in ANCHOR_VARIANTS adds the project's call on the same words laid out as version 2's "mma128"
  rows (formats/SPEC.md section 3; a copy per stack, made once per model), so the word layouts are compared in one
  process;
- every timed variant, Marlin's too, is profiled over the same CUDA graph (benchmarks/launch_profile.py), one row
  per launch, which ``anchor_report.py --launches`` tabulates;
- a model whose fp16 Triton variant's dequantized weights do not fit the GPU beside the others runs without that
  variant (a line says so) rather than not at all;
- ``ANCHOR_ROUTING_SKEW=s`` (default 0: the harness's uniform routing) adds ``s * b[e]`` to every token's router
  logits, ``b`` one fixed standard-normal draw per expert: served models route unevenly (a few experts take many of
  a step's tokens), and a kernel tuned on uniform routing can lose there (KERNEL_NOTES.md item 28). The reference
  routing, the floor's experts-touched count and every variant see the same skewed logits.

The harness's parallel compile warm-up starts copies of itself; they run this script instead (same arguments), so
they compile the kernels the timed process runs. ``ANCHOR_HARNESS`` points elsewhere than
``.bench-marlin/bench_anchor.py``. Plumbing check on a CPU: the harness's ``--cpu-test`` (its README), through
this script.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import importlib
import importlib.util
import os
import sys
import weakref
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(os.environ.get("ANCHOR_HARNESS", ROOT / ".bench-marlin" / "bench_anchor.py"))


def load_harness(path: Path = HARNESS) -> ModuleType:
    """The harness as a module (its ``main`` not run)."""
    if not path.is_file():
        sys.exit(f"error: no harness at {path}; copy ../shared/bench-marlin to .bench-marlin (its README) first")
    spec = importlib.util.spec_from_file_location("bench_anchor", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_anchor"] = module
    spec.loader.exec_module(module)
    return module


def with_environment(step, settings: dict[str, str]):
    """``step`` run with ``settings``: ``NAME=VALUE`` in os.environ (the runtime's switches, read as each call is
    planned: the CUDA-graph capture plans the calls it replays), ``module.NAME=VALUE`` a constant of
    repack.runtime.kernels.<module> (a Python literal); both restored after."""
    constants = {tuple(name.split(".", 1)): ast.literal_eval(value) for name, value in settings.items() if "." in name}
    environment = {name: value for name, value in settings.items() if "." not in name}

    def run(i):
        with contextlib.ExitStack() as patches:
            patches.enter_context(mock.patch.dict(os.environ, environment))
            for (module, name), value in constants.items():
                target = importlib.import_module(f"repack.runtime.kernels.{module}")
                patches.enter_context(mock.patch.object(target, name, value))
            return step(i)

    return run


def skew_routing(harness: ModuleType, skew: float) -> None:
    """Router logits of every cell skewed by ``skew`` times a fixed per-expert draw. The harness draws a cell's logits
    and hands them first to its reference routing: that call adds the bias in place, so the reference, the floor and
    every variant's routing read the same tensor."""
    ref_route = harness.ref_route

    def skewed_ref_route(logits, m):
        import torch  # the harness imports it in its setup(), after this patch

        experts = getattr(m, "E", None)  # the harness's own smoke check routes a SimpleNamespace: left as drawn
        if experts is not None and skew:
            bias = torch.randn(experts, generator=torch.Generator().manual_seed(experts))
            logits.add_((skew * bias).to(logits.device, logits.dtype))
        return ref_route(logits, m)

    harness.ref_route = skewed_ref_route


_ROWS_CACHE: dict[int, list] = {}


def row_major_stacks(stacks: list) -> list | None:
    """``stacks`` (MoeWeights in "mma128_tiles") with their words copied into "mma128" rows, made once per list (the
    harness keeps one list per model; the copies go with it); None where the GPU has no room
    for the copies beside the harness's weights (the variant is then left out, with a line)."""
    if id(stacks) not in _ROWS_CACHE:
        import torch

        from repack.formats.stacks import MMA128_ORDER, TILES_ORDER
        from repack.formats.word_order import from_tiles

        _ROWS_CACHE.clear()
        if any(s.word_order != TILES_ORDER for s in stacks):
            raise ValueError("project_rows: the project's stacks are not in mma128_tiles")
        try:
            # freed with the model's stacks (the harness drops them before building the next model's weights)
            weakref.finalize(stacks[0], _ROWS_CACHE.pop, id(stacks), None)
            _ROWS_CACHE[id(stacks)] = [
                replace(s, word_order=MMA128_ORDER, w13_qweight=from_tiles(s.w13_qweight),
                        w2_qweight=from_tiles(s.w2_qweight))
                for s in stacks
            ]  # fmt: skip
        except torch.cuda.OutOfMemoryError:
            print(f"project_rows: no GPU memory for a second copy of {len(stacks)} stacks; left out", flush=True)
            return None
    return _ROWS_CACHE[id(stacks)]


def fp16_where_it_fits(build_main_weights):
    """The harness's ``build_main_weights`` leaving out the fp16 Triton variant's dequantized copies, with a line,
    where they do not fit beside the others: DeepSeek-V3's are 22 GB a copy, and on an H100 the model was lost
    whole to that variant (benchmarks/RESULTS.md 2026-12-07 23:32 UTC, call 3); its other variants still run."""

    def build(m, dtype, device, compile_only, which, cpu):
        import torch  # the harness imports it in its setup()

        try:
            return build_main_weights(m, dtype, device, compile_only, which, cpu)
        except torch.cuda.OutOfMemoryError:
            if "triton_fp16" not in which:
                raise
        gc.collect()  # the failed build's tensors, freed with its frames once the exception is gone
        torch.cuda.empty_cache()
        print(f"{m.key}: no GPU memory for triton_fp16's dequantized weights; that variant left out", flush=True)
        weights = build_main_weights(m, dtype, device, compile_only, [v for v in which if v != "triton_fp16"], cpu)
        weights.pop("fp16", None)  # make_variants builds the variant only where its weights are
        return weights

    return build


def adapt(harness: ModuleType) -> None:
    """Patch the harness in place: the project variant through routed_moe, every timing with its launches, the fp16
    Triton variant left out of a model whose dequantized weights do not fit."""
    make_variants, time_graph = harness.make_variants, harness.time_graph
    harness.build_main_weights = fp16_where_it_fits(harness.build_main_weights)
    skew_routing(harness, float(os.environ.get("ANCHOR_ROUTING_SKEW", "0")))

    def routed_variants(m, W, logits, xs, dtype, device, which):
        variants = make_variants(m, W, logits, xs, dtype, device, which)
        if "project" in variants:
            from repack.runtime.fused_moe import routed_moe  # the harness's setup() has imported the checkout

            _, copies, ctx, info = variants["project"]
            stacks = W["project"]

            def project(i):
                return routed_moe(xs[i], stacks[i], logits, m.top_k, m.renorm)

            variants["project"] = (project, copies, ctx, dict(info, entry="routed_moe"))
            rows = row_major_stacks(stacks) if "project_rows" in which else None
            if rows is not None:

                def project_rows(i):
                    return routed_moe(xs[i], rows[i], logits, m.top_k, m.renorm)

                variants["project_rows"] = (project_rows, copies, ctx,
                                            dict(info, entry="routed_moe", words="mma128 rows"))  # fmt: skip
            # "project:NAME=VALUE[;NAME=VALUE]": the same call under those settings; the harness runs its extras
            # (bf16, act-order) with ["project", "marlin"] only, so they are read from ANCHOR_VARIANTS too
            asked = os.environ.get("ANCHOR_VARIANTS", "").split(",")
            for name in dict.fromkeys([*which, *asked]):
                if name.startswith("project:"):
                    settings = dict(item.split("=", 1) for item in name.removeprefix("project:").split(";"))
                    variants[name] = (with_environment(project, settings), copies, ctx,
                                      dict(info, entry="routed_moe", environment=settings))  # fmt: skip
        return variants

    def profiled_time_graph(step, copies, *args, **kwargs):
        record = time_graph(step, copies, *args, **kwargs)
        if str(ROOT) not in sys.path:
            sys.path.append(str(ROOT))  # appended: the checkout's repack/ must not hide the harness's package map
        from benchmarks.launch_profile import profile_graph

        record["launches"] = profile_graph(step, copies)
        return record

    harness.make_variants = routed_variants
    harness.time_graph = profiled_time_graph
    harness.__file__ = str(Path(__file__).resolve())  # the warm-up's children start this script, not the harness


def main(argv: list[str] | None = None) -> None:
    harness = load_harness()
    adapt(harness)
    harness.main(argv)


if __name__ == "__main__":
    main()
