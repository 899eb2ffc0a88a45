"""GRPO's sampling and step time by world size, side by side in one run (issue 50).

The ``grpo`` preset (the real SmolLM2-135M-Instruct) with the same global batch on every line (8 prompts x 4
completions a step: 4 micro-batches of accumulation on one process, 4 / N on N ranks), no eval and no export,
trained ``--steps`` steps: one process with one thread (the per-core reference: here a rank has one core), one
process with two threads, and N gloo ranks (FSDP2 FULL_SHARD, one thread each) for each N of ``--ranks``. Prints
each run's median ``generation_s`` (sampling, scoring and the kept log-probs of a round) and ``step_time_s`` and
their ratio to the one-thread process's, and checks that every run sampled the same completions
(``completions.jsonl``: token ids, rewards, advantages) and trained the same steps (loss, reward, grad norm within
1e-5 relative) as the one-thread process.

    python benchmarks/grpo_scaling.py --steps 5 --ranks 2,4 --out grpo_scaling [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import subprocesses

GLOBAL_MICRO_BATCHES = 4  # of the preset's 8 completions (2 prompts): 8 prompts x 4 completions a step
COMMON = ["train.eval_at_start=false", "data.eval_path=null", "train.export_final=false", "grpo.log_completions=1000"]


def train(name: str, out: Path, ranks: int, threads: int, steps: int, overrides: list[str]) -> dict:
    folder = out / name
    sets = [*COMMON, f"train.max_steps={steps}", f"train.output_dir={folder}",
            f"train.gradient_accumulation_steps={GLOBAL_MICRO_BATCHES // ranks}", *overrides]
    launcher = ([sys.executable, "-m", "hfsdp"] if ranks == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "hfsdp"])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocesses.run([*launcher, "train", "grpo", "--overwrite", *[a for s in sets for a in ("--set", s)]],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    steps_ = [m for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    return {"name": name, "steps": steps_, "completions": (folder / "completions.jsonl").read_text().splitlines(),
            "generation_s": statistics.median(m["generation_s"] for m in steps_),
            "step_time_s": statistics.median(m["step_time_s"] for m in steps_)}


def same_training(run: dict, reference: dict) -> str:
    if run["completions"] != reference["completions"]:
        return "DIFFERENT completions"
    worst = 0.0
    for a, b in zip(run["steps"], reference["steps"]):
        for key in ("loss", "reward", "grad_norm"):
            worst = max(worst, abs(a[key] - b[key]) / max(abs(b[key]), 1e-7))
    return f"same completions, steps within {worst:.1e}" + ("" if worst <= 1e-5 else " (OVER 1e-5)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", default="2,4", help="world sizes beside the one process (divisors of 4)")
    parser.add_argument("--out", type=Path, default=Path("grpo_scaling"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    plan = [("1 process, 1 thread", 1, 1), ("1 process, 2 threads", 1, 2)]
    plan += [(f"{n} ranks, FSDP2, 1 thread each", n, 1) for n in map(int, args.ranks.split(","))]
    runs = [train(f"run{i}", args.out, ranks, threads, args.steps, args.overrides)
            for i, (_, ranks, threads) in enumerate(plan)]
    reference = runs[0]
    print(f"grpo preset, {args.steps} steps, 8 prompts x 4 completions a step; medians over the steps")
    print("| run | median generation_s | / 1 process, 1 thread | median step_time_s | / 1 process, 1 thread | "
          "against 1 process, 1 thread |")
    print("|---|---|---|---|---|---|")
    for (label, *_), run in zip(plan, runs):
        check = "reference" if run is reference else same_training(run, reference)
        print(f"| {label} | {run['generation_s']:.2f} | {run['generation_s'] / reference['generation_s']:.2f} | "
              f"{run['step_time_s']:.2f} | {run['step_time_s'] / reference['step_time_s']:.2f} | {check} |")
    if any(not math.isfinite(m["loss"]) for run in runs for m in run["steps"]):
        sys.exit("a loss was not finite")


if __name__ == "__main__":
    main()
