"""The cost curves (issue 56, part 3): tokens/s and peak memory per rank as the work grows, beside `hfsdp plan`.

Runs ``hfsdp bench --seq-lens ... --micro-batches ...`` (every point a real job, gloo on CPU, NCCL on GPUs) on
rows long enough to fill every sequence (generated plain text, every position labelled, so that the plan's
assumption of full, fully labelled rows holds), writes its bench.md/.csv/.json/.png into ``--out``, and prints
each point's plan ÷ measured peak with the largest deviation against the target (within 10 %).

    python benchmarks/bench_sweep.py --out sweep [--model smollm2-bench] [--nproc 2] [--strategies FULL_SHARD]
        [--seq-lens 128,256,512] [--micro-batches 1,2,4] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import subprocesses

from plan_accuracy import long_text_data  # benchmarks/, next to this file

TARGET = 0.10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("sweep"))
    parser.add_argument("--model", default="smollm2-bench")
    parser.add_argument("--nproc", default="2")
    parser.add_argument("--strategies", default="FULL_SHARD")
    parser.add_argument("--seq-lens", default="128,256,512")
    parser.add_argument("--micro-batches", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    longest = max(int(s) for s in args.seq_lens.split(","))
    data = long_text_data(args.out / "long_text.jsonl", rows=64, words=2 * longest)
    cmd = [sys.executable, "-m", "hfsdp", "bench", "--nproc", args.nproc, "--strategies", args.strategies,
           "--seq-lens", args.seq_lens, "--micro-batches", args.micro_batches, "--steps", str(args.steps),
           "--warmup", "1", "--out", str(args.out),
           "--set", f"model.name_or_path={args.model}", "--set", "data.format=text", "--set", f"data.path={data}"]
    print(" ".join(cmd), flush=True)
    subprocesses.run(cmd, check=True)
    rows = json.loads((args.out / "bench.json").read_text())["rows"]
    worst = max(abs(r["plan_vs_measured"] - 1) for r in rows)
    print(f"plan ÷ measured peak per rank over {len(rows)} points: "
          f"{min(r['plan_vs_measured'] for r in rows):.3f}-{max(r['plan_vs_measured'] for r in rows):.3f}, "
          f"largest deviation {worst:.1%} (target within {TARGET:.0%}): {'MET' if worst <= TARGET else 'NOT MET'}")


if __name__ == "__main__":
    main()
