"""The step's layer GEMMs three ways, per GEMM: hot, in the step's order over distinct weights, and inside the model.

For one micro-batch of the peer work (``benchmarks/peers.yaml``, its ``--step``: hfsdp's rows, ``BatchPlan`` order,
the collated shape), each decoder Linear's three GEMMs (forward ``x @ W.T``, the input's gradient ``dy @ W``, the
weight's gradient ``dy.T @ x``), summed over the layers and grouped by (kind, fan-in, fan-out):

* ``hot``: as ``benchmarks/floor.py`` timed them until issue 56 part 4: one weight per shape, each GEMM alone, the
  fastest of ``--repeats`` after a warm-up (the weight and the operands stay in cache), times the layers;
* ``sequence``: every layer's own weight, input and output gradient (distinct random tensors), the GEMMs in the
  step's order (forward layer 0..L-1, then backward L-1..0, each Linear's input gradient then its weight gradient),
  each timed inside the sequence, each GEMM's fastest of ``--rounds``. ``--out-buffers`` writes every
  result into a buffer made beforehand (no allocation); by default each result is a new tensor kept to the
  sequence's end, as a step keeps its activations and gradients;
* ``model``: the real model's forward (its own loss) and backward on that micro-batch, every ``aten::mm`` timed as
  it runs (a dispatch mode around it), each GEMM's fastest of ``--rounds``; ``--profile`` adds the
  same GEMMs' self times under ``torch.profiler``.

    OMP_NUM_THREADS=1 python benchmarks/gemm_memory.py [--step 0] [--repeats 5] [--rounds 3] [--json out.json]

Also counts the minor page faults of each (``getrusage``): memory the kernel hands the process on first touch.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import time
from pathlib import Path

from floor import best_of  # benchmarks/, next to this file: the floor's own timing


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def per_op_min(runs: list[list[tuple[str, float]]]) -> dict[str, float]:
    """Each op's fastest of the runs (the same ops in the same order), summed by key."""
    parts = collections.Counter()
    for ops in zip(*runs):
        parts[ops[0][0]] += min(t for _, t in ops)
    return dict(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(Path(__file__).with_name("peers.yaml")))
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-buffers", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--flush-denormal", action="store_true")
    parser.add_argument("--skip", default="", help="comma-separated: hot,sequence,model")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hfsdp.cli import cache_dir
    from hfsdp.config.files import load_config
    from hfsdp.data import batches
    from hfsdp.data.prepare import prepare_datasets
    from hfsdp.model import loading

    if args.flush_denormal:
        torch.set_flush_denormal(True)
    skip = set(filter(None, args.skip.split(",")))
    cfg, host = load_config(args.config, args.overrides)
    path = loading.resolve_model_path(cfg.model.name_or_path, cache_dir())
    tokenizer = loading.load_tokenizer(path, cfg.model)
    train_set = prepare_datasets(cfg, host, tokenizer, cache_dir())[0]
    t = cfg.train
    plan = batches.BatchPlan(len(train_set), t.per_device_batch_size, 1, t.gradient_accumulation_steps, t.seed)
    batch = batches.collate([train_set[i] for i in plan.rows(args.step, 0, 0)], tokenizer.pad_token_id)
    rows, seq = batch["input_ids"].shape
    tokens = rows * seq
    model = loading.load_model(path, cfg.model)
    model.train()
    layers = model.get_decoder().layers
    linears = [(m.in_features, m.out_features) for m in layers[0].modules() if isinstance(m, torch.nn.Linear)]
    n_layers = len(layers)
    print(f"threads {torch.get_num_threads()}, micro-batch {rows} x {seq} = {tokens} positions, {n_layers} layers, "
          f"Linears (in, out) {linears}", flush=True)
    g = torch.Generator().manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    result = {"tokens": tokens, "layers": n_layers, "threads": torch.get_num_threads()}

    def key(kind, i, o):
        return f"{kind} {i}x{o}"

    # hot: one weight per shape, each GEMM the fastest of --repeats calls, times the layers
    hot_tensors = [(randn(tokens, i), randn(o, i), randn(tokens, o)) for i, o in linears]

    def hot_pass():
        ops = []
        for (i, o), (x, w, dy) in zip(linears, hot_tensors):
            ops += [(key("fwd", i, o), n_layers * best_of(lambda: torch.nn.functional.linear(x, w), args.repeats)),
                    (key("dgrad", i, o), n_layers * best_of(lambda: torch.mm(dy, w), args.repeats)),
                    (key("wgrad", i, o), n_layers * best_of(lambda: torch.mm(dy.t(), x), args.repeats))]
        return ops

    # sequence: distinct tensors of every layer, the step's order
    ws = [[randn(o, i) for i, o in linears] for _ in range(n_layers)]
    xs = [[randn(tokens, i) for i, o in linears] for _ in range(n_layers)]
    dys = [[randn(tokens, o) for i, o in linears] for _ in range(n_layers)]
    bufs = [[(torch.empty(tokens, o), torch.empty(tokens, i), torch.empty(o, i)) for i, o in linears]
            for _ in range(n_layers)] if args.out_buffers else None

    def sequence_pass():
        ops, kept = [], []
        for layer in range(n_layers):
            for j, (i, o) in enumerate(linears):
                a = time.perf_counter()
                if bufs:
                    torch.mm(xs[layer][j], ws[layer][j].t(), out=bufs[layer][j][0])
                else:
                    kept.append(torch.nn.functional.linear(xs[layer][j], ws[layer][j]))
                ops.append((key("fwd", i, o), time.perf_counter() - a))
        for layer in reversed(range(n_layers)):
            for j in reversed(range(len(linears))):
                i, o = linears[j]
                w, x, dy = ws[layer][j], xs[layer][j], dys[layer][j]
                a = time.perf_counter()
                if bufs:
                    torch.mm(dy, w, out=bufs[layer][j][1])
                else:
                    kept.append(torch.mm(dy, w))
                b = time.perf_counter()
                if bufs:
                    torch.mm(dy.t(), x, out=bufs[layer][j][2])
                else:
                    kept.append(torch.mm(dy.t(), x))
                c = time.perf_counter()
                ops += [(key("dgrad", i, o), b - a), (key("wgrad", i, o), c - b)]
        return ops

    # model: the real forward and backward, every aten::mm timed
    shapes = {(i, o) for i, o in linears}

    class TimeMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if func is not torch.ops.aten.mm.default:
                return func(*a, **(kw or {}))
            start = time.perf_counter()
            out = func(*a, **(kw or {}))
            dt = time.perf_counter() - start
            (m, k), (_, n) = a[0].shape, a[1].shape
            if m == tokens and (k, n) in shapes and not a[1].is_contiguous():  # x @ W.t()
                self.ops.append((key("fwd", k, n), dt))
            elif m == tokens and (n, k) in shapes and a[1].is_contiguous():  # dy @ W
                self.ops.append((key("dgrad", n, k), dt))
            elif k == tokens and (n, m) in shapes:  # dy.t() @ x
                self.ops.append((key("wgrad", n, m), dt))
            else:
                self.ops.append(("other mm (head)", dt))
            return out

    inputs = batches.model_inputs(batch)

    def model_pass():
        mode = TimeMM()
        with mode:
            model(**inputs, labels=batch["labels"]).loss.backward()
        model.zero_grad(set_to_none=True)
        return mode.ops

    passes = {"hot": hot_pass, "sequence": sequence_pass, "model": model_pass}
    passes = {name: fn for name, fn in passes.items() if name not in skip}
    runs = {name: [] for name in passes}
    walls = {name: [] for name in passes}
    faults = {name: [] for name in passes}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, fn in passes.items():
            f0, t0 = minflt(), time.perf_counter()
            ops = fn()
            if r:
                runs[name].append(ops)
                walls[name].append(time.perf_counter() - t0)
                faults[name].append(minflt() - f0)
        print(f"round {r}: " + ", ".join(f"{n} {sum(t for k, t in runs[n][-1] if k[0] != 'o'):.3f} s"
                                         for n in passes if r), flush=True)
    for name in passes:
        best = per_op_min(runs[name])
        result[name + "_other"] = best.pop("other mm (head)", 0.0)
        result[name] = best
        result[name + "_rounds_s"] = [sum(t for k, t in ops if k[0] != "o") for ops in runs[name]]
        result[name + "_wall_s"] = walls[name]
        result[name + "_minflt"] = faults[name]
        print(f"{name}: layer GEMMs, each its fastest of {args.rounds} rounds, {sum(best.values()):.3f} s; per round "
              f"{', '.join(f'{x:.3f}' for x in result[name + '_rounds_s'])} s; pass wall "
              f"{', '.join(f'{x:.2f}' for x in walls[name])} s; minor faults {faults[name]}", flush=True)
    if args.profile and "model" not in skip:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model(**inputs, labels=batch["labels"]).loss.backward()
        model.zero_grad(set_to_none=True)
        prof_parts = collections.Counter()
        for ev in prof.key_averages(group_by_input_shape=True):
            if ev.key != "aten::mm" or len(ev.input_shapes) < 2 or len(ev.input_shapes[0]) != 2:
                continue
            (m, k), (_, n) = ev.input_shapes[0], ev.input_shapes[1]
            s = ev.self_cpu_time_total / 1e6
            if m == tokens and ((k, n) in shapes or (n, k) in shapes):  # forward and input gradient alike
                prof_parts[key("fwd+dgrad", min(k, n), max(k, n))] += s
            elif k == tokens and (n, m) in shapes:
                prof_parts[key("wgrad", n, m)] += s
        result["profiler"] = dict(prof_parts)
        print(f"profiler (one forward + backward, after the rounds): {sum(prof_parts.values()):.3f} s in layer GEMMs",
              flush=True)

    cols = [c for c in ("hot", "sequence", "model", "profiler") if c in result]
    keys = sorted({k for c in cols for k in result[c]}, key=lambda s: (s.split()[1], s.split()[0]))
    print("| GEMM (all layers) | " + " | ".join(f"{c} ms" for c in cols) + " |")
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{1e3 * result[c].get(k, 0):.1f}" for c in cols) + " |")
    print("| total | " + " | ".join(f"{1e3 * sum(result[c].values()):.1f}" for c in cols) + " |")
    if "hot" in result:
        print("ratios to hot: " + ", ".join(f"{c} {sum(result[c].values()) / sum(result['hot'].values()):.3f}"
                                            for c in cols[1:]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
