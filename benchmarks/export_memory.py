"""Export memory at three model sizes: `hfsdp export` vs `accelerate merge-weights` on the same SHARDED checkpoints.

For each model a real 2-rank FULL_SHARD run (gloo, one step) writes a SHARDED checkpoint; then, in fresh processes,
`hfsdp export CKPT OUT` (default --max-shard-size) and `accelerate merge-weights CKPT/pytorch_model_fsdp_0 OUT` run
on it and their peak RSS is measured (RUSAGE_CHILDREN of a wrapper process). The goal (issue 13, section 3):

  * hfsdp export peak RSS above the interpreter baseline <= --max-shard-size + 2 x the largest tensor, at every size
    (the interpreter baseline is the peak RSS of `python -c "import torch"`: export reads torch checkpoints);
  * on SmolLM2-135M, export peak RSS / merge-weights peak RSS <= 0.5.

Models: `smollm2-bench` (75M), `smollm2-135m-instruct` (the real 135M) and a 362M model with SmolLM2-360M's shape and
random weights, built from its config into the work folder (no download).

    python benchmarks/export_memory.py --out /tmp/export-memory [--models bench,135m,360m] [--gguf q8_0]

With ``--gguf QUANT`` the hfsdp export also writes the GGUF file (``--format gguf``), from the folder it wrote, one
tensor at a time: the same goals (issue 55).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import subprocesses

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goals import PY, env, peak_rss_of  # noqa: E402

from hfsdp.export.hf_folder import DEFAULT_MAX_SHARD_BYTES  # noqa: E402
from hfsdp.parallel.launcher import free_port  # noqa: E402

# SmolLM2-360M's architecture (config.json of HuggingFaceTB/SmolLM2-360M), weights random.
SHAPE_360M = dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                  num_key_value_heads=5, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                  rope_theta=100000.0, rms_norm_eps=1e-5)
MIB = 2**20


def random_model(folder: Path, cache: Path) -> str:
    """A Llama model of SmolLM2-360M's shape with seeded random weights and the SmolLM2 tokenizer."""
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hfsdp.model.loading import resolve_model_path

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE_360M))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_model_path("smollm2-tiny", cache)).save_pretrained(folder)
    return str(folder)


def sharded_checkpoint(work: Path, name: str, model: str) -> Path:
    run = work / f"run-{name}"
    ckpt = run / "checkpoints" / "step-1"
    if (ckpt / "hfsdp_checkpoint.json").is_file():
        return ckpt
    shutil.rmtree(run, ignore_errors=True)
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "hfsdp", "train", "tiny", "--set", f"model.name_or_path={model}",
           "--set", f"train.output_dir={run}", "--set", "train.max_steps=1", "--set", "train.save_every=1",
           "--set", "train.export_final=false", "--set", "train.eval_at_start=false", "--set", "data.max_seq_len=64",
           "--set", "train.per_device_batch_size=1", "--set", "fsdp.sharding_strategy=FULL_SHARD",
           "--set", "fsdp.state_dict_type=SHARDED_STATE_DICT"]
    subprocesses.run(cmd, check=True, env=env(), stdout=subprocess.DEVNULL)
    return ckpt


def largest_tensor_bytes(ckpt: Path) -> tuple[int, int]:
    from hfsdp.checkpoint.safe_load import read_dcp_metadata

    meta = read_dcp_metadata(ckpt / "pytorch_model_fsdp_0").state_dict_metadata
    sizes = [m.size.numel() * m.properties.dtype.itemsize for k, m in meta.items() if k.startswith("model.")]
    return max(sizes), sum(sizes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("export-memory"))
    p.add_argument("--models", default="bench,135m,360m")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hfsdp")
    p.add_argument("--gguf", default=None, metavar="QUANT",
                   help="export with --format gguf --quant QUANT (the Hugging Face folder and a GGUF file from it)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    models = {"bench": "smollm2-bench", "135m": "smollm2-135m-instruct",
              "360m": lambda: random_model(a.out / "random-360m", a.cache)}
    baseline, _ = peak_rss_of([PY, "-c", "import torch"])
    hfsdp = str(Path(PY).parent / "hfsdp")
    accelerate = str(Path(PY).parent / "accelerate")
    rows = []
    for name in a.models.split(","):
        model = models[name]() if callable(models[name]) else models[name]
        ckpt = sharded_checkpoint(a.out, name, model)
        largest, total = largest_tensor_bytes(ckpt)
        ours_out, theirs_out = a.out / f"hfsdp-{name}", a.out / f"merge-{name}"
        shutil.rmtree(ours_out, ignore_errors=True), shutil.rmtree(theirs_out, ignore_errors=True)
        ours, ours_s = peak_rss_of([hfsdp, "export", str(ckpt), str(ours_out),
                                    *(["--format", "gguf", "--quant", a.gguf] if a.gguf else [])])
        theirs, theirs_s = peak_rss_of([accelerate, "merge-weights", str(ckpt / "pytorch_model_fsdp_0"),
                                        str(theirs_out)])
        bound = DEFAULT_MAX_SHARD_BYTES + 2 * largest
        rows.append({"model": name, "weights_mib": total / MIB, "largest_tensor_mib": largest / MIB,
                     "baseline_mib": baseline / MIB, "hfsdp_peak_mib": ours / MIB,
                     "hfsdp_above_baseline_mib": (ours - baseline) / MIB, "bound_mib": bound / MIB,
                     "within_bound": ours - baseline <= bound, "merge_weights_peak_mib": theirs / MIB,
                     "merge_weights_above_baseline_mib": (theirs - baseline) / MIB, "ratio": ours / theirs,
                     "hfsdp_s": ours_s, "merge_weights_s": theirs_s})
    (a.out / "export_memory.json").write_text(json.dumps(rows, indent=2))
    print(f"interpreter baseline (python -c 'import torch'): {baseline / MIB:.0f} MiB; "
          f"--max-shard-size default {DEFAULT_MAX_SHARD_BYTES / MIB:.0f} MiB\n")
    print("| model | weights MiB | largest tensor MiB | hfsdp export peak MiB (above baseline) | bound MiB | "
          "merge-weights peak MiB (above baseline) | hfsdp ÷ merge-weights | export s | merge s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['weights_mib']:.0f} | {r['largest_tensor_mib']:.0f} | {r['hfsdp_peak_mib']:.0f} "
              f"({r['hfsdp_above_baseline_mib']:.0f}) | {r['bound_mib']:.0f} | {r['merge_weights_peak_mib']:.0f} "
              f"({r['merge_weights_above_baseline_mib']:.0f}) | {r['ratio']:.2f} | {r['hfsdp_s']:.1f} | "
              f"{r['merge_weights_s']:.1f} |")


if __name__ == "__main__":
    main()
