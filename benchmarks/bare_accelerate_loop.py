"""The baseline for hfsdp's per-step overhead: a bare, hand-written Accelerate training loop.

Same model, same tokenized rows and batch order (hfsdp's own cache and BatchPlan), the same wrapper (one process:
none; several: the FSDP plugin from hfsdp.parallel.fsdp.build_fsdp_plugin via hfsdp.parallel.accelerator.build_accelerator, which
also applies the CPU adaptation), the same AdamW (fused, as hfsdp and TRL's SFTTrainer use it) and gradient
clipping, the model's own loss on the collated batch with its attention mask, and nothing else: no metrics, no
hooks, no progress bar, no per-step collectives beyond FSDP's own. Batches are collated before the loop starts.

    torchrun --nproc-per-node 2 benchmarks/bare_accelerate_loop.py bench --steps 8 --json out.json \\
        --set fsdp.sharding_strategy=FULL_SHARD

Writes the wall time of every iteration (same definition as the bench_probe plugin: one iteration end to the next).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?", default="bench")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import torch

    from hfsdp.data import batches
    from hfsdp.model import loading
    from hfsdp.cli import cache_dir
    from hfsdp.parallel import launcher
    from hfsdp.config.files import load_config
    from hfsdp.data.prepare import prepare_datasets
    from hfsdp.setup.decide import decide
    from hfsdp.parallel.accelerator import build_accelerator

    cfg, host = load_config(args.config, args.overrides)
    setup = decide(cfg, launcher.launched_world(os.environ, on_cpu=not torch.cuda.is_available()), resume=None)
    launcher.apply_wrapper(os.environ, setup)  # as hfsdp train: one process without a wrapper joins no process group
    cfg, world = setup.config, setup.world
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    layers = loading.fsdp_layer_classes(cfg.fsdp, loading.load_model_config(path, cfg.model))
    accelerator = build_accelerator(setup, layers)
    torch.manual_seed(cfg.train.seed)
    tokenizer = loading.load_tokenizer(path, cfg.model)
    with accelerator.main_process_first():
        train_set = prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    plan = batches.BatchPlan(len(train_set), cfg.train.per_device_batch_size, world.size, 1, cfg.train.seed)
    collated = [
        {k: v.to(accelerator.device) for k, v in
         batches.collate([train_set[i] for i in plan.rows(step, 0, accelerator.process_index)], tokenizer.pad_token_id).items()}
        for step in range(args.steps)
    ]

    step_tokens = [sum(len(train_set[i]["input_ids"]) for r in range(world.size) for i in plan.rows(step, 0, r))
                   for step in range(args.steps)]

    model = loading.load_model(path, cfg.model)
    t = cfg.train

    def adamw(params):
        return torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon,
                                 weight_decay=t.weight_decay, fused=True)

    if setup.fsdp and cfg.fsdp.version == 1:
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(adamw(model.parameters()))
    else:
        model, optimizer = accelerator.prepare(model, adamw(model.parameters()))
    cuda = accelerator.device.type == "cuda"
    model.train()
    times, tokens = [], []
    last = time.perf_counter()
    for step, batch in enumerate(collated):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if t.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        tokens.append(step_tokens[step])
        last = now
    if accelerator.is_main_process:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"step_times_s": times, "tokens": tokens, "world_size": world.size,
                                         "strategy": cfg.fsdp.sharding_strategy, "pid": os.getpid()}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
