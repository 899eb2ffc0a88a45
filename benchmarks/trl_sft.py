"""TRL's ``SFTTrainer`` on exactly the work of an ``hfsdp train`` run, for ``benchmarks/peers.py``.

The same model folder (hfsdp's cache of the built-in model), the same tokenized rows with the same labels (hfsdp's
preprocessing, passed as a pre-tokenized dataset with a ``labels`` column, which TRL uses as is), the same rows in
the same order per step (hfsdp's ``BatchPlan``, read sequentially), the same AdamW hyper-parameters, LR schedule and
gradient clipping, fp32 without gradient checkpointing, no eval, no checkpoints. TRL keeps its own defaults
otherwise (its fused AdamW, its chunked LM head, its per-step entropy and token-accuracy metrics). With ``lora`` in
the config's plugins (``peers.py --tools trl-lora``), TRL + peft trains the adapters hfsdp's ``lora`` plugin would:
the same ``LoraConfig`` (``hfsdp.builtin.lora.peft_config``: rank, alpha, dropout, the same target modules), passed
as ``SFTTrainer(peft_config=...)``.

    python benchmarks/trl_sft.py CONFIG --steps 10 --json out.json [--set KEY=VALUE ...]

Writes the wall time of every iteration (one step end to the next, as hfsdp's bench_probe measures) and its tokens.
Needs TRL: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def step_times(times: list[float]):
    """A ``TrainerCallback`` that appends the wall time of every iteration (one step end to the next) to ``times``."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

    return StepTimes()


def float64_norms(trainer, norms: list[float], torch_norms: list[float], clip_by_them: bool = False) -> None:
    """Record, at each clip, the float64 norm of the trainer's gradients (how hfsdp sums its norm,
    ``hfsdp.parallel.world.clip_grad_norm``) and torch's float32 ``clip_grad_norm_`` one, which TRL's trainers
    clip by, log and which comes out about 3e-5 relative off over SmolLM2-135M's gradients: the float64 norms
    compare the gradients, not the two norms' rounding. ``clip_by_them``: TRL then clips by the float64 norm (its
    clip factor otherwise), so that its clipped updates are comparable to hfsdp's."""
    import torch

    torch_clip = trainer._clip_grad_norm

    def clip_grad_norm(model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        exact = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).square().sum().sqrt()
        norms.append(float(exact))
        if not clip_by_them:
            total = torch_clip(model)
            torch_norms.append(float(total))
            return total
        torch_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), trainer.args.max_grad_norm, exact.float())
        return exact.float()

    trainer._clip_grad_norm = clip_grad_norm


def training_args(t, out: str, steps: int) -> dict:
    """TRL's config arguments for hfsdp's ``train:`` section ``t``: the same AdamW, LR schedule and clipping, one
    process, fp32, no gradient checkpointing, nothing saved or evaluated, a log every step."""
    import torch

    return dict(output_dir=out, per_device_train_batch_size=t.per_device_batch_size, gradient_accumulation_steps=1,
                max_steps=steps, learning_rate=t.learning_rate, lr_scheduler_type=t.lr_scheduler if
                t.lr_scheduler != "constant" else "constant_with_warmup", warmup_steps=t.warmup_steps,
                weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
                adam_epsilon=t.adam_epsilon, max_grad_norm=t.max_grad_norm or 0.0, seed=t.seed, logging_steps=1,
                save_strategy="no", eval_strategy="no", report_to="none", bf16=False, fp16=False,
                gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default="default")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from trl import SFTConfig, SFTTrainer

    from hfsdp.data import batches
    from hfsdp.model import loading
    from hfsdp.cli import cache_dir
    from hfsdp.config.files import load_config
    from hfsdp.data.prepare import prepare_datasets

    cfg, host = load_config(args.config, args.overrides)
    t = cfg.train
    if t.gradient_accumulation_steps != 1 or cfg.fsdp.mixed_precision != "no":
        raise SystemExit("trl_sft.py compares one process, fp32, without gradient accumulation")
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    train_set = prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    plan = batches.BatchPlan(len(train_set), t.per_device_batch_size, 1, 1, t.seed,
                          lengths=batches.row_lengths(train_set) if t.group_by_length else None)
    rows = [train_set[i] for step in range(args.steps) for i in plan.rows(step, 0, 0)]
    ordered = datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    step_tokens = [sum(len(r["input_ids"]) for r in rows[s * t.per_device_batch_size:(s + 1) * t.per_device_batch_size])
                   for s in range(args.steps)]

    class InPlanOrder(SFTTrainer):
        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)

    times: list[float] = []
    torch.manual_seed(t.seed)
    model = loading.load_model(path, cfg.model)
    peft = None
    if "lora" in cfg.plugins:
        from hfsdp.builtin import lora

        section = cfg.section("lora")
        peft = lora.peft_config(section, lora.resolved_targets(model, cfg, section))
    with tempfile.TemporaryDirectory() as out:
        sft = SFTConfig(**training_args(t, out, args.steps) | {"logging_steps": t.log_every}, max_length=None,
                        packing=False)
        trainer = InPlanOrder(model=model, args=sft, train_dataset=ordered, processing_class=tokenizer,
                              callbacks=[step_times(times)], peft_config=peft)
        trainer.train()
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"step_times_s": times, "tokens": step_tokens[:len(times)], "world_size": 1,
                                     "trainable_parameters": trainable, "pid": os.getpid()}))


if __name__ == "__main__":
    main()
