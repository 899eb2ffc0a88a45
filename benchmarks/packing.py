"""Packed micro-batches against unpacked ones, side by side in one run (issue 51).

    python benchmarks/packing.py [--steps 12] [--rounds 2] [--cases dpo,grpo] [--json out.json]

Each case trains the same preset on the same rows twice per round, unpacked then with ``plugins: [..., packing]``
(its micro-batches' sequences laid end to end), alternating so that the machine's drift falls on both alike. A run's
speed is its real tokens (not padding) per second of training, over the steps after the first two:
``sum(tokens) / sum(step_time_s - generation_s)`` (GRPO's sampling, which packing does not touch, left out; the
whole step is printed beside it). The padding share is the unpacked runs' own (metric ``padding``: the share of the
input positions that were padding, on the same rows). The issue's target: packed ÷ unpacked >= 0.9 / (1 - padding).

Cases: ``dpo``, the dpo preset (SmolLM2-135M-Instruct, the bundled pairs, full fine-tuning, reference log-probs
precomputed once into a shared cache before the timed steps); ``grpo``, the grpo preset with completions of mixed
lengths (temperature 1.2 and 96 new tokens: some stop at EOS after a line of JSON, some ramble to the limit; the
reward is the completion's length, tests/reward_plugin's ``characters``, so that no group is without signal;
``num_iterations`` 4 so that most steps train on a round's completions without sampling).
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
CASES = {
    "dpo": {"base": "dpo", "plugins": ["dpo"], "train": {"eval_every": None, "eval_at_start": False}},
    "grpo": {"base": "grpo", "plugins": ["grpo"], "data": {"eval_path": None},
             "grpo": {"temperature": 1.2, "max_new_tokens": 96, "num_iterations": 4,
                      "rewards": [{"name": "grpo_test_rewards:characters"}]},
             "train": {"eval_every": None, "eval_at_start": False}},
}


def run(case: str, packed: bool, steps: int, work: Path, cache: Path) -> dict:
    import yaml

    config = json.loads(json.dumps(CASES[case]))
    if packed:
        config["plugins"] = [*config["plugins"], "packing"]
    config["train"] = {**config["train"], "output_dir": str(work / "run"), "max_steps": steps, "log_every": 1}
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))},
           "HFSDP_CACHE_DIR": str(cache), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO / "tests" / "reward_plugin")}
    cmd = [sys.executable, "-m", "hfsdp", "train", str(work / "config.yaml"), "--overwrite"]
    proc = subprocesses.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{case} failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    steady = [m for m in map(json.loads, (work / "run" / "metrics.jsonl").read_text().splitlines())
              if "step_time_s" in m and m["step"] > 2]
    tokens = sum(m["tokens"] for m in steady)
    positions = sum(m["tokens"] / (1 - m["padding"]) for m in steady)
    train_s = sum(m["step_time_s"] - m.get("generation_s", 0.0) for m in steady)
    said = next((line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("packing:")), "")
    return {"tokens_per_s": tokens / train_s, "step_tokens_per_s": tokens / sum(m["step_time_s"] for m in steady),
            "padding": 1 - tokens / positions, "said": said, "command": " ".join(cmd)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(os.environ.get("HFSDP_CACHE_DIR", Path.home() / ".cache" / "hfsdp"))
        for case in a.cases.split(","):
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for r in range(a.rounds):
                for packed in (False, True):
                    work = Path(tmp) / f"{case}-{r}-{packed}"
                    work.mkdir()
                    runs[packed].append(run(case, packed, a.steps, work, cache))
            speed = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
            whole = {k: statistics.median(x["step_tokens_per_s"] for x in v) for k, v in runs.items()}
            padding = statistics.mean(x["padding"] for x in runs[False])
            ratio, target = speed[True] / speed[False], 0.9 / (1 - padding)
            results[case] = {"unpacked_tokens_per_s": speed[False], "packed_tokens_per_s": speed[True],
                             "ratio": ratio, "padding_unpacked": padding,
                             "padding_packed": statistics.mean(x["padding"] for x in runs[True]),
                             "target": target, "whole_step_ratio": whole[True] / whole[False],
                             "said": runs[True][0]["said"]}
            print(f"{case:5} padding {padding:.1%} -> {results[case]['padding_packed']:.1%}  real tokens/s "
                  f"{speed[False]:.0f} -> {speed[True]:.0f}  packed / unpacked {ratio:.3f} (target >= "
                  f"{target:.3f}: {'met' if ratio >= target else 'NOT met'}; whole steps {whole[True] / whole[False]:.3f})",
                  flush=True)
            print(f"      {results[case]['said']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
