"""Checkpoint stalls, side by side in one invocation: the same 2-rank FSDP2 run (gloo, torchrun) of the bench preset
(``smollm2-bench``, ~75M parameters, fp32: a checkpoint of about 0.9 GB) without saves, with synchronous saves and
with ``train.async_save`` (DCP's thread executor), saving every ``--save-every`` steps.

    python benchmarks/async_save.py [--out bench-results/async-save] [--steps 24] [--save-every 4]

Prints, from each run's ``metrics.jsonl`` (``save_stall_s``, ``save_write_s``) and ``summary.json``
(``train_loop_s``: the training loop, from the first step until the last checkpoint is complete):

* the stall per save (the training loop blocked, median) of the async run / the synchronous save time (median);
* each run's loop time / the loop time of the run without saves.

Runs are sequential; the numbers are only as steady as the machine (run it on an idle one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "hfsdp" / "config" / "presets" / "bench.yaml"


def run(out: Path, name: str, steps: int, save_every: int | None, asynchronous: bool) -> dict:
    folder = out / name
    sets = [f"train.output_dir={folder}", f"train.max_steps={steps}", "train.keep_last=2",
            f"train.save_every={save_every if save_every else 'null'}", f"train.async_save={str(asynchronous).lower()}",
            f"data.path={REPO / 'hfsdp' / 'config' / 'presets' / 'data' / 'contacts_train.jsonl'}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           "--master-port=29611", "-m", "hfsdp", "train", str(PRESET), "--overwrite",
           *[arg for s in sets for arg in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocesses.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if "save_stall_s" in r]
    return {"name": name, "loop_s": summary["train_loop_s"], "process_s": time.perf_counter() - t0,
            "stall_s": [r["save_stall_s"] for r in saves], "write_s": [r["save_write_s"] for r in saves],
            "step_s": statistics.median(r["step_time_s"] for r in records if "step_time_s" in r)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench-results/async-save")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=4)
    a = p.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    none = run(out, "no-saves", a.steps, None, False)
    sync = run(out, "sync", a.steps, a.save_every, False)
    background = run(out, "async", a.steps, a.save_every, True)

    print(f"2 gloo ranks, FSDP2 FULL_SHARD, smollm2-bench fp32, {a.steps} steps, a save every {a.save_every}")
    for r in (none, sync, background):
        saves = (f"{len(r['stall_s'])} saves: stall median {statistics.median(r['stall_s']):.3f} s "
                 f"({', '.join(f'{v:.2f}' for v in r['stall_s'])}), complete after median "
                 f"{statistics.median(r['write_s']):.3f} s" if r["stall_s"] else "no saves")
        print(f"  {r['name']:>8}: loop {r['loop_s']:.1f} s (step median {r['step_s']:.3f} s); {saves}")
    sync_save = statistics.median(sync["write_s"])
    stall = statistics.median(background["stall_s"])
    print(f"stall per save (async) / synchronous save time: {stall:.3f} / {sync_save:.3f} = {stall / sync_save:.3f} "
          "(target <= 0.2)")
    print(f"loop time with async saves / without saves: {background['loop_s']:.1f} / {none['loop_s']:.1f} = "
          f"{background['loop_s'] / none['loop_s']:.3f} (target <= 1.05)")
    print(f"loop time with synchronous saves / without saves: {sync['loop_s']:.1f} / {none['loop_s']:.1f} = "
          f"{sync['loop_s'] / none['loop_s']:.3f}")


if __name__ == "__main__":
    main()
