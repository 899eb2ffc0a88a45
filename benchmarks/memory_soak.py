"""Memory that creeps: a long 2-rank FSDP2 run (gloo, torchrun) of the tiny preset with checkpoints and evals, and
every rank's resident memory (RSS) after every step (the plugin ``benchmarks/soak_rss.py``).

    python benchmarks/memory_soak.py [--steps 1500] [--save-every 250] [--eval-every 500] [--check-step 300]
                                     [--out bench-results/memory-soak]
    python benchmarks/memory_soak.py --objective grpo --steps 300 --save-every 50 --eval-every 100 \
                                     --check-step 120 --baseline 60 --out bench-results/grpo-soak

``--objective grpo``: GRPO with LoRA on the bundled prompts (the tiny model, 4 completions of 16 tokens per prompt,
the json_fields reward, a round of 2 iterations), so that sampling, the round buffer and the reward run 300 times.

Passes when, on every rank, the last step's RSS is at most ``--ratio`` (1.05) x the RSS at ``--check-step`` (after
the allocator, the caches and the first checkpoint have settled), and, with ``--baseline B``, the highest RSS of the
last fifth of the steps is at most ``--ratio`` x the highest of steps B to ``--check-step``; prints the RSS at the
check step, at every checkpoint and eval step, and at the last step, per rank, and exits 1 when a rank crept or a
checkpoint is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "hfsdp" / "config" / "presets" / "tiny.yaml"
MIB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results/memory-soak")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--check-step", type=int, default=300)
    p.add_argument("--ratio", type=float, default=1.05)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--window", type=int, default=50, help="steps of the medians also printed")
    p.add_argument("--objective", choices=("sft", "grpo"), default="sft")
    p.add_argument("--baseline", type=int, help="first step of the window whose peak the last fifth's peak is held to")
    p.add_argument("--report-only", action="store_true", help="read the run already in --out, do not train")
    a = p.parse_args()
    if a.check_step >= a.steps:
        raise SystemExit("--check-step must be before the last step")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run"
    data = REPO / "hfsdp" / "config" / "presets" / "data"
    sets = [f"train.output_dir={run}", f"train.max_steps={a.steps}", f"train.save_every={a.save_every}",
            f"train.eval_every={a.eval_every}", "train.log_every=50", "plugins=[soak_rss]",
            f"data.path={data / 'contacts_train.jsonl'}", f"data.eval_path={data / 'contacts_eval.jsonl'}"]
    if a.objective == "grpo":
        sets = [*sets[:5], "plugins=[soak_rss,lora,grpo]", "data.format=prompt", "data.max_eval_samples=8",
                f"data.path={data / 'contacts_prompts_train.jsonl'}",
                f"data.eval_path={data / 'contacts_prompts_eval.jsonl'}", "train.learning_rate=1.0e-3",
                "grpo.num_generations=4", "grpo.max_new_tokens=16", "grpo.num_iterations=2",
                "grpo.rewards=[{name: json_fields}]"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.nproc}", "--master-addr=127.0.0.1",
           "--master-port=29631", "-m", "hfsdp", "train", str(PRESET), "--overwrite",
           *[arg for s in sets for arg in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]))}
    if not a.report_only:
        proc = subprocesses.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    complete = [c.name for c in checkpoints if (c / "hfsdp_checkpoint.json").is_file()]
    print(f"checkpoints complete: {', '.join(complete) or 'none'}")
    sys.exit(1 if report(run, a) or len(complete) != len(checkpoints) or not complete else 0)


def report(run: Path, a) -> bool:
    """Print each rank's figures; True when a rank crept (the last step above ``ratio`` x the check step)."""
    import statistics

    print(f"{a.nproc} gloo ranks, FSDP2 FULL_SHARD, tiny preset ({a.objective}), {a.steps} steps, a checkpoint every "
          f"{a.save_every}, an eval every {a.eval_every}; RSS in MiB after the step")
    crept = False
    for rank in range(a.nproc):
        rss = {r["step"]: r["rss"] for r in map(json.loads, (run / f"rss_rank{rank}.jsonl").read_text().splitlines())}
        marks = sorted({a.check_step, *range(a.save_every, a.steps + 1, a.save_every),
                        *range(a.eval_every, a.steps + 1, a.eval_every), a.steps} & set(rss))
        ratio = rss[a.steps] / rss[a.check_step]
        crept |= ratio > a.ratio
        print(f"  rank {rank}: " + ", ".join(f"step {s} {rss[s] / MIB:.1f}" for s in marks))
        print(f"  rank {rank}: last / step {a.check_step} = {rss[a.steps] / MIB:.1f} / {rss[a.check_step] / MIB:.1f} "
              f"= {ratio:.4f} ({'above' if ratio > a.ratio else 'within'} {a.ratio}); peak "
              f"{max(rss.values()) / MIB:.1f} at step {max(rss, key=rss.get)}")
        w = a.window  # the RSS after a step moves by a few percent from step to step: medians of windows too
        early = statistics.median(rss[s] for s in range(a.check_step - w + 1, a.check_step + 1))
        late = statistics.median(rss[s] for s in range(a.steps - w + 1, a.steps + 1))
        print(f"  rank {rank}: median of the {w} steps up to the last / up to step {a.check_step} = "
              f"{late / MIB:.1f} / {early / MIB:.1f} = {late / early:.4f}")
        if a.baseline is not None:
            tail = max(rss[s] for s in rss if s > a.steps - a.steps // 5)
            base = max(rss[s] for s in range(a.baseline, a.check_step + 1))
            crept |= tail / base > a.ratio
            print(f"  rank {rank}: highest of the last fifth / highest of steps {a.baseline}-{a.check_step} = "
                  f"{tail / MIB:.1f} / {base / MIB:.1f} = {tail / base:.4f} "
                  f"({'above' if tail / base > a.ratio else 'within'} {a.ratio})")
    return crept


if __name__ == "__main__":
    main()
