#!/usr/bin/env bash
# One device-tool call that re-measures everything the GPU tables need (about 6 minutes on an H200):
#   config sweep -> tuned tables (merged with earlier sweeps) -> kernel benchmark -> load benchmark.
# Usage on the GPU machine, from the repo root: `bash benchmarks/device_run.sh` (results under $OUT).
set -u -o pipefail
source benchmarks/device_env.sh
export PYTHONPATH="$PYTHONPATH:$PWD"
# The GPU machine has torch and triton but not the CLI's dependencies, which bench_load's `repack convert` needs:
# install the wheels `make device-wheels` put in .wheels/ (pass carry=[".wheels"] to the device tool).
if [ -d .wheels ]; then
  python3 -m pip install -q --no-index --find-links .wheels --target /tmp/site rich typer huggingface_hub 2>/dev/null
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout 200 python3 benchmarks/sweep_moe.py --out "$OUT" --tag _new 2>&1 | grep -E "check|M=" | tee "$OUT/sweep.log"
# The shipped tables' sweeps (benchmarks/tables.json), then this run's.
python3 benchmarks/make_configs.py "$OUT/configs" "$OUT/sweep_moe_new.json"
REPACK_MOE_CONFIG_DIR="$OUT/configs" timeout 250 python3 benchmarks/bench_moe.py --quick --out "$OUT" 2>&1 | grep -E "^\| " 
timeout 150 python3 benchmarks/bench_load.py --layers 10 --work /tmp/bench-load --out "$OUT" 2>&1 | tail -4
