"""On-policy against off-policy distillation in the same wall time (issue 52): does the student that samples its own
completions (``distill_online``) reach a better held-out task score than the one trained on the data's completions
(``distill``), given the same seconds on this machine?

1. The teacher: the real SmolLM2-135M-Instruct fine-tuned on the contact task (``hfsdp train default``,
   ``--teacher-steps`` steps), as a user would distill from a teacher that knows the task.
2. The student's warm start: the shrunk 2-layer SmolLM2 (random weights) distilled off-policy from that teacher for
   ``--warm-steps`` steps (the ``distill`` preset), since on-policy distillation is run after a first stage, not on
   a random model's samples.
3. From that student, each way for ``--seconds`` of training: off-policy (the ``distill`` preset: the contact chats'
   own answers, forward KL with the token loss) and on-policy (the ``distill-online`` preset: the student's samples
   of the contact prompts, reverse KL, ``--lmbda``). Each way's steps are its probe's median step time into the
   budget (a 3-step probe run first; with ``--lmbda`` between 0 and 1, a probe of each kind of round, weighed by
   it), so both train about as long.
4. Both final students answer the 16 held-out contact prompts (greedy, up to 40 tokens), scored by ``json_fields``
   (the share of the four expected fields right) and exact match of the JSON object.

    python benchmarks/distill_online.py [--teacher-steps 20] [--warm-steps 40] [--seconds 240] [--lmbda 1.0]
    python benchmarks/distill_online.py --student smollm2-135m-instruct --warm-steps 0 --lr 2e-5

``--student``: another student than the presets' shrunk one (``--warm-steps 0``: no warm start, the student as it
is, e.g. the un-tuned SmolLM2-135M-Instruct taught by its fine-tuned copy); ``--lr``: both ways' learning rate
(default: the presets', 3e-3, for the shrunk student); ``--online-batch``: the on-policy way's prompts a step (its
preset samples 8, the off-policy preset trains on 4 rows).

One process; prints each stage's time, the on-policy way's seconds of generating (its ``generation_s`` metric: sampling
and scoring the completions) and both scores.
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

import subprocesses

PRESETS = Path(__file__).resolve().parents[1] / "hfsdp" / "config" / "presets"
EVAL_PROMPTS = PRESETS / "data" / "contacts_prompts_eval.jsonl"


def train(config: str, out: Path, steps: int, overrides: list[str]) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "hfsdp", "train", config, "--overwrite", "--set", f"train.output_dir={out}",
           "--set", f"train.max_steps={steps}", "--set", "train.eval_at_start=false", "--set", "train.eval_every=null",
           "--set", "train.log_every=1", *[a for o in overrides for a in ("--set", o)]]
    started = time.perf_counter()
    subprocesses.run(cmd, check=True, stdout=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, time.perf_counter() - started


def step_s(metrics: list[dict]) -> float:
    return statistics.median(m["step_time_s"] for m in metrics if "step_time_s" in m)


def probe_step_s(preset: str, out: Path, keys: list[str], lmbda: float) -> float:
    """A step's expected seconds: a 3-step probe's median; on-policy with ``lmbda`` between 0 and 1, the two kinds
    of round probed apart (3 steps each) and weighed by ``lmbda`` (the probe's own rounds would be the run's first
    3 draws, not its mix)."""
    if preset == "distill" or lmbda in (0.0, 1.0):
        return step_s(train(preset, out, 3, keys)[0])
    sampled = step_s(train(preset, out, 3, [*keys, "distill_online.lmbda=1.0"])[0])
    given = step_s(train(preset, out, 3, [*keys, "distill_online.lmbda=0.0"])[0])
    return lmbda * sampled + (1 - lmbda) * given


def score(model_dir: Path) -> dict[str, float]:
    """json_fields and exact match of greedy answers to the held-out contact prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfsdp.builtin.online.rewards import _json_object, json_fields

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in EVAL_PROMPTS.read_text().splitlines()]
    texts = []
    with torch.no_grad():
        for row in rows:
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
            out = model.generate(**ids, max_new_tokens=40, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            texts.append(tokenizer.decode(out[0, ids["input_ids"].size(1):], skip_special_tokens=True))
    fields = json_fields(texts, [r["answer"] for r in rows])
    exact = [float(_json_object(t) == json.loads(r["answer"])) for t, r in zip(texts, rows)]
    return {"json_fields": statistics.mean(fields), "exact_match": statistics.mean(exact), "example": texts[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher-steps", type=int, default=20)
    parser.add_argument("--warm-steps", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=240.0, help="each way's training budget")
    parser.add_argument("--lmbda", type=float, default=1.0, help="distill_online.lmbda")
    parser.add_argument("--student", default=None, help="the student (default: the presets' smollm2-tiny)")
    parser.add_argument("--lr", type=float, default=None, help="both ways' train.learning_rate")
    parser.add_argument("--online-batch", type=int, default=None,
                        help="the on-policy way's prompts a step (default: its preset's 8; the off-policy preset "
                             "trains on 4 rows a step)")
    args = parser.parse_args()
    for flag, value in (("--lr", args.lr), ("--online-batch", args.online_batch), ("--seconds", args.seconds)):
        if value is not None and value <= 0:  # before the teacher trains for minutes
            parser.error(f"{flag} must be above 0 (got {value:g})")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _, teacher_s = train("default", root / "teacher", args.teacher_steps, ["train.export_final=true"])
        teacher = root / "teacher" / "final"
        print(f"teacher: SmolLM2-135M-Instruct fine-tuned {args.teacher_steps} steps in {teacher_s:.0f} s: "
              f"{score(teacher)}")
        student = [f"model.name_or_path={args.student}"] if args.student else []
        if args.warm_steps:
            _, warm_s = train("distill", root / "warm", args.warm_steps, [f"distill.teacher={teacher}", *student])
            warm = str(root / "warm" / "final")
            print(f"student warm start: distilled off-policy {args.warm_steps} steps in {warm_s:.0f} s: "
                  f"{score(Path(warm))}")
        else:
            from hfsdp.cli import cache_dir
            from hfsdp.model.loading import resolve_model_path

            warm = resolve_model_path(args.student or "smollm2-tiny", cache_dir())
            print(f"student {args.student or 'smollm2-tiny'} as it is: {score(Path(warm))}")
        ways = {"off-policy (distill)": ("distill", [f"distill.teacher={teacher}"]),
                f"on-policy (distill_online, lmbda {args.lmbda:g})": (
                    "distill-online", [f"distill_online.teacher={teacher}", f"distill_online.lmbda={args.lmbda}",
                                       "distill_online.completion_column=answer", "data.eval_path=null",
                                       *([f"train.per_device_batch_size={args.online_batch}"]
                                         if args.online_batch is not None else [])])}
        results = {}
        for name, (preset, keys) in ways.items():
            keys = [f"model.name_or_path={warm}", "train.warmup_steps=0", *keys,
                    *([f"train.learning_rate={args.lr}"] if args.lr is not None else [])]
            steps = max(int(args.seconds / probe_step_s(preset, root / "probe", keys, args.lmbda)), 1)
            out = root / name.split()[0]
            metrics, wall = train(preset, out, steps, keys)
            trained = sum(m["step_time_s"] for m in metrics if "step_time_s" in m)
            generation = [m["generation_s"] for m in metrics if m.get("on_policy")]  # the rounds that sampled
            results[name] = {"steps": steps, "training_s": round(trained, 1), "wall_s": round(wall, 1),
                             "generation_s": round(sum(generation), 1), **score(out / "final")}
            print(f"{name}: {json.dumps(results[name])}")
    print(f"\n{'':<36} {'steps':>6} {'training s':>11} {'of it generating':>17} {'json_fields':>12} "
          f"{'exact match':>12}")
    for name, r in results.items():
        print(f"{name:<36} {r['steps']:>6} {r['training_s']:>11.1f} {r['generation_s']:>17.1f} {r['json_fields']:>12.4f} "
              f"{r['exact_match']:>12.4f}")


if __name__ == "__main__":
    main()
