"""Where a training step's time goes, eager vs ``train.compile`` (Inductor, blocks compiled in place), on the peer
benchmark's work (benchmarks/peers.yaml: the real SmolLM2-135M, 4 chat rows per step, fp32, one process): hfsdp's
own pieces (model, micro-batches, chunked loss, fused AdamW, clipping) in one process, each variant warmed up, then
``--steps`` steps timed by phase and one profiled with torch.profiler (self CPU time per op class).

    python benchmarks/compile_profile.py [--steps 4] [--warmup 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def op_class(name: str) -> str:
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul") or \
            "mkldnn" in name or "_scaled_dot_product" in name or "mkl_" in name:
        return "matmuls and attention kernels (BLAS / oneDNN)"
    if "_fused_adamw" in name or "adam" in name.lower():
        return "optimizer (fused AdamW)"
    if "cpp_fused" in name or "kernel_cpp" in name or name.startswith("Torch-Compiled") or "inductor" in name.lower() \
            or "CompiledFunction" in name:
        return "Inductor-generated kernels and compiled-graph glue"
    if "embedding" in name or "nll_loss" in name or "log_softmax" in name or "cross_entropy" in name:
        return "embedding, log-softmax and NLL"
    return "other aten ops (elementwise, norms, copies, reductions)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "benchmarks" / "peers.yaml"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()

    import torch

    from hfsdp.data import batches
    from hfsdp.data import prepare as data
    from hfsdp.model import loading
    from hfsdp.cli import cache_dir
    from hfsdp.config.files import load_config
    from hfsdp.model.token_loss import ChunkedLoss
    from hfsdp.run import optimizers
    from hfsdp.parallel.accelerator import compile_blocks

    results = {}
    for variant in ("eager", "compiled"):
        cfg, host = load_config(a.config, [f"train.compile={'true' if variant == 'compiled' else 'false'}"])
        path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
        tokenizer = loading.load_tokenizer(path, cfg.model)
        train_set = data.prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
        plan = batches.BatchPlan.for_run(train_set, cfg.train, 1)
        torch.manual_seed(0)
        model = loading.load_model(path, cfg.model)
        loss_fn = ChunkedLoss(model, model.config.vocab_size)
        optimizer = optimizers.build(model, cfg.train)
        if variant == "compiled":
            compile_blocks(model, cfg)
        model.train()
        phases = defaultdict(list)

        def step(s: int) -> None:
            t0 = time.perf_counter()
            batch = batches.micro_batches(train_set, plan, s, 0, tokenizer.pad_token_id, "cpu", True)[0]
            loss = loss_fn(model, batch) / batch.num_targets
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            for name, seconds in (("forward (with loss)", t1 - t0), ("backward", t2 - t1),
                                  ("clip + optimizer", t3 - t2), ("step", t3 - t0)):
                phases[name].append(seconds)

        for s in range(a.warmup):
            step(s)
        phases.clear()
        for s in range(a.warmup, a.warmup + a.steps):
            step(s)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(a.warmup + a.steps)
        by_class = defaultdict(float)
        for event in prof.key_averages():
            by_class[op_class(event.key)] += event.self_cpu_time_total / 1e6
        results[variant] = ({k: statistics.median(v) for k, v in phases.items()}, dict(by_class))
        print(f"{variant}: median step {results[variant][0]['step']:.3f} s", flush=True)

    print("\n| phase (median s over %d steps after %d warm-up) | eager | compiled | compiled ÷ eager |" % (a.steps, a.warmup))
    print("|---|---|---|---|")
    for phase in results["eager"][0]:
        e, c = results["eager"][0][phase], results["compiled"][0][phase]
        print(f"| {phase} | {e:.3f} | {c:.3f} | {c / e:.2f} |")
    print("\n| self CPU time of one profiled step, by op class (s) | eager | compiled |")
    print("|---|---|---|")
    classes = sorted(set(results["eager"][1]) | set(results["compiled"][1]), key=lambda k: -results["eager"][1].get(k, 0))
    for k in classes:
        print(f"| {k} | {results['eager'][1].get(k, 0):.3f} | {results['compiled'][1].get(k, 0):.3f} |")


if __name__ == "__main__":
    main()
