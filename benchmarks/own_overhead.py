"""hfsdp's own per-step host work, timed piece by piece on the real rows (no model step), next to a step's time.

    python benchmarks/own_overhead.py [CONFIG] [--steps 200] [--set KEY=VALUE ...]

Times what the training loop does around forward, backward and the optimizer step, for one process: building the
step's micro-batches (row reads, collation, host-side token counts, attention-mask and logit-position choice), the
step-end bookkeeping (metrics dict, progress bar update, metrics.jsonl record on log steps, the step-end hook call
with no implementer) and the trainable-parameter list. Prints microseconds per step for each.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def per_step_us(fn, steps: int) -> float:
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        fn(step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default=str(Path(__file__).with_name("peers.yaml")))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    a = p.parse_args()

    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    from hfsdp.data import batches
    from hfsdp.model import loading
    from hfsdp.cli import cache_dir
    from hfsdp.run.metrics import MetricsWriter
    from hfsdp.config.files import load_config
    from hfsdp.data.prepare import prepare_datasets

    cfg, host = load_config(a.config, a.overrides)
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    train_set = prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    t = cfg.train
    plan = batches.BatchPlan(len(train_set), t.per_device_batch_size, 1, t.gradient_accumulation_steps, t.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))  # for the parameter list only
    results = {
        "micro-batches (read rows, collate, count, mask/logit choice)": per_step_us(
            lambda s: batches.micro_batches(train_set, plan, s, 0, tokenizer.pad_token_id, "cpu", True), a.steps),
        "trainable-parameter list": per_step_us(lambda s: [q for q in model.parameters() if q.requires_grad], a.steps),
    }
    with tempfile.TemporaryDirectory() as out:
        metrics = MetricsWriter(Path(out), enabled=True, tensorboard=False)
        bar = tqdm(total=a.steps, desc="training", dynamic_ncols=True)

        def step_end(step: int) -> None:
            m = {"loss": 1.0, "lr": 1e-4, "grad_norm": 1.0, "tokens": 344, "tokens_per_s": 100.0, "step_time_s": 3.4,
                 "epoch": plan.epoch_of(step), "skipped_steps": 0}
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", tok_s=f"{m['tokens_per_s']:.0f}")
            if step % t.log_every == 0:
                metrics.write(step, m)
            host.call("hfsdp_on_step_end", run=None, step=step, metrics=m)

        results[f"step end (metrics dict, progress bar, metrics.jsonl every {t.log_every}, hook call)"] = \
            per_step_us(step_end, a.steps)
        bar.close()
        metrics.close()
    for name, us in results.items():
        print(f"{us:10.1f} µs/step  {name}")
    print(f"{sum(results.values()):10.1f} µs/step  total")


if __name__ == "__main__":
    main()
