"""The PTX of every kernel the sm_90 compile tests build, from one source tree: proof that a refactor changed no code.

``python -m benchmarks.ptx_dump ROOT OUT.json`` imports ``repack`` (and ``tests``) from the tree at ROOT, not from
the installed package, runs the workers of tests/runtime/test_kernel_compile_sm90.py, test_gluon_compile_sm90.py and
test_glue_compile_sm90.py with ``triton.compile`` recorded, and writes one entry per compiled kernel, in build order:
its test, its place in that test's sequence, the kernel's entry name and its PTX with the debug and line-number
directives removed (they follow the source lines, not the code). ``python -m benchmarks.ptx_dump --diff A.json
B.json`` compares two dumps entry by entry. Run it on the tree before a change and on the tree after, then diff.
Needs no GPU (Triton's nvidia backend compiles for ``GPUTarget("cuda", 90, 32)`` on the CPU); takes minutes, seconds
where Triton's cache already holds the kernels.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

PACKAGES = {"repack": "repack", "repack.runtime": "runtime", "repack.formats": "formats"}  # pyproject's package-dir
TESTS = ("test_kernel_compile_sm90", "test_gluon_compile_sm90", "test_glue_compile_sm90")


def normalized(ptx: str) -> str:
    """``ptx`` without what follows the source text rather than the code: ``.loc`` directives, the labels that
    delimit inlined scopes for the debugger (``$L__tmp``, ``$L__func_begin/end``), and the ``.file`` table and
    DWARF sections at the end (which also name the tree's path)."""
    end = re.search(r"^\s*\.(file|section)\b", ptx, flags=re.M)
    body = ptx[: end.start()] if end else ptx
    debug = re.compile(r"\s*(\.loc\b|\$L__tmp\d+:|\$L__func_(begin|end)\d+:)")
    return "\n".join(line for line in body.splitlines() if not debug.match(line)) + "\n"


def entry_name(ptx: str) -> str:
    match = re.search(r"\.entry\s+(\w+)", ptx)
    return match.group(1) if match else "?"


def _import_tree(root: Path) -> None:
    """Make ``repack``, ``tests`` and ``benchmarks`` resolve inside ``root``, not in the installed package (whose
    ``moe_repack.pth`` may have imported ``repack.runtime`` already, from another tree)."""
    sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in getattr(f, "__name__", type(f).__name__)]
    for name in [n for n in sys.modules if n.split(".")[0] in ("repack", "tests", "benchmarks")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    for name, folder in PACKAGES.items():
        spec = importlib.util.spec_from_file_location(
            name, root / folder / "__init__.py", submodule_search_locations=[str(root / folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if "." in name:
            setattr(sys.modules[name.rpartition(".")[0]], name.rpartition(".")[2], module)
        spec.loader.exec_module(module)


def _gluon_builds(test) -> None:
    """What test_gluon_compile_sm90 builds: its child script, in this process, for every tile and variant."""
    from repack.runtime.tune import GLUON_TILES

    for cfg in GLUON_TILES:
        for act, asym in test.VARIANTS:
            argv = sys.argv
            sys.argv = ["child", json.dumps(cfg.to_list()), act, "1" if asym else "0"]
            try:
                exec(compile(test._CHILD, "gluon-child", "exec"), {"__name__": "gluon_child"})
            finally:
                sys.argv = argv


def _child(root: Path, out: Path) -> None:
    _import_tree(root)
    import triton

    builds: list[dict] = []
    current = {"test": ""}
    real_compile = triton.compile

    def recording_compile(*args, **kwargs):
        kernel = real_compile(*args, **kwargs)
        ptx = kernel.asm["ptx"]
        seq = sum(1 for b in builds if b["test"] == current["test"])
        builds.append(dict(test=current["test"], seq=seq, entry=entry_name(ptx), ptx=normalized(ptx)))
        return kernel

    triton.compile = recording_compile
    for name in TESTS:
        current["test"] = name
        test = importlib.import_module(f"tests.runtime.{name}")
        for module in (test, importlib.import_module("repack.runtime.fused_moe")):
            assert Path(module.__file__).resolve().is_relative_to(root.resolve()), module.__file__
        with contextlib.redirect_stdout(io.StringIO()):
            if name == "test_gluon_compile_sm90":
                _gluon_builds(test)
            else:
                test._worker()
        print(f"{name}: {sum(1 for b in builds if b['test'] == name)} kernels", file=sys.stderr, flush=True)
    out.write_text(json.dumps(builds))


def dump(root: str, out: str) -> None:
    """Run the workers in a fresh process with TRITON_INTERPRET=0: compiled, never interpreted (an explicit 0 also
    keeps repack.runtime from switching the interpreter on where torch sees no GPU)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    paths = [str(Path(p).resolve()) for p in (root, out)]
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *paths], env=env, check=True)


def diff(before: str, after: str) -> int:
    """Print how two dumps compare; 0 when every kernel's PTX is identical, 1 otherwise."""
    a, b = (json.loads(Path(p).read_text()) for p in (before, after))
    key = lambda e: (e["test"], e["seq"])  # noqa: E731
    left, right = {key(e): e for e in a}, {key(e): e for e in b}
    different = [k for k in left if k in right and left[k]["ptx"] != right[k]["ptx"]]
    missing, extra = sorted(set(left) - set(right)), sorted(set(right) - set(left))
    for test in TESTS:
        n = sum(1 for k in left if k[0] == test)
        same = sum(1 for k in left if k[0] == test and k in right and k not in different)
        print(f"{test}: {n} kernels before, {sum(1 for k in right if k[0] == test)} after, {same} identical")
    for k in different[:20]:
        print(f"different: {k} {left[k]['entry']} / {right[k]['entry']}")
    for k in missing[:20] + extra[:20]:
        print(f"{'only before' if k in left else 'only after'}: {k}")
    print(f"{len(left)} kernels compared: {'identical' if not (different or missing or extra) else 'NOT identical'}")
    return 1 if different or missing or extra else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--diff"]:
        sys.exit(diff(*sys.argv[2:4]))
    if sys.argv[1:2] == ["--child"]:
        sys.exit(_child(*map(Path, sys.argv[2:4])))
    dump(*sys.argv[1:3])
