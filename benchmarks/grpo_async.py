"""Rollouts that never wait (issue 70): the ``grpo`` preset (the real SmolLM2-135M-Instruct) sampled inline on 2 ranks
against 1 training rank beside 1 generation process (``grpo.generation.engine: workers``, ``max_staleness`` 1), side
by side in one run, each process one thread (2 cores: the same machine for both).

For each seed of ``--seeds``: both runs train ``--steps`` steps with the same global batch (8 prompts x 4
completions a step); prints each run's median ``step_time_s`` and its ratio to inline's, the median seconds the
trainer waited for a round and a weight sync took (``generation/wait_s``, ``generation/sync_s``), and the held-out
reward after the last step (``eval_reward`` of the preset's 16 eval prompts) with its mean and spread over the seeds;
also that the workers run's rounds are the same whatever the seed's timing (its completions are a function of the
config: ``--check-repeat`` runs it twice and compares ``completions.jsonl``).

    python benchmarks/grpo_async.py --steps 10 --seeds 42,43,44 --out grpo_async [--set KEY=VALUE ...]
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
COMMON = ["train.eval_at_start=false", "train.export_final=false", "grpo.log_completions=1000"]
RUNS = {"inline, 2 ranks": (2, []),
        "workers, 1 rank + 1 generation process, max_staleness 1": (1, ["grpo.generation.engine=workers",
                                                                        "grpo.generation.max_staleness=1"])}


def train(folder: Path, ranks: int, seed: int, steps: int, overrides: list[str]) -> dict:
    sets = [*COMMON, f"train.max_steps={steps}", f"train.eval_every={steps}", f"train.seed={seed}",
            f"train.output_dir={folder}", f"train.gradient_accumulation_steps={GLOBAL_MICRO_BATCHES // ranks}",
            *overrides]
    launcher = ([sys.executable, "-m", "hfsdp"] if ranks == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "hfsdp"])
    proc = subprocesses.run([*launcher, "train", "grpo", "--overwrite", *[a for s in sets for a in ("--set", s)]],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{folder.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss" in m]
    evals = [m["eval_reward"] for m in metrics if "eval_reward" in m]

    def median(key: str) -> float:
        return statistics.median(m[key] for m in trained) if key in trained[0] else math.nan

    return {"step_time_s": median("step_time_s"), "wait_s": median("generation/wait_s"),
            "sync_s": median("generation/sync_s"), "eval_reward": evals[-1],
            "completions": (folder / "completions.jsonl").read_text().splitlines(),
            "finite": all(math.isfinite(m["loss"]) for m in trained)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", default="42,43,44", help="comma-separated train.seed values")
    parser.add_argument("--out", type=Path, default=Path("grpo_async"))
    parser.add_argument("--check-repeat", action="store_true", help="run the workers run of the first seed again "
                                                                    "and compare its completions")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {label: [train(args.out / f"{i}-seed{seed}", ranks, seed, args.steps, [*sets, *args.overrides])
                       for seed in seeds] for i, (label, (ranks, sets)) in enumerate(RUNS.items())}
    inline = results["inline, 2 ranks"]
    print(f"grpo preset, {args.steps} steps, 8 prompts x 4 completions a step, seeds {args.seeds}; medians over the "
          "steps, one thread a process")
    print("| run | median step_time_s (per seed) | / inline | median wait_s | median sync_s | eval_reward per seed | "
          "mean +- std |")
    print("|---|---|---|---|---|---|---|")
    for label, runs in results.items():
        ratio = statistics.median(r["step_time_s"] / i["step_time_s"] for r, i in zip(runs, inline))
        rewards = [r["eval_reward"] for r in runs]
        spread = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
        times = ", ".join(f"{r['step_time_s']:.2f}" for r in runs)
        print(f"| {label} | {times} | {ratio:.2f} | "
              f"{statistics.median(r['wait_s'] for r in runs):.2f} | {statistics.median(r['sync_s'] for r in runs):.3f} "
              f"| {', '.join(f'{x:.4f}' for x in rewards)} | {statistics.mean(rewards):.4f} +- {spread:.4f} |")
    if args.check_repeat:
        label, (ranks, sets) = list(RUNS.items())[1]
        again = train(args.out / "repeat", ranks, seeds[0], args.steps, [*sets, *args.overrides])
        same = again["completions"] == results[label][0]["completions"]
        print(f"workers run repeated (seed {seeds[0]}): {'the same' if same else 'DIFFERENT'} completions")
        if not same:
            sys.exit(1)
    if not all(r["finite"] for runs in results.values() for r in runs):
        sys.exit("a loss was not finite")


if __name__ == "__main__":
    main()
