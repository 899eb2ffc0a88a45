"""The floor of a training step on this machine: what the step's arithmetic costs with nothing around it.

For the same steps the other tools of ``benchmarks/peers.py`` train (hfsdp's tokenized rows, ``BatchPlan`` order,
the collated micro-batch shapes), the sum of, each timed alone with torch at its best (the fastest of
``--repeats`` after a warm-up) on random tensors of the step's shapes and compute dtype:

* three GEMMs per Linear of every decoder layer (forward ``x @ W.T``, the input's gradient ``dy @ W``, the weight's
  gradient ``dy.T @ x``) at the micro-batch's tokens (rows x padded length);
* the output head's three GEMMs at the labelled positions only (the fewest any loss must project: hfsdp's chunked
  loss projects these; a loss over the full logits projects every position);
* attention: ``scaled_dot_product_attention`` forward and backward per layer, causal (its fastest kernel; a padded
  batch's own mask may choose a slower one);
* one fused AdamW step over tensors of the model's parameter shapes (a tied weight once).

Norms, activations, the embedding lookup, the cross entropy's softmax and everything else count zero, so a tool's
step time divided by this is how far it is from the arithmetic alone.

Timed alone, a layer's GEMMs find their weight in cache, where a step reads each of its 425 MB of layer weights from
memory; issue 56 part 4 measured that this does not make the floor too low: the real model's own GEMMs, each its
fastest over a few steps, run at 0.94-1.09x of these times (``benchmarks/gemm_memory.py``; docs/benchmarks.md).

On N ranks (``torchrun --nproc-per-node N``, gloo; ``peers.py --nproc N --tools hfsdp,floor``) each rank times its
own rows of the step (``BatchPlan`` for N ranks) and AdamW over its 1/N shard of every parameter, and all ranks
time together, at each FSDP unit's size (every decoder layer, and the root: the rest of the model) and in the
compute dtype, the collectives the config's ``fsdp.sharding_strategy`` makes per step: FULL_SHARD and HYBRID_SHARD
an all-gather per unit in forward and again in backward (the root's once: it is not resharded after forward) and a
reduce-scatter per unit; SHARD_GRAD_OP one all-gather and one reduce-scatter per unit; NO_SHARD an all-reduce per
unit. A step's floor is the slowest rank's compute plus those collectives, nothing overlapped.

    python benchmarks/floor.py benchmarks/peers.yaml --steps 10 --json out.json   # or: peers.py --tools hfsdp,floor

Writes ``step_times_s`` (the floor of each step), ``tokens`` (its real tokens on all ranks, as the bare loop counts
them) and ``parts_s`` (each part's share, median step; ``collectives`` on N ranks) to ``--json``; prints the parts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path


def best_of(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class Timer:
    """The best time of each op at each shape, measured once (steps share their shapes)."""

    def __init__(self, dtype, repeats: int):
        import torch

        self.torch, self.dtype, self.repeats, self.seen = torch, dtype, repeats, {}
        self.generator = torch.Generator().manual_seed(0)

    def _randn(self, *shape, grad: bool = False):
        t = self.torch.randn(*shape, generator=self.generator).to(self.dtype)
        return t.requires_grad_(grad)

    def linear(self, tokens: int, fan_in: int, fan_out: int) -> float:
        """Forward, input gradient and weight gradient of a Linear at ``tokens`` positions."""
        key = ("linear", tokens, fan_in, fan_out)
        if key not in self.seen:
            torch = self.torch
            x, w, dy = self._randn(tokens, fan_in), self._randn(fan_out, fan_in), self._randn(tokens, fan_out)
            self.seen[key] = (best_of(lambda: torch.nn.functional.linear(x, w), self.repeats)
                              + best_of(lambda: torch.mm(dy, w), self.repeats)
                              + best_of(lambda: torch.mm(dy.t(), x), self.repeats))
        return self.seen[key]

    def attention(self, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> float:
        """``scaled_dot_product_attention`` forward and backward (causal, grouped-query where kv_heads < heads)."""
        key = ("attention", batch, seq, heads, kv_heads, head_dim)
        if key not in self.seen:
            torch = self.torch
            q = self._randn(batch, heads, seq, head_dim, grad=True)
            k, v = (self._randn(batch, kv_heads, seq, head_dim, grad=True) for _ in range(2))
            dout = self._randn(batch, heads, seq, head_dim)

            def step():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                       enable_gqa=kv_heads != heads)
                torch.autograd.grad(out, (q, k, v), dout)

            self.seen[key] = best_of(step, self.repeats)
        return self.seen[key]

    def collectives(self, units: list[int], strategy: str, world: int) -> float:
        """The step's collectives of ``strategy`` on ``world`` gloo ranks, one per FSDP unit of ``units`` elements
        (the last one the root), each timed alone by every rank together (the slowest rank's best)."""
        torch, dist = self.torch, self.torch.distributed
        total = 0.0
        for i, numel in enumerate(units):
            shard = -(-numel // world)
            local, full = self._randn(shard), self._randn(shard * world)
            gather = lambda: dist.all_gather_into_tensor(full, local)  # noqa: E731
            scatter = lambda: dist.reduce_scatter_tensor(local, full)  # noqa: E731
            reduce = lambda: dist.all_reduce(full)  # noqa: E731
            if strategy == "NO_SHARD":
                ops = [reduce]
            else:  # resharded after forward (FULL_SHARD, HYBRID_SHARD; never the root): gathered again in backward
                regather = strategy != "SHARD_GRAD_OP" and i < len(units) - 1
                ops = [gather] * (2 if regather else 1) + [scatter]
            for op in ops:
                dist.barrier()
                best = torch.tensor(best_of(op, self.repeats), dtype=torch.float64)
                dist.all_reduce(best, op=dist.ReduceOp.MAX)
                total += float(best)
        return total

    def adamw(self, shapes: list[tuple[int, ...]], lr: float) -> float:
        """One fused AdamW step over float32 parameters of ``shapes`` (their gradients given, states made)."""
        torch = self.torch
        params = [torch.zeros(s, requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, generator=self.generator)
        optimizer = torch.optim.AdamW(params, lr=lr, fused=True)
        return best_of(optimizer.step, self.repeats)


def model_shapes(model, unit_classes: list[str]) -> dict:
    """The decoder layers' Linears (in, out) and attention sizes, the head's, every parameter's shape, and the
    elements of each FSDP unit (the modules of ``unit_classes``, then the root: every other parameter)."""
    import torch

    layers = model.get_decoder().layers
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    linears = [(m.in_features, m.out_features) for layer in layers for m in layer.modules()
               if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    seen, params = set(), []
    for p in model.parameters():  # a tied weight once
        if id(p) not in seen:
            seen.add(id(p))
            params.append(tuple(p.shape))
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in unit_classes]
    units.append(sum(math.prod(s) for s in params) - sum(units))
    return {"linears": linears, "layers": len(layers), "heads": cfg.num_attention_heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads), "head_dim": head_dim,
            "head": (head.in_features, head.out_features), "params": params, "units": units}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(Path(__file__).with_name("peers.yaml")))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import torch

    from hfsdp import IGNORE_INDEX
    from hfsdp.data import batches
    from hfsdp.model import loading
    from hfsdp.cli import cache_dir
    from hfsdp.parallel import launcher
    from hfsdp.config.files import load_config
    from hfsdp.data.prepare import prepare_datasets

    world = launcher.launched_world(os.environ, on_cpu=not torch.cuda.is_available())
    if world.size > 1:
        if torch.cuda.is_available():
            raise SystemExit("floor.py on N ranks times gloo collectives: CPU only")
        torch.distributed.init_process_group("gloo")
    rank = world.rank
    cfg, host = load_config(args.config, args.overrides)
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    model_config = loading.load_model_config(path, cfg.model)
    shapes = model_shapes(loading.meta_model(model_config), loading.layer_classes(cfg.fsdp, model_config))
    tokenizer = loading.load_tokenizer(path, cfg.model)
    train_set = prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    t = cfg.train
    plan = batches.BatchPlan(len(train_set), t.per_device_batch_size, world.size, t.gradient_accumulation_steps,
                             t.seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.fsdp.mixed_precision, torch.float32)
    timer = Timer(dtype, args.repeats)
    torch.manual_seed(0)
    # each rank's shard of every parameter (dim 0 split N ways, as FSDP2 shards it)
    optimizer_s = timer.adamw([(-(-s[0] // world.size), *s[1:]) for s in shapes["params"]], t.learning_rate)
    collective_s = (timer.collectives(shapes["units"], cfg.fsdp.sharding_strategy, world.size)
                    if world.size > 1 else 0.0)
    step_times, tokens, parts = [], [], []
    for step in range(args.steps):
        layers = head = attention = 0.0
        step_tokens = sum(len(train_set[i]["input_ids"]) for r in range(world.size)
                          for micro in range(t.gradient_accumulation_steps) for i in plan.rows(step, micro, r))
        for micro in range(t.gradient_accumulation_steps):
            rows = [train_set[i] for i in plan.rows(step, micro, rank)]
            batch = batches.collate(rows, tokenizer.pad_token_id)
            rows_n, seq = batch["input_ids"].shape
            labelled = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            layers += sum(timer.linear(rows_n * seq, i, o) for i, o in shapes["linears"])
            head += timer.linear(labelled, *shapes["head"])
            attention += shapes["layers"] * timer.attention(rows_n, seq, shapes["heads"], shapes["kv_heads"],
                                                            shapes["head_dim"])
        parts.append({"layer_gemms": layers, "head_gemms": head, "attention": attention, "optimizer": optimizer_s}
                     | ({"collectives": collective_s} if world.size > 1 else {}))
        step_times.append(sum(parts[-1].values()))
        tokens.append(step_tokens)
    if world.size > 1:  # the slowest rank's floor of each step, and that rank's parts
        times = torch.tensor(step_times, dtype=torch.float64)
        everyone = [torch.zeros_like(times) for _ in range(world.size)]
        torch.distributed.all_gather(everyone, times)
        slowest = [max(range(world.size), key=lambda r: float(everyone[r][i])) for i in range(args.steps)]
        all_parts = [None] * world.size
        torch.distributed.all_gather_object(all_parts, parts)
        parts = [all_parts[slowest[i]][i] for i in range(args.steps)]
        step_times = [float(everyone[slowest[i]][i]) for i in range(args.steps)]
        torch.distributed.destroy_process_group()
    if rank == 0:
        median = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"step_times_s": step_times, "tokens": tokens, "parts_s": median,
                                         "dtype": str(dtype), "repeats": args.repeats, "world_size": world.size,
                                         "strategy": cfg.fsdp.sharding_strategy}))
        total = statistics.median(step_times)
        print(f"floor of a step on {world.size} rank(s) (median of {args.steps}): {total:.3f} s, "
              + ", ".join(f"{k} {v:.3f} s ({v / total:.0%})" for k, v in median.items()))


if __name__ == "__main__":
    main()
