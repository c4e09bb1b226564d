"""Facts about Hopper (sm_90) the CPU compile tests check kernels against (test_kernel_compile_sm90.py runs itself
as a script in a subprocess: its worker keeps its own copy of the limit)."""

SM90_SHARED_LIMIT = 232448  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200
SM90_SHARED_PER_SM = 233472  # bytes: cudaDevAttrMaxSharedMemoryPerMultiprocessor (228 KB)
SM90_BLOCK_RESERVED = 1024  # bytes the driver keeps per resident block (ncu: "Driver Shared Memory Per Block")


def run_compile_worker(script: str, timeout: int = 900) -> list[dict]:
    """Run ``script --worker`` with TRITON_INTERPRET=0 (the test session sets it to 1; the compiler must not see that)
    and return the JSON lines it printed, one per compiled kernel or config."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    # compile, never interpret: an explicit 0 also keeps repack.runtime from switching the interpreter on
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = str(Path(__file__).resolve().parents[2])  # the worker imports tests.support too
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, script, "--worker"], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def compile_child(child: str, *args: str, timeout: int = 600) -> dict:
    """Run the compile script ``child`` (``python -c``) with ``args`` and TRITON_INTERPRET=0, and return the JSON
    report it prints last (each kernel's PTX and shared memory: the Gluon compile tests' children)."""
    import json
    import os
    import subprocess
    import sys

    # compile, never interpret: an explicit 0 also keeps repack.runtime from switching the interpreter on
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-c", child, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_last_rows_build(report: dict, where: str) -> None:
    """What the compile tests hold a build of reduce "last" (kernels/gluon_sm90.py ``_sum_last_rows``) to: its w13
    (clearing the tickets) and w2 without spills, one acq_rel ticket at GPU scope per token of a tile as the only
    ordered atomic, and the rows read back past L1."""
    import re

    assert ptxas_spills(report["w13"]["ptx"]) == 0, f"{where}: w13 clearing the tickets spills"
    ptx = report["w2"]["ptx"]
    assert ptxas_spills(ptx) == 0, f"{where}: w2 spills to local memory"
    atomics = re.findall(r"\batom\.[\w.]+", ptx)
    assert atomics and set(atomics) == {"atom.global.gpu.acq_rel.add.u32"}, f"{where}: {atomics}"
    assert "ld.global.cg" in ptx, f"{where}: the rows are not read past L1"


def ptxas_spills(ptx: str) -> int:
    """Spill bytes (stores + loads) the ptxas of Triton's nvidia backend reports for ``ptx`` built for sm_90a."""
    import re

    report, _ = _assemble(ptx)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report
    return sum(int(a) + int(b) for a, b in spills)


def local_memory_in_mma_loops(ptx: str) -> int:
    """Local-memory loads and stores (spills) inside the K loops (:func:`local_memory_in_k_loops`) of the SASS ptxas
    builds from ``ptx`` for sm_90a."""
    _, sass = _assemble(ptx, sass=True)
    return local_memory_in_k_loops(sass)


def _assemble(ptx: str, sass: bool = False) -> tuple[str, str]:
    """(ptxas's ``-v`` report, with ``sass`` cuobjdump's SASS listing, else "") of ``ptx`` built for sm_90a by the
    ptxas of Triton's nvidia backend (cuobjdump from the same folder)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(cubin)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        if not sass:
            return out.stderr, ""
        dump = subprocess.run(
            [str(Path(ptxas).parent / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True
        )
    assert dump.returncode == 0, dump.stderr[-2000:]
    return out.stderr, dump.stdout


def local_memory_in_k_loops(sass: str) -> int:
    """STL/LDL instructions of ``sass`` (cuobjdump's listing) inside a K loop: an innermost loop that issues wgmmas
    (HGMMA). A loop is a conditional backward branch and the instructions from its target to it; an unconditional
    one is the return from a wait's retry block, which ptxas places after the code."""
    import re

    code = [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for at, op in code:
        target = re.search(r"\bBRA\s+0x([0-9a-f]+)", op)
        if op.startswith("@") and target and int(target.group(1), 16) <= at:
            loops.append((int(target.group(1), 16), at))
    mma = [(lo, hi) for lo, hi in loops if any(lo <= at <= hi and "HGMMA" in op for at, op in code)]
    k_loops = [(lo, hi) for lo, hi in mma if not any(lo <= a <= b <= hi and (a, b) != (lo, hi) for a, b in mma)]
    local = [at for at, op in code if re.search(r"\b(STL|LDL)\b", op)]
    return sum(1 for at in local if any(lo <= at <= hi for lo, hi in k_loops))


def before_dependency_wait(ptx: str) -> dict[str, int]:
    """What ``ptx`` does to global memory before its first ``griddepcontrol.wait`` (a dependent launch's wait for the
    kernel before it, runtime/kernels/common.py ``await_previous_kernel``), in the PTX's own order: what comes before
    the wait is the kernels' straight prologue (at most a forward branch around the w2 prefetch), so that order is
    the order they run in. ``{"waits": 0/1, "loads": global loads and copies from global, "l2_loads": those of them
    past L1 (.cg), "writes": stores and atomics}``; no wait at all counts the whole kernel."""
    import re

    found = {"waits": 0, "loads": 0, "l2_loads": 0, "writes": 0}
    for line in ptx.splitlines():
        words = re.sub(r"^@!?%p\d+\s+", "", line.strip()).split()  # a predicated instruction counts as one
        op = words[0] if words else ""
        if op.startswith("griddepcontrol.wait"):
            found["waits"] = 1
            break
        if op.startswith(("ld.global", "cp.async.cg.shared.global", "cp.async.ca.shared.global", "cp.async.bulk")):
            found["loads"] += 1
            found["l2_loads"] += ".cg" in op
        elif op.startswith(("st.global", "atom.", "red.")):
            found["writes"] += 1
    return found
