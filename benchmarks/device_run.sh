#!/usr/bin/env bash
# One device-tool call that re-measures everything the GPU tables need (about 6 minutes on an H200):
#   config sweep -> tuned tables (merged with earlier sweeps) -> kernel benchmark -> load benchmark.
# Usage on the GPU machine, from the repo root: `bash benchmarks/device_run.sh` (results under $OUT).
set -u -o pipefail
source benchmarks/device_env.sh
export PYTHONPATH="$PYTHONPATH:$PWD"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 benchmarks/sweep_moe.py --out "$OUT" --tag _new 2>&1 | grep -E "check|M=" | tee "$OUT/sweep.log"
python3 benchmarks/make_configs.py "$OUT/configs" benchmarks/results/sweep_*.json "$OUT/sweep_moe_new.json"
REPACK_MOE_CONFIG_DIR="$OUT/configs" timeout 200 python3 benchmarks/bench_moe.py --out "$OUT" 2>&1 | grep -E "^\| " 
timeout 150 python3 benchmarks/bench_load.py --layers 16 --work /tmp/bench-load --out "$OUT" 2>&1 | tail -4
