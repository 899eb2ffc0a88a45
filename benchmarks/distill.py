"""Distillation against SFT alone at equal steps (issue 36, part 4): the ``distill`` preset (the real
SmolLM2-135M-Instruct, frozen, teaching the shrunk 2-layer SmolLM2 on the bundled contact chats) and the same run
without the plugin (the same student, data, seed, steps and hyper-parameters: plain next-token cross entropy).
Both report the student's held-out cross entropy on the eval split at each eval (distill: ``eval_distill/ce``, the
token cross entropy alone, not the mixed loss it trains on; SFT: ``eval_loss``). Prints both curves, the final
difference and the step times (median).

    python benchmarks/distill.py --steps 60 [--set KEY=VALUE ...]

One process (set the same ``--set`` for both runs); the teacher is a built-in model, built into the cache on first use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

PRESET = Path(__file__).resolve().parents[1] / "hfsdp" / "config" / "presets" / "distill.yaml"


def configs(folder: Path) -> tuple[Path, Path]:
    """(distill, sft) configs: the preset with absolute data paths, and the same without the plugin."""
    config = yaml.safe_load(PRESET.read_text())
    for key in ("path", "eval_path"):
        config["data"][key] = str(PRESET.parent / config["data"][key])
    sft = {k: v for k, v in config.items() if k not in ("plugins", "distill")}
    paths = folder / "distill.yaml", folder / "sft.yaml"
    for path, value in zip(paths, (config, sft)):
        path.write_text(yaml.safe_dump(value, sort_keys=False))
    return paths


def train(config: Path, out: Path, steps: int, overrides: list[str]) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "hfsdp", "train", str(config), "--overwrite", "--set", f"train.output_dir={out}",
           "--set", f"train.max_steps={steps}", "--set", f"train.eval_every={max(steps // 4, 1)}",
           "--set", "train.eval_at_start=true", *[a for o in overrides for a in ("--set", o)]]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        distill_config, sft_config = configs(folder)
        sft, sft_s = train(sft_config, folder / "sft", args.steps, args.overrides)
        distill, distill_s = train(distill_config, folder / "distill", args.steps, args.overrides)
    curves = {"sft": {m["step"]: m["eval_loss"] for m in sft if "eval_loss" in m},
              "distill": {m["step"]: m["eval_distill/ce"] for m in distill if "eval_distill/ce" in m}}
    step_s = {name: statistics.median(m["step_time_s"] for m in rows if "step_time_s" in m) if any(
        "step_time_s" in m for m in rows) else None for name, rows in (("sft", sft), ("distill", distill))}
    print("\nheld-out cross entropy of the student (eval split, per labelled token)")
    print(f"{'step':>6} {'sft':>10} {'distill':>10}")
    for step in sorted(curves["sft"]):
        print(f"{step:>6} {curves['sft'][step]:>10.4f} {curves['distill'].get(step, float('nan')):>10.4f}")
    last = max(curves["sft"])
    print(json.dumps({"steps": args.steps, "final_sft": curves["sft"][last], "final_distill": curves["distill"][last],
                      "distill_minus_sft": curves["distill"][last] - curves["sft"][last],
                      "median_step_s": step_s, "wall_s": {"sft": round(sft_s, 1), "distill": round(distill_s, 1)}}))


if __name__ == "__main__":
    main()
