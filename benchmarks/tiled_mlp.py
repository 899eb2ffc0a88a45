"""The tiled MLP's peak memory on a long row, measured side by side on one process; writes DIR/tiled_mlp.md and .json.

    python benchmarks/tiled_mlp.py [--out DIR] [--model smollm2-bench] [--seq-len 16384] [--tile 1024] [--steps 1]

Two real one-process runs (`python -m hfsdp train`, float32, FSDP2 on one process as train runs it) train the same
steps on rows of `--seq-len` tokens (the bundled ShareGPT chats laid end to end as plain text), without
`train.tiled_mlp` and with tiles of `--tile` positions. The measure is bench_probe's peak resident memory during the
steps above the memory after the model was prepared (`mem_peak_steps - mem_after_prepare`, sampled by its thread and
at each step's end): what a long row's step adds, the MLP's intermediates among it. Beside it: the loss (the tiles
give the untiled values) and the fastest step (the tiles run the MLP's forward once more). The issue's target (73):
a 16k-token row at a lower peak with the tiles than without.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import subprocesses
from sequence_parallel import long_text


def config(out: Path, data: Path, model: str, seq_len: int, tile: int | None, steps: int) -> Path:
    import yaml

    folder = out / (f"tile{tile}" if tile else "untiled")
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model": {"name_or_path": model},
           "data": {"format": "text", "path": str(data), "max_seq_len": seq_len},
           "train": {"output_dir": str(folder / "run"), "max_steps": steps, "per_device_batch_size": 1,
                     "report_to": "none", "loss_plot": False, "eval_at_start": False, "log_every": 1,
                     "tiled_mlp": tile},
           "plugins": ["bench_probe"]}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("tiled-mlp"))
    p.add_argument("--model", default="smollm2-bench")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    data = long_text(a.out / "long_text.jsonl", rows=a.steps, chars=6 * a.seq_len)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for tile in (None, a.tile):
        cfg = config(a.out, data, a.model, a.seq_len, tile, a.steps)
        proc = subprocesses.run([sys.executable, "-m", "hfsdp", "train", str(cfg), "--overwrite"], env=env,
                                capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"tile {tile}: the run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        run = cfg.parent / "run"
        probe = json.loads((run / "bench_rank0.json").read_text())
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in steps if "loss" in m]
        results.append({"tile": tile, "tokens": max(m["tokens"] for m in steps), "loss": steps[-1]["loss"],
                        "peak_above_start": probe["mem_peak_steps"] - probe["mem_after_prepare"],
                        "step_s": min(probe["step_times_s"])})
    plain = results[0]
    lines = [f"`{a.model}`, one row of {a.seq_len} tokens a step, one process, float32; "
             f"`python benchmarks/tiled_mlp.py --model {a.model} --seq-len {a.seq_len} --tile {a.tile}`", "",
             "| train.tiled_mlp | tokens a step | peak above the prepared model | ÷ untiled | loss | fastest step s |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['tile'] or 'off'} | {r['tokens']} | {r['peak_above_start'] / 2**20:.1f} MiB | "
                     f"{r['peak_above_start'] / plain['peak_above_start']:.3f} | {r['loss']:.6f} | "
                     f"{r['step_s']:.1f} |")
    text = "\n".join(lines)
    (a.out / "tiled_mlp.md").write_text(text + "\n")
    (a.out / "tiled_mlp.json").write_text(json.dumps(results, indent=2))
    print(text)


if __name__ == "__main__":
    main()
