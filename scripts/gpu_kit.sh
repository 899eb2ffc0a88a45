#!/usr/bin/env bash
# The GPU kit: hfsdp's GPU checks as one command on an air-gapped GPU host (docs/gpu_hosts.md, "Air-gapped GPU host").
#
#   scripts/gpu_kit.sh prepare        on a connected machine: download the locked wheels (scripts/gpu_kit.lock.json)
#                                     into .gpu_kit/wheels, seed .gpu_kit/cache (tokenizer + model config), rehearse
#                                     the install for the host's Python 3.12, print the size of what is copied (the
#                                     tree + .gpu_kit) and fail over 64 MiB
#   scripts/gpu_kit.sh size           that size report alone, without downloading (CI)
#   scripts/gpu_kit.sh run [OUT_DIR]  on the GPU host (default OUT_DIR: gpu-kit-out), 8 minutes in all, in stages
#                                     with their own time limits: install (the wheels into a temporary site folder),
#                                     check (hfsdp from the tree, its requirements met), gpu (torch sees CUDA),
#                                     gpu-tests (pytest -m gpu), mfu (benchmarks/gpu_mfu.sh); prints PASS/FAIL/SKIP
#                                     per stage, writes OUT_DIR/summary.txt, summary.json and logs/; exits 1 if a
#                                     stage failed, else 0
#   scripts/gpu_kit.sh lock           on a connected machine: re-resolve the lock (after a dependency change)
#
# PYTHON picks the interpreter: for run, the image's python3; for prepare/size/lock, .venv/bin/python if present.
# GPU_KIT_LIMITS="total=600 gpu-tests=300" changes the time limits (seconds) below; GPU_KIT_KEEP_WORK=1 keeps the
# temporary folder (site, cache, the 1B model).
# On a machine without an NVIDIA GPU, run skips the GPU stages, saying why, and exits 0 unless another stage failed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

# Stage time limits in seconds (their sum is the whole window).
TOTAL_S=480
declare -A LIMIT_S=([install]=40 [check]=40 [gpu]=30 [gpu-tests]=230 [mfu]=140)
PER_TEST_S=150  # pytest-timeout for one GPU test, so one hung test does not take the whole gpu-tests stage
# GPU_KIT_LIMITS="total=600 gpu-tests=300" overrides them for another host's window.
for kv in ${GPU_KIT_LIMITS:-}; do
    key=${kv%%=*} value=${kv#*=}
    [[ "$value" =~ ^[0-9]+$ ]] || { echo "gpu_kit.sh: GPU_KIT_LIMITS: '$kv' is not NAME=SECONDS" >&2; exit 2; }
    if [[ "$key" == total ]]; then TOTAL_S=$value; elif [[ -v "LIMIT_S[$key]" ]]; then LIMIT_S[$key]=$value;
    else echo "gpu_kit.sh: GPU_KIT_LIMITS: unknown stage '$key' (total ${!LIMIT_S[*]})" >&2; exit 2; fi
done

usage() {
    awk 'NR > 2 && /^#/ { sub(/^# ?/, ""); print; next } NR > 2 { exit }' "$0" >&2
    exit 2
}

dev_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; elif [[ -x .venv/bin/python ]]; then echo .venv/bin/python;
    else echo python3; fi
}

[[ $# -ge 1 ]] || usage
cmd=$1
shift
case "$cmd" in
    prepare)
        [[ $# -eq 0 ]] || usage
        PY=$(dev_python)
        "$PY" scripts/gpu_kit.py download
        "$PY" scripts/gpu_kit.py seed
        "$PY" scripts/gpu_kit.py rehearse
        exec "$PY" scripts/gpu_kit.py size
        ;;
    size | lock)
        [[ $# -eq 0 ]] || usage
        exec "$(dev_python)" scripts/gpu_kit.py "$cmd"
        ;;
    run)
        [[ $# -le 1 ]] || usage
        ;;
    -h | --help | help) usage ;;
    *)
        echo "gpu_kit.sh: unknown command '$cmd'" >&2
        usage
        ;;
esac

# ------------------------------------------------------------------------------------------------------------ run
PY=${PYTHON:-python3}
OUT=$(mkdir -p "${1:-gpu-kit-out}" && cd "${1:-gpu-kit-out}" && pwd)
mkdir -p "$OUT/logs"
WORK=$(mktemp -d -t hfsdp-gpu-kit.XXXXXX)
cleanup() { [[ "${GPU_KIT_KEEP_WORK:-0}" == 1 ]] || rm -rf "$WORK"; }
trap cleanup EXIT
SITE=$WORK/site
mkdir -p "$WORK/cache" "$WORK/hf"
[[ -d .gpu_kit/cache ]] && cp -r .gpu_kit/cache/. "$WORK/cache/"
# Everything below runs hfsdp from this tree on the image's packages plus the kit's, offline.
export PYTHONPATH="$REPO:$SITE" HFSDP_CACHE_DIR="$WORK/cache" HF_HOME="$WORK/hf" MPLCONFIGDIR="$WORK/mpl"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHON="$PY"

START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
NAMES=() RESULTS=() SECONDS_USED=() LIMITS=() DETAILS=()

record() { # name result seconds limit detail
    NAMES+=("$1") RESULTS+=("$2") SECONDS_USED+=("$3") LIMITS+=("$4") DETAILS+=("$5")
    printf 'gpu_kit: %-10s %-4s %4ss  %s\n' "$1" "$2" "$3" "$5"
}

skip() { record "$1" SKIP 0 "${LIMIT_S[$1]}" "$2"; }

# stage NAME DETAIL_FN CMD...: run CMD under the stage's limit (or what is left of the window), log it, record it.
# Exit 0 PASS, 77 SKIP (reason on its last 'SKIP: ' line), 124/137 FAIL (timed out), else FAIL.
stage() {
    local name=$1 detail_fn=$2 log="$OUT/logs/$1.log"
    shift 2
    local left=$((DEADLINE - $(date +%s))) limit=${LIMIT_S[$name]}
    ((left >= limit)) || limit=$left
    if ((left < 5)); then
        skip "$name" "no time left in the ${TOTAL_S}s window"
        return
    fi
    echo "gpu_kit: --- $name (limit ${limit}s): $*"
    local t0 rc
    t0=$(date +%s)
    set +e
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    local used=$(($(date +%s) - t0)) detail
    detail=$("$detail_fn" "$log" "$rc")
    case "$rc" in
        0) record "$name" PASS "$used" "$limit" "$detail" ;;
        77) record "$name" SKIP "$used" "$limit" "$(grep '^SKIP: ' "$log" | tail -n 1 | cut -c7- || true)" ;;
        124 | 137) record "$name" FAIL "$used" "$limit" "timed out after ${limit}s; $detail" ;;
        *) record "$name" FAIL "$used" "$limit" "exit $rc; $detail" ;;
    esac
}

last_line() { grep -v '^\s*$' "$1" | tail -n 1 | cut -c1-200 || true; }
pytest_line() {
    local line
    line=$(grep -E '^(=+ )?([0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran)' "$1" | tail -n 1 |
        sed 's/^=* //; s/ =*$//' || true)
    [[ "$2" == 5 ]] && line="no test marked gpu was collected${line:+ ($line)}"
    echo "${line:-no pytest summary line; see logs/gpu-tests.log}"
}
mfu_line() { grep -E 'MFU [0-9.]+%|^gpu_mfu:' "$1" | tail -n 1 || last_line "$1"; }

no_gpu_reason() {
    if command -v nvidia-smi >/dev/null 2>&1 || compgen -G '/dev/nvidia[0-9]*' >/dev/null; then return 1; fi
    echo "no NVIDIA GPU on this machine (no nvidia-smi, no /dev/nvidia*)"
}

echo "gpu_kit: run in $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout')), python: $PY, out: $OUT, window ${TOTAL_S}s"
stage install last_line "$PY" -I scripts/gpu_kit.py install --site "$SITE"
stage check last_line "$PY" scripts/gpu_kit.py check --site "$SITE"
if reason=$(no_gpu_reason); then
    for name in gpu gpu-tests mfu; do skip "$name" "$reason"; done
else
    stage gpu last_line "$PY" -c 'import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}:", ", ".join(
    f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
    for i in range(torch.cuda.device_count())))'
    if [[ "${RESULTS[-1]}" == PASS ]]; then
        stage gpu-tests pytest_line "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout="$PER_TEST_S" \
            --junitxml="$OUT/gpu-tests.xml"
        stage mfu mfu_line env WORK_DIR="$WORK/mfu" bash benchmarks/gpu_mfu.sh "$OUT/mfu"
    else
        for name in gpu-tests mfu; do skip "$name" "the gpu stage failed: CUDA is not usable from torch"; done
    fi
fi

failed=0
for result in "${RESULTS[@]}"; do [[ "$result" != FAIL ]] || failed=1; done
{
    echo "hfsdp GPU kit run: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(($(date +%s) - START))s of the ${TOTAL_S}s window"
    printf '%-10s %-4s %6s %6s  %s\n' stage result time limit detail
    for i in "${!NAMES[@]}"; do
        printf '%-10s %-4s %5ss %5ss  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_USED[$i]}" "${LIMITS[$i]}" "${DETAILS[$i]}"
    done
    echo "logs: $OUT/logs/"
} | tee "$OUT/summary.txt"
for i in "${!NAMES[@]}"; do
    printf '%s\t%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_USED[$i]}" "${LIMITS[$i]}" "${DETAILS[$i]}"
done | "$PY" -I -c 'import json, sys
rows = [dict(zip(("stage", "result", "seconds", "limit_s", "detail"), l.rstrip("\n").split("\t"))) for l in sys.stdin]
for r in rows: r["seconds"], r["limit_s"] = int(r["seconds"]), int(r["limit_s"])
json.dump({"stages": rows, "failed": any(r["result"] == "FAIL" for r in rows)}, open(sys.argv[1], "w"), indent=1)' \
    "$OUT/summary.json"
exit "$failed"
