#!/usr/bin/env bash
# Regenerate the performance figures of docs/benchmarks.md's first sections and of issue 40's (the floor, the peers,
# the profile split, fused projections), side by side in one run (CPU: about an hour on 2 cores; the machine should
# be otherwise idle for the timing ratios to mean much).
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
# 3. issue 40: hfsdp against this machine's floor and its peers (one process, LoRA too; 2 ranks), where a step goes,
#    and whether fused projections would pay
python benchmarks/peers.py --rounds 3 --steps 8 --warmup 2 --out "$OUT/peers" \
    --tools hfsdp,hfsdp-plain-loss,bare,trl,hfsdp-lora,trl-lora,floor
python benchmarks/peers.py --nproc 2 --rounds 3 --steps 6 --warmup 2 --tools hfsdp,bare,floor --out "$OUT/peers-x2"
hfsdp bench benchmarks/peers.yaml --strategies FULL_SHARD --nproc 1,2 --steps 6 --warmup 2 --profile --out "$OUT/profile"
python benchmarks/fused_projections.py | tee "$OUT/fused_projections.txt"
