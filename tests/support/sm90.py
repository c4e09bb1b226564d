"""Facts about Hopper (sm_90) the CPU compile tests check kernels against (test_kernel_compile_sm90.py runs itself
as a script in a subprocess: its worker keeps its own copy of the limit)."""

SM90_SHARED_LIMIT = 232448  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200


def run_compile_worker(script: str, timeout: int = 900) -> list[dict]:
    """Run ``script --worker`` without TRITON_INTERPRET (the test session sets it; the compiler must not see it)
    and return the JSON lines it printed, one per compiled kernel or config."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, script, "--worker"], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
