#!/usr/bin/env bash
# Run the GPU-only test suite (`pytest -m gpu`) on a CUDA machine.
#
#   scripts/gpu_check.sh [extra pytest args]      e.g. scripts/gpu_check.sh -x -k fsdp2
#
# Exits 0 with a message (nothing run) when no NVIDIA GPU / CUDA torch is
# available, so it is safe to call anywhere; set GPU_CHECK_REQUIRE=1 to make
# that case exit 3 instead (for jobs that must run on a GPU).
# Time limit: GPU_CHECK_TIMEOUT seconds (default 600) for the whole pytest run.
# Issue 21 (chunked loss, compiled blocks, attention kernels incl. flash_attention_2): scripts/gpu_check.sh -k chunked_loss_compile
# Issue 22 (QLoRA: 4-bit bf16-stored weights gathered by FSDP2 on CUDA, the start-up probe): scripts/gpu_check.sh -k qlora
# Issue 37 (tensor parallelism: tp 2 on 2 GPUs over NCCL against one GPU, export): scripts/gpu_check.sh -k tensor_parallel
# Issue 54 (sequence parallelism: sp 2 on 2 GPUs over NCCL's all-to-all and SDPA's CUDA kernels against one GPU): scripts/gpu_check.sh -k sequence_parallel
# Issue 55 (hfsdp eval: lm-eval on a model FSDP2 shards over 2 GPUs on NCCL, against one GPU): scripts/gpu_check.sh -k hfsdp_eval
# Issue 56 (the cost curves: a bench sweep on one GPU, plan within 10 % at every point): scripts/gpu_check.sh -k sweep
# Issue 56 (the tied embedding's one gradient with CUDA's index_put_, fp32 and bf16, bit for bit twice): scripts/gpu_check.sh -k tied_weights
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
PYTHON="${PYTHON:-python}"
TIMEOUT="${GPU_CHECK_TIMEOUT:-600}"

no_gpu() {
    echo "gpu_check: SKIPPED - $1" >&2
    if [[ "${GPU_CHECK_REQUIRE:-0}" == 1 ]]; then exit 3; fi
    exit 0
}

command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi not found (no NVIDIA driver on this host)."
nvidia-smi -L >/dev/null 2>&1 || no_gpu "nvidia-smi found but lists no usable GPU."
cuda_info="$("$PYTHON" - <<'PY' 2>&1
import sys
try:
    import torch
except Exception as exc:  # noqa: BLE001
    print(f"cannot import torch: {exc}")
    sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} has no usable CUDA (torch.version.cuda={torch.version.cuda}); "
          "install a CUDA build of torch")
    sys.exit(1)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): "
      + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
PY
)" || no_gpu "$cuda_info"

echo "gpu_check: $cuda_info"
echo "gpu_check: running '$PYTHON -m pytest -m gpu -q $*' (timeout ${TIMEOUT}s)"
log="$(mktemp -t gpu_check.XXXXXX.log)"
start=$(date +%s)
timeout --kill-after=30 "$TIMEOUT" "$PYTHON" -m pytest -m gpu -q "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
elapsed=$(( $(date +%s) - start ))

echo
echo "===================== gpu_check summary ====================="
echo "host:     $(hostname)"
echo "devices:  $cuda_info"
echo "elapsed:  ${elapsed}s (limit ${TIMEOUT}s)"
result_line="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran' "$log" | tail -n 1)"
echo "pytest:   ${result_line:-<no result line>}"
case "$rc" in
    0)   echo "result:   PASS" ;;
    1)   echo "result:   FAIL (test failures)" ;;
    5)   echo "result:   NOTHING RAN (no test marked 'gpu' was collected)" ;;
    124|137) echo "result:   TIMEOUT after ${TIMEOUT}s" ;;
    *)   echo "result:   ERROR (pytest exit code $rc)" ;;
esac
echo "log:      $log"
exit "$rc"
