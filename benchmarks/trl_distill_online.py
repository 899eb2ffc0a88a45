"""hfsdp's on-policy distillation (plugin ``distill_online``) against TRL's ``DistillationTrainer``, step by step, on
the same completions (issue 52), and their speeds.

hfsdp trains first and writes every completion its student sampled (``completions.jsonl``). TRL then trains the same
student folder with the same teacher on the same prompts in the same order (hfsdp's plan, read sequentially by TRL),
its generation replaced by one that returns hfsdp's completions of that step (the prompt tokens TRL made are checked
equal to hfsdp's), the same ``beta`` and temperature, AdamW hyper-parameters, LR schedule and gradient clipping (by
the float64 norm of its gradients, as hfsdp's; TRL's logged float32 norm is printed beside it): fp32, one process,
no gradient accumulation, full fine-tuning. TRL computes its divergence with its chunked kernel over the hidden
states and both ``lm_head`` weights; hfsdp from both models' logits. Prints both columns of per-step loss and
gradient norm and their largest relative differences (target 1e-6 for the loss), and both median step times.

``--speed``: each side samples its own completions (TRL's ``transformers.generate``; hfsdp's seeded sampler) on the
same student, teacher and prompts, ``--rounds`` times interleaved; prints each side's mean step time over steps 2..
and hfsdp's speed as a ratio of TRL's (per step and per completion token).

    python benchmarks/trl_distill_online.py [CONFIG] --steps 4 [--set KEY=VALUE ...]
    python benchmarks/trl_distill_online.py [CONFIG] --speed --steps 6 --rounds 3 [--set KEY=VALUE ...]

CONFIG defaults to the ``distill-online`` preset (the shrunk SmolLM2 student, the real SmolLM2-135M-Instruct as
teacher). Needs TRL: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from trl_grpo import ABS_FLOOR, arguments, fixed_overrides, run_hfsdp, speed  # benchmarks/, next to this file

PLUGIN = "distill_online"


def run_trl(cfg, host, steps: int, rounds: dict[int, list[list[int]]] | None) -> dict[str, list[float]]:
    """TRL's per-step ``losses``, ``grad_norms`` (logged), ``float64_norms`` and ``torch_norms`` (with hfsdp's
    completions: TRL clips by the float64 norm), ``step_times``, and per step its ``generation_s`` and mean
    completion ``lengths`` when it samples (``rounds`` None)."""
    import datasets
    import torch
    from trl import DistillationConfig, DistillationTrainer

    from hfsdp.builtin.online.objective import OnlineObjective
    from hfsdp.builtin.prompt import prompt_ids
    from hfsdp.cli import cache_dir
    from hfsdp.data import prepare as data
    from hfsdp.model import loading
    from trl_sft import float64_norms, step_times, training_args

    t, s = cfg.train, cfg.section(PLUGIN)
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    raw, _ = data.load_raw(cfg.data, t.seed, host.data_readers(cfg))
    train_set = data.prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    assert len(train_set) == len(raw), "rows dropped in tokenization: the plans would differ"
    plan = OnlineObjective(s, [], cfg, tokenizer).batch_plan(train_set, t, 1, None)
    order = [i for step in range(0, steps, s.num_iterations) for i in plan.rows(step, 0, 0)]
    ordered = datasets.Dataset.from_list([{"prompt": raw[i]["prompt"]} for i in order])
    expected = [prompt_ids(raw[i]["prompt"], tokenizer, cfg.data) for i in order]
    given = iter([rounds[step] for step in sorted(rounds)]) if rounds is not None else None
    per_step = t.per_device_batch_size // s.num_generations
    logged: dict = {k: [] for k in ("losses", "grad_norms", "float64_norms", "torch_norms", "step_times",
                                     "generation_s", "lengths")}

    class InPlanOrder(DistillationTrainer):  # shuffle_dataset=False: TRL reads the prompts in hfsdp's order
        steps_sampled = 0

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, *args, **kwargs):
            first = self.steps_sampled * per_step
            assert [list(p) for p in prompt_ids[::s.num_generations]] == expected[first:first + per_step], \
                "TRL tokenized the prompts otherwise than hfsdp"
            self.steps_sampled += 1
            if given is not None:
                return next(given)
            started = time.perf_counter()
            completion_ids = super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
            logged["generation_s"].append(time.perf_counter() - started)
            logged["lengths"].append(statistics.mean(len(c) for c in completion_ids))
            return completion_ids

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            logged["losses"].append(float(loss.detach()))
            return loss

    from transformers import TrainerCallback

    class GradNorms(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                logged["grad_norms"].append(float(logs["grad_norm"]))

    torch.manual_seed(t.seed)
    student = loading.load_model(path, cfg.model)
    teacher_cfg = cfg.model.model_copy(update={"name_or_path": s.teacher, "revision": None, "quantization": None})
    teacher = loading.load_model(loading.resolve_model_path(s.teacher, cache_dir()), teacher_cfg)
    with tempfile.TemporaryDirectory() as out:
        args = DistillationConfig(**training_args(t, out, steps), max_completion_length=s.max_new_tokens,
                                  temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, beta=s.beta,
                                  shuffle_dataset=False, log_completions=False)
        trainer = InPlanOrder(model=student, teacher_model=teacher, args=args, train_dataset=ordered,
                              processing_class=tokenizer, callbacks=[step_times(logged["step_times"]), GradNorms()])
        if given is not None:
            float64_norms(trainer, logged["float64_norms"], logged["torch_norms"], clip_by_them=True)
        trainer.train()
    return logged


def compare(cfg, ours: list[dict], trl: dict[str, list[float]], steps_asked: int) -> None:
    s = cfg.section(PLUGIN)
    print(f"\nOn-policy distillation of {cfg.model.name_or_path} from {s.teacher}: {cfg.train.per_device_batch_size} "
          f"completions per step (at most {s.max_new_tokens} tokens), beta {s.beta}, temperature {s.temperature}, "
          f"lr {cfg.train.learning_rate}, fp32, one process, the same completions")
    print(f"{'step':>4} {'hfsdp loss':>13} {'TRL loss':>13} {'rel diff':>9} {'hfsdp grad':>11} {'TRL f64':>11} "
          f"{'rel diff':>9} {'TRL logged':>11}")
    worst_loss = worst_norm = 0.0
    for step, (m, loss, norm, logged) in enumerate(zip(ours, trl["losses"], trl["float64_norms"],
                                                       trl["torch_norms"]), start=1):
        diff = abs(m["loss"] - loss)
        rel, rel_norm = diff / max(abs(loss), 1e-12), abs(m["grad_norm"] - norm) / max(abs(norm), 1e-12)
        worst_loss, worst_norm = max(worst_loss, rel if diff > ABS_FLOOR else 0.0), max(worst_norm, rel_norm)
        print(f"{step:>4} {m['loss']:>13.8f} {loss:>13.8f} {rel:>9.2e} {m['grad_norm']:>11.6f} {norm:>11.6f} "
              f"{rel_norm:>9.2e} {logged:>11.6f}")
    steps = min(len(ours), len(trl["losses"]))
    met = worst_loss <= 1e-6 and worst_norm <= 1e-5 and steps == steps_asked
    print(f"largest differences over {steps} steps: loss {worst_loss:.2e} relative (target 1e-6), grad norm "
          f"{worst_norm:.2e} relative (target 1e-5): {'MET' if met else 'NOT MET'}")


def main() -> None:
    args = arguments("distill-online", "sampling")

    from hfsdp.config.files import load_config
    from hfsdp.errors import ConfigError

    overrides = [*fixed_overrides(args.steps), f"{PLUGIN}.log_completions=100000", *args.overrides]
    try:
        cfg, host = load_config(args.config, overrides)
    except ConfigError as err:
        raise SystemExit(f"trl_distill_online.py: {err}") from None
    if (cfg.train.gradient_accumulation_steps != 1 or cfg.fsdp.mixed_precision != "no" or cfg.plugins != [PLUGIN]
            or cfg.section(PLUGIN).num_iterations != 1 or cfg.section(PLUGIN).num_generations != 1):
        raise SystemExit(f"trl_distill_online.py compares one process, fp32, plugins [{PLUGIN}], one completion per "
                         "prompt and one step per round (TRL's), without accumulation")
    if args.speed and args.steps < 2:
        raise SystemExit("--speed times steps 2..: give --steps 2 or more")
    results = []
    for _ in range(args.rounds if args.speed else 1):
        with tempfile.TemporaryDirectory() as out:
            ours, completions, _ = run_hfsdp(args.config, overrides, Path(out) / "run", cfg.plugins)
        results.append((ours, run_trl(cfg, host, args.steps, None if args.speed else completions)))
    if args.speed:
        speed(cfg, cfg.section(PLUGIN), results)
        return
    ours, trl = results[0]
    compare(cfg, ours, trl, args.steps)
    print(f"median step time (hfsdp with its sampling, TRL with the sampling replaced): hfsdp "
          f"{statistics.median(m['step_time_s'] for m in ours[1:]):.3f} s, TRL "
          f"{statistics.median(trl['step_times'][1:]):.3f} s")


if __name__ == "__main__":
    sys.exit(main())
