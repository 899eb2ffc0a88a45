#!/usr/bin/env bash
# CPU rehearsal of a multi-process hfsdp run (no GPU needed).
#
#   accelerate_configs/cpu_rehearsal.sh CONFIG [NPROC] [-- extra hfsdp args]
#   e.g. accelerate_configs/cpu_rehearsal.sh examples/tiny.yaml 2 -- --set fsdp.version=1
#
# Why not `accelerate launch --cpu --num_processes N`? For CPU, accelerate
# expects an MPI launcher (mpirun, --mpirun_hostfile); without one it starts a
# single plain python process, so N is silently ignored. torchrun starts N
# processes with RANK/LOCAL_RANK/WORLD_SIZE set and a gloo rendezvous, which is
# what FSDP needs:
#
#   torchrun --standalone --nproc-per-node N -m hfsdp train CONFIG
#
# ACCELERATE_USE_CPU=true is required: under torchrun on a host without CUDA,
# accelerate otherwise reports DistributedType.NO and every process trains alone
# (num_processes == 1 on each rank). With it, accelerate uses MULTI_CPU/gloo.
# Use a config with fsdp.mixed_precision: no (or bf16 if the CPU supports it);
# fp16 is GPU only.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi

config="$1"; shift
nprocs="${1:-2}"
if [[ $# -gt 0 ]]; then shift; fi
if [[ "${1:-}" == "--" ]]; then shift; fi

export ACCELERATE_USE_CPU=true
# Keep N processes from oversubscribing the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / nprocs > 0 ? $(nproc) / nprocs : 1 ))}"
# Hide GPUs so a rehearsal on a GPU box stays on CPU.
export CUDA_VISIBLE_DEVICES=""

exec torchrun --standalone --nproc-per-node "$nprocs" -m hfsdp train "$config" "$@"
