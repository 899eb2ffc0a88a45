"""What each objective's own collectives cost a training step on N ranks, next to the step (issue 56, part 2).

    python benchmarks/objective_reductions.py [--nproc 2] [--steps 6] [--objectives sft,dpo,kto,grpo,distill,reward_model]

Every objective's step shares one reduction with SFT's (the global batch's counts, the gradient norm's squares with the
loss and the metric sums, the end-of-step flags: ``tests/test_collectives.py``). Whatever an objective adds beyond it
(KTO's KL estimate per micro-step, GRPO's gathers of completions and rewards and sampling's lock-step, the reward
model's extreme rewards) is timed by the test plugin ``tests/fault_plugin/hfsdp_collectives.py`` (the wall time of
each call: gloo's are synchronous, so a call's time includes waiting for the slower rank). Each objective trains the
bench model (``smollm2-bench``, 12 layers, ~75M parameters) on the bundled rows of its format, FSDP2 FULL_SHARD, on
``--nproc`` torchrun ranks; the table gives, per objective, the median step time (steps after the first), the
median time of its own collectives (the slowest rank's), and ``ideal share`` = (step - own) / step: how close the
step is to its single-reduction ideal (1.0: nothing of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "hfsdp" / "config" / "presets" / "data"
# The collectives of the single reduction every objective's step shares (tests/test_collectives.py's STEP).
SHARED = ("run.step:train_step", "checkpoint.store:poll")
PAIRS = {"format": "preference", "path": str(DATA / "contacts_pref_train.jsonl")}
OBJECTIVES = {
    "sft": ([], {"format": "chat", "path": str(DATA / "contacts_train.jsonl")}, {}),
    "dpo": (["dpo"], PAIRS, {}),
    "kto": (["kto"], {"format": "unpaired", "path": str(DATA / "contacts_unpaired_train.jsonl")}, {}),
    "reward_model": (["reward_model"], PAIRS, {}),
    "distill": (["distill"], {"format": "chat", "path": str(DATA / "contacts_train.jsonl")},
                {"distill": {"teacher": "smollm2-bench", "loss": "jsd"}}),
    "grpo": (["grpo"], {"format": "prompt", "path": str(DATA / "contacts_prompts_train.jsonl")},
             {"grpo": {"num_generations": 2, "max_new_tokens": 16, "rewards": [{"name": "grpo_test_rewards:letters"}]}}),
}


def run(objective: str, nproc: int, steps: int, work: Path) -> dict:
    import yaml

    from hfsdp.parallel.launcher import free_port

    plugins, data, extra = OBJECTIVES[objective]
    config = {"base": "bench", "plugins": [*plugins, "hfsdp_collectives"],
              "data": {**data, "max_seq_len": 96, "eval_path": None},
              "train": {"output_dir": str(work / "run"), "max_steps": steps, "per_device_batch_size": 2,
                        "log_every": 1}, **extra}
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))},
           "PYTHONPATH": f"{REPO / 'tests' / 'fault_plugin'}:{REPO / 'tests' / 'reward_plugin'}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "hfsdp", "train", str(work / "config.yaml"), "--overwrite"]
    proc = subprocesses.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{objective} failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    out = work / "run"
    times = {m["step"]: m["step_time_s"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "step_time_s" in m}
    own: dict[int, float] = {}
    for rank in range(nproc):
        for line in (out / f"collectives_rank{rank}.jsonl").read_text().splitlines():
            step = json.loads(line)
            spent = sum(s for k, s in step.get("hfsdp_s", {}).items() if not k.startswith(SHARED))
            own[step["step"]] = max(own.get(step["step"], 0.0), spent)
    steady = [s for s in sorted(times) if s > 1]
    step_s = statistics.median(times[s] for s in steady)
    own_s = statistics.median(own.get(s, 0.0) for s in steady)
    kinds = sorted({k for line in (out / "collectives_rank0.jsonl").read_text().splitlines()
                    for k in json.loads(line)["hfsdp"] if not k.startswith(SHARED)})
    return {"step_s": step_s, "own_s": own_s, "ideal_share": (step_s - own_s) / step_s, "own": kinds,
            "command": " ".join(cmd)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--objectives", default=",".join(OBJECTIVES))
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.objectives.split(","):
            work = Path(tmp) / name
            work.mkdir()
            results[name] = run(name, a.nproc, a.steps, work)
            r = results[name]
            print(f"{name:13} step {r['step_s']:.3f} s  own collectives {r['own_s'] * 1e3:7.2f} ms  "
                  f"ideal share {r['ideal_share']:.4f}  ({', '.join(r['own']) or 'none of its own'})", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
