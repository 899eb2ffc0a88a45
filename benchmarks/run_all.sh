#!/usr/bin/env bash
# Regenerate every performance figure of docs/benchmarks.md, side by side in one run (CPU: ~10-15 minutes on
# 2 cores; the machine should be otherwise idle for the timing ratios to mean much).
#   benchmarks/run_all.sh [OUT_DIR]        (default bench-results/)
# Env: STEPS (default 6) steps per strategy run; OVERHEAD_ROUNDS (default 2) interleaved hfsdp/bare pairs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results}
STEPS=${STEPS:-6}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
# 1. strategies x world sizes on the weights-dominated bench model, bench's defaults (table + chart); one process
#    runs once, without a wrapper (fsdp.single_process: auto)
hfsdp bench bench --strategies FULL_SHARD,SHARD_GRAD_OP,NO_SHARD --nproc 1,2,4 --steps "$STEPS" --out "$OUT/strategies"
# 2. --help time, preprocessing cache, export memory, hfsdp vs bare Accelerate loop; prints the goals table
python benchmarks/goals.py --out "$OUT" --bench-dir "$OUT/strategies" --overhead-rounds "${OVERHEAD_ROUNDS:-2}"
