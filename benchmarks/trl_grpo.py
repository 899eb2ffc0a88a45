"""hfsdp's GRPO against TRL's ``GRPOTrainer``, step by step, on the same completions (issue 35).

hfsdp trains first and writes every completion it sampled (``completions.jsonl`` with ``grpo.log_completions``
large). TRL then trains the same model folder on the same prompts in the same order (hfsdp's plan, read
sequentially by TRL), with its generation step replaced by one that returns hfsdp's completions of that round (the
prompt tokens TRL made are checked equal to hfsdp's), the same reward functions, loss type, clipping,
``num_iterations``, reward scaling, temperature, AdamW hyper-parameters, LR schedule and gradient clipping (by the
float64 norm of its gradients, as hfsdp's: torch's float32 norm, which TRL clips by, is about 3e-5 off on the real
model; TRL's logged norm is printed beside it): fp32, one process, full fine-tuning, ``beta: 0`` (hfsdp's KL
reference is LoRA's base; TRL's loss with beta > 0 is compared on fixed tensors in tests/test_grpo_loss.py), no
gradient accumulation (TRL shuffles a generation batch before it splits it into micro-batches). Prints both
columns of per-step loss and gradient norm and their largest relative differences (target 1e-5), and both median
step times.

``--speed``: each side generates its own completions (TRL's ``transformers.generate`` path, ``use_vllm=False``;
hfsdp's seeded sampling), on the same model, prompts in the same order, group size and completion length, ``--rounds``
times interleaved; prints each side's mean step time over steps 2.., split into generation (sampling and scoring)
and training, with the mean completion length (the two sample different completions of the same distribution, so
their lengths differ by chance), and hfsdp's speed as a ratio of TRL's (per step and per completion token).

    python benchmarks/trl_grpo.py [CONFIG] --steps 4 [--set KEY=VALUE ...]
    python benchmarks/trl_grpo.py [CONFIG] --speed --steps 6 --rounds 3 [--set KEY=VALUE ...]

CONFIG defaults to the ``grpo`` preset (the real SmolLM2-135M-Instruct); ``--set model.name_or_path=smollm2-tiny``
runs it in seconds. Needs TRL: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


# A loss difference this small (absolute) is float32 rounding of a sum of terms of about 1, not a relative error.
ABS_FLOOR = 1e-7


def run_hfsdp(config: str, overrides: list[str], out: Path) -> tuple[list[dict], dict[int, list[list[int]]]]:
    """hfsdp's per-step metrics (``generation_s``: the step's sampling and scoring), and the completions (token ids,
    in batch order) sampled at each round's step."""
    cmd = [sys.executable, "-m", "hfsdp", "train", config, "--overwrite", "--set", f"train.output_dir={out}",
           *[a for o in overrides for a in ("--set", o)]]
    subprocess.run(cmd, check=True)
    metrics = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    rounds: dict[int, list[list[int]]] = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        rounds.setdefault(row["step"], []).append(row["completion_ids"])
    return metrics, rounds


def trl_loss_keys(section) -> dict:
    """The GRPOConfig values of the grpo section's loss, advantage and masking keys (named as TRL's)."""
    from hfsdp.builtin.online.schema import OnlineSection

    names = [*(type(section).model_fields.keys() - OnlineSection.model_fields.keys()), "mask_truncated_completions"]
    return {name: getattr(section, name) for name in names}


def run_trl(cfg, host, steps: int, rounds: dict[int, list[list[int]]] | None) -> dict[str, list[float]]:
    """TRL's per-step ``losses``, ``grad_norms`` (what it logs), with hfsdp's completions ``float64_norms`` (of its
    gradients, summed as hfsdp sums its norm; TRL clips by them) and ``torch_norms`` (torch's float32 norm of the
    same gradients, which stock TRL clips by), ``step_times``, and per round its ``generation_s`` and mean
    completion ``lengths``; ``rounds``: hfsdp's completions, returned by TRL's generation step instead of its own
    (None: TRL generates)."""
    import time

    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hfsdp.data import prepare as data
    from hfsdp.model import loading
    from hfsdp.builtin.online.rewards import reward_functions
    from hfsdp.builtin.grpo.loss import GRPO
    from hfsdp.builtin.prompt import prompt_ids
    from hfsdp.cli import cache_dir
    from trl_sft import float64_norms, step_times, training_args  # benchmarks/, next to this file

    t, s = cfg.train, cfg.section("grpo")
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    raw, _ = data.load_raw(cfg.data, t.seed, host.data_readers(cfg))
    train_set = data.prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    assert len(train_set) == len(raw), "rows dropped in tokenization: the plans would differ"
    rewards = reward_functions(cfg, "grpo")
    plan = GRPO(s, rewards, cfg, tokenizer).batch_plan(train_set, t, 1, None)
    order = [i for step in range(0, steps, s.num_iterations) for i in plan.rows(step, 0, 0)]
    ordered = datasets.Dataset.from_list([raw[i] for i in order])
    expected_prompts = [prompt_ids(raw[i]["prompt"], tokenizer, cfg.data) for i in order]
    given = iter([rounds[step] for step in sorted(rounds)]) if rounds is not None else None
    per_round = t.per_device_batch_size // s.num_generations
    logged: dict[str, list[float]] = {k: [] for k in ("losses", "grad_norms", "float64_norms", "torch_norms",
                                                       "step_times", "generation_s", "lengths")}
    losses, grad_norms, times = logged["losses"], logged["grad_norms"], logged["step_times"]

    class InPlanOrder(GRPOTrainer):  # shuffle_dataset=False: TRL's sampler reads the prompts in hfsdp's order
        rounds = 0

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
            first = self.rounds * per_round
            assert [list(p) for p in prompt_ids[::num_generations]] == \
                expected_prompts[first:first + per_round], "TRL tokenized the prompts otherwise than hfsdp"
            self.rounds += 1
            if given is not None:
                return next(given), None
            started = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, images, multimodal_fields,
                                                                     num_generations, **kwargs)
            logged["generation_s"].append(time.perf_counter() - started)
            logged["lengths"].append(statistics.mean(len(c) for c in completion_ids))
            return completion_ids, logprobs

        def _calculate_rewards(self, *args, **kwargs):  # scoring is part of hfsdp's generation_s too
            started = time.perf_counter()
            rewards = super()._calculate_rewards(*args, **kwargs)
            if given is None:
                logged["generation_s"][-1] += time.perf_counter() - started
            return rewards

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float(loss.detach()))
            return loss

    class GradNorms(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                grad_norms.append(float(logs["grad_norm"]))

    torch.manual_seed(t.seed)
    model = loading.load_model(path, cfg.model)
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            **training_args(t, out, steps), num_generations=s.num_generations,
            max_completion_length=s.max_new_tokens, temperature=s.temperature,
            top_p=s.top_p, top_k=s.top_k, beta=s.beta, num_iterations=s.num_iterations,
            shuffle_dataset=False, log_completions=False, reward_weights=[w for *_, w in rewards],
            **trl_loss_keys(s),
        )
        trainer = InPlanOrder(model=model, reward_funcs=[fn for _, _, fn, _ in rewards], args=args,
                                  train_dataset=ordered, processing_class=tokenizer,
                                  callbacks=[step_times(times), GradNorms()])
        if given is not None:  # the exactness run: TRL clips by the float64 norm too (the speed run: stock TRL)
            float64_norms(trainer, logged["float64_norms"], logged["torch_norms"], clip_by_them=True)
        trainer.train()
    return logged


def compare(cfg, s, ours: list[dict], trl: dict[str, list[float]], steps_asked: int) -> None:
    """Both columns of per-step loss and gradient norm on the same completions, and their largest differences."""
    print(f"\nGRPO on {cfg.model.name_or_path}: {cfg.train.per_device_batch_size} completions per step "
          f"({s.num_generations} per prompt, at most {s.max_new_tokens} tokens), num_iterations {s.num_iterations}, "
          f"lr {cfg.train.learning_rate}, fp32, one process, the same completions; "
          + ", ".join(f"{k} {v}" for k, v in sorted(trl_loss_keys(s).items())))
    print("grad norms: hfsdp's (float64 sums), TRL's gradients' in float64 (which TRL clips by here), and the float32 "
          "one TRL logs (torch's clip_grad_norm_); the difference is taken against the float64 one")
    print(f"{'step':>4} {'hfsdp loss':>13} {'TRL loss':>13} {'abs diff':>9} {'rel diff':>9} {'hfsdp grad':>11} "
          f"{'TRL f64':>11} {'rel diff':>9} {'TRL logged':>11}")
    worst_loss = worst_norm = 0.0
    exact = trl["float64_norms"] or trl["grad_norms"]  # (no clip: TRL logs torch's norm only)
    for step, (m, loss, norm, logged) in enumerate(zip(ours, trl["losses"], exact, trl["torch_norms"] or
                                                       trl["grad_norms"]), start=1):
        diff = abs(m["loss"] - loss)
        rel = diff / max(abs(loss), 1e-12)
        rel_norm = abs(m["grad_norm"] - norm) / max(abs(norm), 1e-12)
        # The first step of a round has ratio 1: its loss is minus the token mean of advantages that sum to 0 in
        # each group, a cancellation whose float32 noise (1e-7 of the terms) is large relative to the result.
        worst_loss, worst_norm = max(worst_loss, rel if diff > ABS_FLOOR else 0.0), max(worst_norm, rel_norm)
        print(f"{step:>4} {m['loss']:>13.8f} {loss:>13.8f} {diff:>9.1e} {rel:>9.2e} {m['grad_norm']:>11.6f} "
              f"{norm:>11.6f} {rel_norm:>9.2e} {logged:>11.6f}")
    steps = min(len(ours), len(trl["losses"]), len(exact))
    met = worst_loss <= 1e-5 and worst_norm <= 1e-5 and steps == steps_asked
    print(f"largest differences over {steps} steps: loss {worst_loss:.2e} relative (where over {ABS_FLOOR:.0e} "
          f"absolute), grad norm {worst_norm:.2e} relative (target 1e-5): {'MET' if met else 'NOT MET'}")


def speed(cfg, s, rounds: list[tuple[list[dict], dict[str, list[float]]]]) -> None:
    """Each side's mean step time over steps 2.. of each round (generation and training), medians over rounds."""
    rows = {"hfsdp": [], "TRL": []}
    for ours, trl in rounds:
        timed = ours[1:]  # generation_s is 0 on the steps that reuse a round (num_iterations > 1)
        rows["hfsdp"].append((statistics.mean(m["step_time_s"] for m in timed),
                              statistics.mean(m["generation_s"] for m in timed),
                              statistics.mean(m["completion_length"] for m in timed)))
        rows["TRL"].append((statistics.mean(trl["step_times"][1:]),
                            sum(trl["generation_s"][1:]) / len(trl["step_times"][1:]),
                            statistics.mean(trl["lengths"][1:])))
    print(f"\nGRPO speed on {cfg.model.name_or_path}: {cfg.train.per_device_batch_size} completions per step "
          f"({s.num_generations} per prompt, at most {s.max_new_tokens} tokens, temperature {s.temperature}), "
          f"num_iterations {s.num_iterations}, fp32, one process, each side its own generation; mean over steps "
          f"2.. of each of {len(rounds)} interleaved round(s), then the median")
    print(f"{'':>6} {'step s':>8} {'generation s':>13} {'training s':>11} {'completion tokens':>18} "
          f"{'s per completion token':>23}")
    medians = {}
    for name, values in rows.items():
        step, gen, length = (statistics.median(v[i] for v in values) for i in range(3))
        per_token = statistics.median(v[0] / v[2] for v in values)
        medians[name] = (step, per_token)
        print(f"{name:>6} {step:>8.3f} {gen:>13.3f} {step - gen:>11.3f} {length:>18.1f} {per_token:>23.4f}")
    print(f"hfsdp speed / TRL's: {medians['TRL'][0] / medians['hfsdp'][0]:.2f}x per step, "
          f"{medians['TRL'][1] / medians['hfsdp'][1]:.2f}x per completion token")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default="grpo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--speed", action="store_true", help="each side its own generation: compare step times")
    parser.add_argument("--rounds", type=int, default=1, help="with --speed: interleaved rounds (median)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    from hfsdp.config.files import load_config

    overrides = [f"train.max_steps={args.steps}", "train.eval_at_start=false", "train.eval_every=null",
                 "data.eval_path=null", "train.log_every=1",
                 "train.export_final=false", "grpo.log_completions=100000", *args.overrides]
    cfg, host = load_config(args.config, overrides)
    s = cfg.section("grpo")
    if (cfg.train.gradient_accumulation_steps != 1 or cfg.fsdp.mixed_precision != "no" or cfg.plugins != ["grpo"]
            or s.beta):
        raise SystemExit("trl_grpo.py compares one process, fp32, full fine-tuning, beta 0, without accumulation")
    if args.speed and args.steps < 2:
        raise SystemExit("--speed times steps 2..: give --steps 2 or more")
    results = []
    for _ in range(args.rounds if args.speed else 1):
        with tempfile.TemporaryDirectory() as out:
            ours, completions = run_hfsdp(args.config, overrides, Path(out) / "run")
        results.append((ours, run_trl(cfg, host, args.steps, None if args.speed else completions)))
    if args.speed:
        speed(cfg, s, results)
        return
    ours, trl = results[0]
    compare(cfg, s, ours, trl, args.steps)
    if len(ours) > 1:
        print(f"median step time (hfsdp with its generation, TRL with the generation replaced): hfsdp "
              f"{statistics.median(m['step_time_s'] for m in ours[1:]):.3f} s, TRL "
              f"{statistics.median(trl['step_times'][1:]):.3f} s")


if __name__ == "__main__":
    main()
