"""hfsdp's DPO against TRL's ``DPOTrainer``, step by step, on the real SmolLM2-135M-Instruct (issue 23).

Both train the same model folder (hfsdp's cache of the built-in model) on the same raw preference rows (TRL
tokenizes them itself, by its own conventions), the same pairs in the same order per step (hfsdp's ``BatchPlan``,
read sequentially by TRL), the same beta, AdamW hyper-parameters, LR schedule and gradient clipping, fp32, one
process, full fine-tuning without gradient checkpointing. TRL gets a second copy of the model as its reference;
hfsdp computes the reference log-probs once before training (``dpo.reference: precomputed``). Both train one epoch
of the data's first ``steps x batch`` rows. Prints both trajectories (loss and reward margin per step), their
largest differences against the targets (losses within 1e-4 relative, margins within 1e-3), hfsdp's step-0
distance from ln 2, and the step-time ratio (median, first step left out).

    python benchmarks/trl_dpo.py [CONFIG] --steps 8 [--set KEY=VALUE ...]

CONFIG defaults to the ``dpo`` preset. Needs TRL: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import subprocesses


def run_hfsdp(config: str, overrides: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "hfsdp", "train", config, "--overwrite", "--set", f"train.output_dir={out}",
           *[a for o in overrides for a in ("--set", o)]]
    subprocesses.run(cmd, check=True)
    return [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def in_plan_order(cfg, host, steps: int):
    """(model path, tokenizer, raw rows, hfsdp's tokenized rows, the row of each of the steps' places in order).
    hfsdp's plan is over its tokenized rows: the same row count (no row is dropped in this data), so the same order."""
    from hfsdp.data import batches
    from hfsdp.data import prepare as data
    from hfsdp.model import loading
    from hfsdp.cli import cache_dir

    t = cfg.train
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    raw, _ = data.load_raw(cfg.data, t.seed, host.data_readers(cfg))
    train_set = data.prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    assert len(train_set) == len(raw), "rows dropped in tokenization: the plans would differ"
    plan = batches.BatchPlan(len(train_set), t.per_device_batch_size, 1, 1, t.seed)
    return path, tokenizer, raw, train_set, [i for step in range(steps) for i in plan.rows(step, 0, 0)]


def run_trl(cfg, host, steps: int) -> tuple[list[float], list[float], list[float]]:
    import datasets
    import torch
    from torch.utils.data import SequentialSampler
    from trl import DPOConfig, DPOTrainer

    from hfsdp.model import loading
    from trl_sft import step_times, training_args  # benchmarks/, next to this file

    t = cfg.train
    path, tokenizer, raw, _, order = in_plan_order(cfg, host, steps)
    ordered = datasets.Dataset.from_list([raw[i] for i in order])

    losses: list[float] = []
    margins: list[float] = []
    times: list[float] = []

    class InPlanOrder(DPOTrainer):
        def _get_train_sampler(self, *unused, **unused_kw):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float(loss.detach()))
            margins.append(self._metrics["train"]["rewards/margins"][-1])
            return loss

    torch.manual_seed(t.seed)
    model, ref_model = loading.load_model(path, cfg.model), loading.load_model(path, cfg.model)
    section = cfg.section("dpo")
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            **training_args(t, out, steps), max_length=cfg.data.max_seq_len, truncation_mode="keep_start", beta=section.beta,
            loss_type=[section.loss_type], label_smoothing=section.label_smoothing, precompute_ref_log_probs=False,
        )
        trainer = InPlanOrder(model=model, ref_model=ref_model, args=args, train_dataset=ordered,
                              processing_class=tokenizer, callbacks=[step_times(times)])
        trainer.train()
    return losses, margins, times


def speed(ours: list[dict], trl_times: list[float]) -> str:
    """The median step times (the first step left out) and their ratio."""
    ours_time = statistics.median(m["step_time_s"] for m in ours[1:])
    trl_time = statistics.median(trl_times[1:])
    return f"median step time: hfsdp {ours_time:.3f} s, TRL {trl_time:.3f} s: hfsdp is {trl_time / ours_time:.2f}x TRL's speed"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default="dpo")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    from hfsdp.config.files import load_config

    overrides = [f"train.max_steps={args.steps}", "train.eval_every=null", "train.eval_at_start=false",
                 "train.log_every=1", "train.export_final=false", "data.eval_path=null", *args.overrides]
    cfg, _ = load_config(args.config, overrides)
    # The first rows the steps train on, as the data file: hfsdp precomputes reference log-probs for these only.
    rows = Path(cfg.data.path).read_text().splitlines()[:args.steps * cfg.train.per_device_batch_size]
    subset = Path(tempfile.mkdtemp()) / "pairs.jsonl"
    subset.write_text("\n".join(rows) + "\n")
    overrides.append(f"data.path={subset}")
    cfg, host = load_config(args.config, overrides)
    if cfg.train.gradient_accumulation_steps != 1 or cfg.fsdp.mixed_precision != "no" or cfg.plugins != ["dpo"]:
        raise SystemExit("trl_dpo.py compares one process, fp32, full fine-tuning, without gradient accumulation")
    with tempfile.TemporaryDirectory() as out:
        ours = run_hfsdp(args.config, overrides, Path(out) / "run")
    trl_losses, trl_margins, trl_times = run_trl(cfg, host, args.steps)

    print(f"\nDPO on {cfg.model.name_or_path}, {cfg.train.per_device_batch_size} pairs per step, beta "
          f"{cfg.section('dpo').beta}, lr {cfg.train.learning_rate}, fp32, one process")
    print(f"{'step':>4} {'hfsdp loss':>12} {'TRL loss':>12} {'rel diff':>9} {'hfsdp margin':>13} {'TRL margin':>11} "
          f"{'abs diff':>9}")
    worst_loss = worst_margin = 0.0
    for step, (m, loss, margin) in enumerate(zip(ours, trl_losses, trl_margins), start=1):
        rel = abs(m["loss"] - loss) / abs(loss)
        diff = abs(m["rewards/margins"] - margin)
        worst_loss, worst_margin = max(worst_loss, rel), max(worst_margin, diff)
        print(f"{step:>4} {m['loss']:>12.7f} {loss:>12.7f} {rel:>9.2e} {m['rewards/margins']:>13.7f} {margin:>11.7f} "
              f"{diff:>9.2e}")
    steps = min(len(ours), len(trl_losses))
    met = worst_loss <= 1e-4 and worst_margin <= 1e-3 and steps >= 5
    print(f"largest loss difference {worst_loss:.2e} relative (target 1e-4), margin {worst_margin:.2e} "
          f"(target 1e-3), over {steps} steps: {'MET' if met else 'NOT MET'}")
    print(f"step 0: hfsdp's first loss - ln 2 = {ours[0]['loss'] - math.log(2):+.2e}")
    print(speed(ours, trl_times) + " (goal 1.15x)")


if __name__ == "__main__":
    main()
