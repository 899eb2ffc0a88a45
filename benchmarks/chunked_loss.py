"""Memory of the loss, side by side in one invocation: ``train.chunked_loss: true`` vs ``false`` (and chunked with
``train.compile``), one process and 2 FSDP2 ranks, measured as ``hfsdp bench`` measures it (bench_probe: peak RSS
during the steps above the RSS before the model is loaded; ``max_memory_allocated`` on GPUs), with the losses and
grad norms of the same steps and ``hfsdp plan``'s predicted peaks.

    python benchmarks/chunked_loss.py [--out bench-results/chunked-loss] [--steps 3] [--hidden 256]

The model: the Llama architecture shrunk to 2 layers (hidden ``--hidden``, 4 heads, 2 KV heads, MLP 4x) with
Llama-3's 128,256-token vocabulary and tied embeddings, random init (seed 0), the SmolLM2 tokenizer (its ids are
below 49,152); rows: the bundled contacts task as plain text (every token labelled), packed into rows of 2,048
tokens; 2 rows per step (one process: batch 2; 2 ranks: batch 1 each, the same global batch), fp32, FULL_SHARD.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
PRESET_DATA = REPO / "hfsdp" / "config" / "presets" / "data"
VOCAB = 128256


def build_model(folder: Path, hidden: int) -> None:
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfsdp.cli import cache_dir
    from hfsdp.model.loading import _smollm2_tokenizer

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    _smollm2_tokenizer(cache_dir()).save_pretrained(folder)


def write_config(out: Path, model: Path) -> Path:
    text = out / "contacts_text.jsonl"
    with open(text, "w") as f:
        for line in (PRESET_DATA / "contacts_train.jsonl").read_text().splitlines():
            messages = json.loads(line)["messages"]
            f.write(json.dumps({"text": " ".join(m["content"] for m in messages)}) + "\n")
    import yaml

    path = out / "config.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(model)},
        "data": {"format": "text", "path": str(text), "max_seq_len": 2048},
        "train": {"output_dir": str(out / "run"), "max_steps": 3, "per_device_batch_size": 2, "learning_rate": 1e-4,
                  "lr_scheduler": "constant", "log_every": 1, "eval_at_start": False, "export_final": False,
                  "report_to": "none", "seed": 0},
        "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD", "mixed_precision": "no"},
        "plugins": ["packing"],
        "packing": {"max_len": 2048},
    }, sort_keys=False))
    return path


VARIANTS = [  # name, processes, overrides
    ("plain", 1, ["train.chunked_loss=false"]),
    ("chunked", 1, ["train.chunked_loss=true"]),
    ("chunked+compile", 1, ["train.chunked_loss=true", "train.compile=true"]),
    ("plain", 2, ["train.chunked_loss=false", "train.per_device_batch_size=1"]),
    ("chunked", 2, ["train.chunked_loss=true", "train.per_device_batch_size=1"]),
]


def plan_peak(config: Path, sets: list[str], nproc: int) -> float:
    cmd = [sys.executable, "-m", "hfsdp", "plan", str(config), "--nproc", str(nproc), "--strategies", "FULL_SHARD",
           "--json", *[x for s in sets for x in ("--set", s)]]
    rows = json.loads(subprocesses.run(cmd, capture_output=True, text=True, check=True).stdout)["rows"]
    return rows[0]["device_peak"] / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results/chunked-loss"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = out / f"llama-2layer-vocab128k-h{a.hidden}"
    build_model(model, a.hidden)
    config = write_config(out, model)

    from hfsdp.tools.bench import BenchOptions, bench

    results = []
    for name, nproc, sets in VARIANTS:
        where = out / f"{name}-np{nproc}"
        rows = bench(BenchOptions(config=str(config), strategies=["FULL_SHARD"], nprocs=[nproc], steps=a.steps,
                                  out=where, overrides=sets), echo=lambda *x: None)
        metrics = [json.loads(line) for line in
                   (where / "runs" / f"FULL_SHARD-np{nproc}" / "train" / "metrics.jsonl").read_text().splitlines()]
        steps = [(m["loss"], m["grad_norm"]) for m in metrics if "loss" in m]
        results.append({"name": name, "nproc": nproc, "peak_above_base_mib": rows[0]["mem_peak_above_base_mib"],
                        "step_s": rows[0]["step_time_s"], "steps": steps,
                        "plan_peak_mib": plan_peak(config, sets, nproc), "memory_kind": rows[0]["memory_kind"]})
        print(f"{name} x{nproc}: peak above base {results[-1]['peak_above_base_mib']:.0f} MiB, "
              f"step {results[-1]['step_s']:.2f} s", flush=True)

    def find(name, nproc):
        return next(r for r in results if r["name"] == name and r["nproc"] == nproc)

    lines = [f"chunked loss: 2-layer Llama, vocab {VOCAB}, hidden {a.hidden}, packed rows of 2048 tokens, 2 rows per "
             f"step, {a.steps} steps (first not timed), fp32, FULL_SHARD; memory: {results[0]['memory_kind']}",
             "", "| run | ranks | peak above base MiB | ÷ plain (same ranks) | plan peak MiB | step s | losses | "
                 "max rel diff loss / grad norm vs plain (same ranks; plain x2: vs plain x1) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        plain = find("plain", r["nproc"])
        reference = (find("plain", 1) if r is plain else plain)["steps"]
        diff_loss = max(abs(x[0] - y[0]) / abs(y[0]) for x, y in zip(r["steps"], reference))
        diff_norm = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(r["steps"], reference))
        lines.append(f"| {r['name']} | {r['nproc']} | {r['peak_above_base_mib']:.0f} | "
                     f"{r['peak_above_base_mib'] / plain['peak_above_base_mib']:.3f} | {r['plan_peak_mib']:.0f} | "
                     f"{r['step_s']:.2f} | {', '.join(f'{x[0]:.5f}' for x in r['steps'])} | "
                     f"{diff_loss:.1e} / {diff_norm:.1e} |")
    text = "\n".join(lines)
    print(text)
    (out / "chunked_loss.md").write_text(text + "\n")
    (out / "chunked_loss.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
