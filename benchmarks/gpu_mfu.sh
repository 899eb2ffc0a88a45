#!/usr/bin/env bash
# MFU of hfsdp on one GPU: a ~1.07B-parameter Llama-architecture model (Llama-3.2-1B shape: 16 layers, hidden
# 2048, MLP 8192, 32 heads / 8 KV heads; SmolLM2 tokenizer, vocab 49152), random init, bf16 mixed precision,
# FSDP2 FULL_SHARD, 8 x 2048-token rows per step. Goal: MFU >= 45% on one H200 (dense bf16 peak 989 TFLOP/s from
# hfsdp's peak table; set PEAK_TFLOPS for a GPU missing from it). Budget: < 10 minutes.
#   benchmarks/gpu_mfu.sh [OUT_DIR]
# PYTHON: the interpreter (default python3; hfsdp runs as `$PYTHON -m hfsdp`, so no console script is needed).
# WORK_DIR: where the 1B model (4.3 GB of fp32 safetensors) and the data are written (default: OUT_DIR).
# scripts/gpu_kit.sh run calls it as its mfu stage.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -le 1 ]] || { echo "usage: benchmarks/gpu_mfu.sh [OUT_DIR]" >&2; exit 2; }
OUT=${1:-bench-gpu}
WORK_DIR=${WORK_DIR:-$OUT}
PYTHON=${PYTHON:-python3}
PEAK_TFLOPS=${PEAK_TFLOPS:-}
STEPS=${STEPS:-20}
export TOKENIZERS_PARALLELISM=false HFSDP_CACHE_DIR=${HFSDP_CACHE_DIR:-$HOME/.cache/hfsdp}
mkdir -p "$OUT" "$WORK_DIR"
"$PYTHON" - "$OUT" "$WORK_DIR" <<'PY'
import sys, random
from pathlib import Path
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from hfsdp.model.loading import resolve_model_path
out, work = Path(sys.argv[1]), Path(sys.argv[2]); model_dir = work / "llama-1b"
tok_dir = resolve_model_path("smollm2-tiny", Path(__import__("os").environ["HFSDP_CACHE_DIR"]))  # carries the tokenizer
if not (model_dir / "config.json").is_file():
    cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(model_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(model_dir)
# long rows of text (~2500 tokens each; cut to max_seq_len) so that every step is 8 x 2048 tokens
random.seed(0)
words = "the of and to in is was for on that with as by at from his her an which it be are this had".split()
with open(work / "long.jsonl", "w") as f:
    for _ in range(400):
        f.write('{"text": "' + " ".join(random.choice(words) for _ in range(2600)) + '"}\n')
(out / "mfu.yaml").write_text(f"""model:
  name_or_path: {model_dir.resolve()}
  dtype: float32
  attn_implementation: sdpa
data:
  format: text
  path: {(work / 'long.jsonl').resolve()}
  max_seq_len: 2048
  too_long: truncate
train:
  output_dir: {(out / 'run').resolve()}
  max_steps: 20
  per_device_batch_size: 8
  learning_rate: 1.0e-4
  lr_scheduler: constant
  log_every: 1
  eval_at_start: false
  export_final: false
  report_to: none
fsdp:
  version: 2
  sharding_strategy: FULL_SHARD
  mixed_precision: bf16
""")
PY
# MFU, TFLOP/s, tokens/s and memory are hfsdp's own per-step metrics (metrics.jsonl; docs/guide.md "Per-step metrics"):
# the medians of the steps after the warm-up. PEAK_TFLOPS, when set, overrides the peak table (train.peak_tflops).
"$PYTHON" -m hfsdp bench "$OUT/mfu.yaml" --strategies FULL_SHARD --nproc 1 --steps "$STEPS" --warmup 3 --out "$OUT/bench" \
  ${PEAK_TFLOPS:+--set train.peak_tflops=$PEAK_TFLOPS}
"$PYTHON" - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
records = [json.loads(line) for line in (out / "bench" / "runs" / "FULL_SHARD-np1" / "train" / "metrics.jsonl").open()]
steps = [r for r in records if "loss" in r and r["step"] > 3]
if not steps or "mfu_pct" not in steps[0]:
    sys.exit("gpu_mfu: no MFU in metrics.jsonl (unknown GPU? set PEAK_TFLOPS to its dense bf16 TFLOP/s)")
med = {k: statistics.median(r[k] for r in steps) for k in ("mfu_pct", "tflops", "tokens_per_s", "step_time_s")}
peak_gib = max(r["mem_max_allocated_gib"] for r in steps)
print(f"{med['tokens_per_s']:.0f} tokens/s, step {med['step_time_s']:.3f} s, peak mem {peak_gib:.1f} GiB: "
      f"{med['tflops']:.0f} TFLOP/s = MFU {med['mfu_pct']:.1f}% "
      f"({'meets' if med['mfu_pct'] >= 45 else 'below'} the 45% goal)")
(out / "mfu.json").write_text(json.dumps({**med, "peak_mem_gib": peak_gib, "steps": len(steps)}, indent=2))
PY
