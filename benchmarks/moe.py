"""Mixture-of-experts: transformers' grouped experts against its loop over the experts (issue 71), side by side in
one invocation.

transformers 5 runs an MoE layer's experts through one interface, chosen per model by
``config._experts_implementation`` (hfsdp's ``model.experts_implementation``): ``grouped_mm`` (its default where
torch has it: the tokens sorted by expert, one ``torch.nn.functional.grouped_mm`` per projection), ``eager`` (a
Python loop over the experts that received tokens, each indexing its slice of the stacked weights) and
``batched_mm`` (every (token, expert) pair's weights gathered, then ``bmm``). Measured, in fp32 on CPU with
``--threads`` intra-op threads (default 1: on the shared 2-core machine two OpenMP threads made the layer many times
slower under load), each part's variants interleaved (the order alternating from one round or step to the next, so
that a slow spell of a shared machine hits all of them), medians over the rounds:

* ``layer``: one Qwen3-MoE sparse MoE block (``Qwen3MoeSparseMoeBlock``: router, softmax top-k, normalised top-k
  weights, SwiGLU experts), forward and backward (input and weight gradients) at each of ``--tokens`` token counts,
  grouped_mm against eager. The default shape is Qwen3-30B-A3B's (hidden 2048, expert intermediate 768, 128 experts,
  top 8) at a quarter of the width and half the experts: hidden 512, expert intermediate 192, 64 experts, top 8.
* ``batched``: the same block at ``--batched-tokens`` tokens with batched_mm beside the other two (it gathers
  ``tokens x top_k`` copies of an expert's weights: skipped, with the reason printed, where that exceeds
  ``--batched-max-gib``).
* ``model``: a tiny Qwen3-MoE causal LM (``--model-*``; default 4 layers, hidden 256, expert intermediate 96,
  64 experts, top 8, vocabulary ``--vocab`` 8192, tied embeddings, router load-balancing loss on as hfsdp trains it)
  trained by a plain torch loop, one model per implementation from the same weights: forward, backward, fused AdamW
  step on the same random batches of ``--batch`` x ``--seq-len`` tokens, the implementations alternating step by
  step; tokens/s over the steps after the first.
* ``plan`` (not in the default ``--parts``): ``hfsdp bench`` of the ``cli`` part's model and config on 2 FSDP2
  ranks at each ``--plan-ep`` expert-parallel size (default 1,2): ``hfsdp plan``'s peak per rank against the
  measured one (target: within 10 %).
* ``cli`` (not in the default ``--parts``): the same tiny model with SmolLM2's tokenizer (so vocabulary 49,152)
  trained by ``python -m hfsdp train`` with ``model.experts_implementation`` set, ``--cli-rounds`` runs per
  implementation alternating, on the bundled contacts task as text packed into rows of ``--seq-len``; tokens_per_s
  from each run's ``metrics.jsonl`` (median over the steps after the first).

Each part checks that the implementations compute the same thing: the layer's output and gradients (largest
difference over the largest magnitude), the model's and the CLI runs' losses step by step (relative), all within
``--tolerance`` (1e-4; exits 1 otherwise). Prints wall-clock and CPU-time (``time.process_time``, the seconds the
process ran: less sensitive to other processes on the machine; with several threads it sums them) medians, the
grouped ÷ eager tokens/s ratios and whether the issue's targets are met (layer at least 2x, whole step at least 1.5x).

    python benchmarks/moe.py [--parts layer,batched,model[,cli]] [--tokens 256,2048] [--rounds 5] [--threads 1]
                             [--hidden 512 --moe-intermediate 192 --experts 64 --top-k 8] [--batched-tokens 32]
                             [--model-layers 4 --model-hidden 256 --model-intermediate 96 --model-experts 64
                              --model-top-k 8 --vocab 8192] [--batch 4 --seq-len 256 --model-steps 6]
                             [--cli-rounds 2 --cli-steps 6 --plan-ep 1,2 --out bench-results/moe]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
PRESET_DATA = REPO / "hfsdp" / "config" / "presets" / "data"
GROUPED, EAGER, BATCHED = "grouped_mm", "eager", "batched_mm"
LAYER_TARGET, STEP_TARGET = 2.0, 1.5  # issue 71: grouped ÷ eager tokens/s, "on this CPU"


def rel_diff(a, b) -> float:
    """Largest absolute difference of ``a`` from ``b`` over ``b``'s largest magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def interleaved(variants: dict, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """``rounds`` calls of each of ``variants`` (name: function), the order reversed every other round: each
    variant's (wall s, CPU s) per round."""
    names = list(variants)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def paired_ratio(slow: list[tuple[float, float]], fast: list[tuple[float, float]]) -> float:
    """The median over rounds of the round's eager ÷ grouped wall time (the two ran next to each other)."""
    return statistics.median(s[0] / f[0] for s, f in zip(slow, fast))


# --- the layer -------------------------------------------------------------------------------------------------


def block_config(args, implementation: str):
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                            num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True)
    config._experts_implementation = implementation
    return config


def build_block(args, implementation: str, reference=None):
    """A ``Qwen3MoeSparseMoeBlock`` running ``implementation``, its weights ``reference``'s, else normal(0, 0.02)
    from seed 0 (a block built alone has uninitialised weights); checks the experts module's implementation."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = block_config(args, implementation)
    block = Qwen3MoeSparseMoeBlock(config)
    if reference is not None:
        block.load_state_dict(reference.state_dict())
    else:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * config.initializer_range)
    got = block.experts.config._experts_implementation
    if got != implementation:
        raise SystemExit(f"asked for experts implementation {implementation}, the built block runs {got}")
    return block


def layer_part(args, tokens: int, implementations: list[str], rounds: int) -> dict:
    """Forward + backward of the block at ``tokens`` tokens for each implementation, interleaved; the largest
    relative difference of each implementation's output and gradients from eager's."""
    import torch

    blocks: dict = {}
    for name in [EAGER, *[i for i in implementations if i != EAGER]]:
        blocks[name] = build_block(args, name, blocks.get(EAGER))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, args.hidden, generator=g).requires_grad_()
    dy = torch.randn(1, tokens, args.hidden, generator=g)

    def step(block):
        x.grad = None
        for p in block.parameters():
            p.grad = None
        block(x).backward(dy)

    results: dict = {}
    for name, block in blocks.items():  # the check, and each variant's warm-up
        step(block)
        with torch.no_grad():
            y = block(x)
        results[name] = [y, x.grad, *(p.grad for p in block.parameters())]
    check = {name: (rel_diff(r[0], results[EAGER][0]), max(rel_diff(a, b) for a, b in zip(r[1:], results[EAGER][1:])))
             for name, r in results.items() if name != EAGER}
    forward: dict[str, list[float]] = {name: [] for name in blocks}

    def timed(name):
        block = blocks[name]

        def run():
            x.grad = None
            for p in block.parameters():
                p.grad = None
            start = time.perf_counter()
            y = block(x)
            forward[name].append(time.perf_counter() - start)
            y.backward(dy)
        return run

    times = interleaved({name: timed(name) for name in implementations}, rounds)
    return {"tokens": tokens, "times": times, "forward": {k: statistics.median(v) for k, v in forward.items()},
            "check": check}


def print_layer(args, results: list[dict], implementations: list[str]) -> list[float]:
    """The layer's table; the grouped ÷ eager tokens/s ratios (of the median wall times)."""
    print("| tokens | implementation | forward ms | forward + backward ms (wall) | CPU ms | tokens/s (wall) | "
          "tokens/s ÷ eager (wall) | paired per-round ratio | ÷ eager (CPU) | max rel diff from eager: output / "
          "gradients |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for r in results:
        eager_wall, eager_cpu = medians(r["times"][EAGER])
        for name in implementations:
            wall, cpu = medians(r["times"][name])
            paired = paired_ratio(r["times"][EAGER], r["times"][name]) if name != EAGER else 1.0
            diff = "-" if name == EAGER else "{:.1e} / {:.1e}".format(*r["check"][name])
            print(f"| {r['tokens']} | {name} | {r['forward'][name] * 1e3:.1f} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | "
                  f"{r['tokens'] / wall:.0f} | {eager_wall / wall:.2f} | {paired:.2f} | {eager_cpu / cpu:.2f} | "
                  f"{diff} |")
            if name == GROUPED:
                ratios.append(eager_wall / wall)
    return ratios


# --- the whole model -------------------------------------------------------------------------------------------


def model_config(args, vocab: int):
    from transformers import AutoConfig

    heads = max(1, args.model_hidden // 64)
    return AutoConfig.for_model("qwen3_moe", **{
        "vocab_size": vocab, "hidden_size": args.model_hidden, "intermediate_size": 4 * args.model_hidden,
        "moe_intermediate_size": args.model_intermediate, "num_experts": args.model_experts,
        "num_experts_per_tok": args.model_top_k, "norm_topk_prob": True, "num_hidden_layers": args.model_layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
        "max_position_embeddings": max(4096, args.seq_len), "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 2})


def matmul_split(args, vocab: int) -> str:
    """The experts' and the output head's shares of a token's matmul multiply-adds."""
    c = model_config(args, vocab)
    h, layers = c.hidden_size, c.num_hidden_layers
    experts = layers * c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
    head = h * vocab
    attention = layers * h * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    router = layers * h * c.num_experts
    total = experts + head + attention + router
    return (f"per token: experts {experts / 1e6:.2f}M multiply-adds ({100 * experts / total:.0f}%), output head "
            f"{head / 1e6:.2f}M ({100 * head / total:.0f}%), attention projections {attention / 1e6:.2f}M, router "
            f"{router / 1e6:.2f}M")


def model_part(args) -> dict:
    """Training steps of the tiny causal LM, one model per implementation, alternating step by step."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict = {}
    for name in (GROUPED, EAGER):
        # a config each: from_config keeps the object it is given and sets the implementation on it, so that a
        # shared one would switch the first model's experts to the second's implementation
        config = model_config(args, args.vocab)
        config.output_router_logits = True  # the load-balancing loss in the loss, as hfsdp trains an MoE by default
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, experts_implementation=name)
        if models:
            model.load_state_dict(models[GROUPED][0].state_dict())
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    for name, (model, _) in models.items():  # (once both are built)
        found = {m.config._experts_implementation for m in model.modules() if hasattr(m, "_is_expert_parallel")}
        if found != {name}:
            raise SystemExit(f"asked for experts implementation {name}, the model's experts run {found}")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)
               for _ in range(args.model_steps + 1)]
    losses: dict[str, list[float]] = {name: [] for name in models}
    current = [batches[0]]

    def step(name):
        def run():
            model, optimizer = models[name]
            loss = model(current[0], labels=current[0]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        return run

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for i, batch in enumerate(batches):  # step 0: the warm-up, not timed
        current[0] = batch
        for name, t in interleaved({name: step(name) for name in (GROUPED, EAGER)[::1 if i % 2 == 0 else -1]},
                                   1).items():
            if i:
                times[name].extend(t)
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses[GROUPED], losses[EAGER]))
    return {"times": times, "losses": losses, "diff": diff,
            "params": sum(p.numel() for p in models[GROUPED][0].parameters())}


def print_model(args, result: dict) -> float:
    tokens = args.batch * args.seq_len
    (gw, gc), (ew, ec) = medians(result["times"][GROUPED]), medians(result["times"][EAGER])
    print("| implementation | step s (wall, median) | CPU s | tokens/s (wall) | tokens/s ÷ eager (wall) | paired "
          "per-step ratio | ÷ eager (CPU) | losses |")
    print("|---|---|---|---|---|---|---|---|")
    for name, wall, cpu in ((GROUPED, gw, gc), (EAGER, ew, ec)):
        paired = paired_ratio(result["times"][EAGER], result["times"][GROUPED]) if name == GROUPED else 1.0
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {tokens / wall:.0f} | {ew / wall:.2f} | {paired:.2f} | "
              f"{ec / cpu:.2f} | {', '.join(f'{x:.6f}' for x in result['losses'][name])} |")
    print(f"losses, grouped_mm against eager, largest relative difference over the {len(result['losses'][GROUPED])} "
          f"steps: {result['diff']:.1e}")
    return ew / gw


# --- the whole model through hfsdp's CLI -----------------------------------------------------------------------


def build_folder(args, folder: Path) -> None:
    """The tiny model (vocabulary 49,152) with SmolLM2's tokenizer, random weights from seed 0, built once."""
    if (folder / "model.safetensors").is_file():
        return
    import torch
    from transformers import AutoModelForCausalLM

    from hfsdp.cli import cache_dir
    from hfsdp.model.loading import _smollm2_tokenizer

    torch.manual_seed(0)
    tmp = folder.with_name(folder.name + ".tmp")
    AutoModelForCausalLM.from_config(model_config(args, 49152)).save_pretrained(tmp, safe_serialization=True)
    _smollm2_tokenizer(cache_dir()).save_pretrained(tmp)
    tmp.rename(folder)


def write_cli_config(args, out: Path, folder: Path) -> Path:
    import yaml

    text = out / "contacts_text.jsonl"
    with open(text, "w") as f:
        for line in (PRESET_DATA / "contacts_train.jsonl").read_text().splitlines():
            f.write(json.dumps({"text": " ".join(m["content"] for m in json.loads(line)["messages"])}) + "\n")
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(folder)},
        "data": {"format": "text", "path": str(text), "max_seq_len": args.seq_len},
        "train": {"output_dir": str(out / "run"), "max_steps": args.cli_steps, "per_device_batch_size": args.batch,
                  "learning_rate": 1e-3,
                  "lr_scheduler": "constant", "log_every": 1, "eval_at_start": False, "export_final": False,
                  "report_to": "none", "loss_plot": False, "seed": 0},
        "plugins": ["packing"],
        "packing": {"max_len": args.seq_len},
    }, sort_keys=False))
    return path


def cli_setup(args) -> tuple[Path, Path, dict[str, str]]:
    """The output folder, the CLI runs' config (the tiny model built once into the folder) and their environment."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    folder = out / (f"qwen3-moe-l{args.model_layers}-h{args.model_hidden}-i{args.model_intermediate}-"
                    f"e{args.model_experts}-k{args.model_top_k}")
    build_folder(args, folder)
    config = write_cli_config(args, out, folder)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    return out, config, env


def cli_part(args) -> dict:
    out, config, env = cli_setup(args)
    runs: dict[str, list[dict]] = {GROUPED: [], EAGER: []}
    for r in range(args.cli_rounds):
        for name in (GROUPED, EAGER) if r % 2 == 0 else (EAGER, GROUPED):
            run_dir = out / f"run-{name}-{r}"
            cmd = [sys.executable, "-m", "hfsdp", "train", str(config), "--overwrite",
                   "--set", f"model.experts_implementation={name}", "--set", f"train.output_dir={run_dir}"]
            done = subprocesses.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.stdout.write(done.stdout + done.stderr)
                raise SystemExit(f"hfsdp train with {name} failed ({done.returncode})")
            (run_dir / "output.txt").write_text(done.stdout + done.stderr)
            reported = re.findall(r"experts: .* layers \((\w+)\)", done.stdout + done.stderr)  # start-up report
            if reported != [name]:
                raise SystemExit(f"asked hfsdp train for experts implementation {name}, its start-up report says "
                                 f"{reported}")
            steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steps = [m for m in steps if "loss" in m and "tokens_per_s" in m]
            runs[name].append({"tokens_per_s": statistics.median(m["tokens_per_s"] for m in steps[1:]),
                               "losses": [m["loss"] for m in steps]})
            print(f"  hfsdp train, {name}, round {r + 1}: {runs[name][-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    pairs = [(a, b) for ga, ea in zip(runs[GROUPED], runs[EAGER]) for a, b in zip(ga["losses"], ea["losses"])]
    return {"runs": runs, "diff": max(abs(a - b) / abs(b) for a, b in pairs)}


def print_cli(result: dict) -> float:
    grouped = statistics.median(r["tokens_per_s"] for r in result["runs"][GROUPED])
    eager = statistics.median(r["tokens_per_s"] for r in result["runs"][EAGER])
    print("| implementation | tokens/s per run (median over its steps after the first) | median | ÷ eager | losses "
          "(first run) |")
    print("|---|---|---|---|---|")
    for name, value in ((GROUPED, grouped), (EAGER, eager)):
        runs = result["runs"][name]
        print(f"| {name} | {', '.join(format(r['tokens_per_s'], '.0f') for r in runs)} | {value:.0f} | "
              f"{value / eager:.2f} | {', '.join(f'{x:.6f}' for x in runs[0]['losses'])} |")
    print(f"losses, grouped_mm against eager, largest relative difference: {result['diff']:.1e}")
    return grouped / eager


# --- the plan against the measured peak, with and without expert parallelism --------------------------------------


def plan_part(args) -> list[dict]:
    """``hfsdp bench`` of the CLI part's model and config on 2 FSDP2 ranks at each of ``--plan-ep``: each row's
    measured peak above the pre-load baseline and ``hfsdp plan``'s prediction for the same config (its sweep
    column, at ``--seq-len``)."""
    out, config, env = cli_setup(args)
    rows = []
    for ep in [int(e) for e in args.plan_ep.split(",")]:
        bench_out = out / f"bench-ep{ep}"
        cmd = [sys.executable, "-m", "hfsdp", "bench", str(config), "--nproc", "2", "--strategies", "FULL_SHARD",
               "--steps", str(args.cli_steps), "--seq-lens", str(args.seq_len), "--out", str(bench_out),
               "--set", "fsdp.version=2", "--set", f"parallel.ep_size={ep}"]
        done = subprocesses.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.stdout.write(done.stdout + done.stderr)
            raise SystemExit(f"hfsdp bench at ep {ep} failed ({done.returncode})")
        row = json.loads((bench_out / "bench.json").read_text())["rows"][0]
        if row.get("plan_peak_mib") is None:
            sys.stdout.write(done.stdout + done.stderr)
            raise SystemExit(f"hfsdp bench at ep {ep} has no plan column: {row.get('plan_problem') or 'see above'}")
        rows.append({"ep": ep, **{k: row.get(k) for k in ("plan_peak_mib", "mem_peak_above_base_mib",
                                                          "plan_vs_measured", "tokens_per_s")}})
        print(f"  hfsdp bench, ep {ep}: plan {row.get('plan_peak_mib') or 0:.0f} MiB, measured "
              f"{row['mem_peak_above_base_mib']:.0f} MiB", flush=True)
    return rows


def print_plan(rows: list[dict]) -> float:
    print("| ep | plan peak MiB/rank | measured peak above base MiB/rank | plan ÷ measured | tokens/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ep']} | {r['plan_peak_mib']:.0f} | {r['mem_peak_above_base_mib']:.0f} | "
              f"{r['plan_vs_measured']:.3f} | {r['tokens_per_s']:.0f} |")
    return max(abs(r["plan_vs_measured"] - 1) for r in rows)


# ---------------------------------------------------------------------------------------------------------------


def met(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x, target >= {target}x: {'met' if ratio >= target else 'NOT met'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="layer,batched,model",
                   help="comma-separated: layer, batched, model, cli, plan")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (OMP_NUM_THREADS of the CLI runs)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the layer parts")
    p.add_argument("--tolerance", type=float, default=1e-4)
    layer = p.add_argument_group("layer")
    layer.add_argument("--tokens", default="256,2048", help="comma-separated token counts")
    layer.add_argument("--hidden", type=int, default=512)
    layer.add_argument("--moe-intermediate", type=int, default=192)
    layer.add_argument("--experts", type=int, default=64)
    layer.add_argument("--top-k", type=int, default=8)
    layer.add_argument("--batched-tokens", type=int, default=32)
    layer.add_argument("--batched-max-gib", type=float, default=2.0,
                       help="skip batched_mm where its gathered expert weights would exceed this")
    model = p.add_argument_group("model")
    model.add_argument("--model-layers", type=int, default=4)
    model.add_argument("--model-hidden", type=int, default=256)
    model.add_argument("--model-intermediate", type=int, default=96)
    model.add_argument("--model-experts", type=int, default=64)
    model.add_argument("--model-top-k", type=int, default=8)
    model.add_argument("--vocab", type=int, default=8192, help="the model part's vocabulary (the CLI's: 49,152)")
    model.add_argument("--batch", type=int, default=4)
    model.add_argument("--seq-len", type=int, default=256)
    model.add_argument("--model-steps", type=int, default=6, help="timed steps per implementation (after one)")
    model.add_argument("--cli-rounds", type=int, default=2, help="hfsdp train runs per implementation")
    model.add_argument("--cli-steps", type=int, default=6)
    model.add_argument("--plan-ep", default="1,2", help="the plan part's expert-parallel sizes (2 ranks)")
    model.add_argument("--out", type=Path, default=Path("bench-results/moe"))
    args = p.parse_args()
    parts = set(args.parts.split(","))
    known = {"layer", "batched", "model", "cli", "plan"}
    if parts - known:
        p.error(f"unknown parts: {', '.join(sorted(parts - known))}")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} intra-op thread(s), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; fp32", flush=True)
    failures, verdicts = [], []

    def check(what: str, diff: float) -> None:
        if diff > args.tolerance:
            failures.append(f"{what}: {diff:.1e} > {args.tolerance:g}")

    if parts & {"layer", "batched"}:
        print(f"\nlayer: Qwen3MoeSparseMoeBlock, hidden {args.hidden}, expert intermediate {args.moe_intermediate}, "
              f"{args.experts} experts, top {args.top_k} (normalised); forward + backward (input and weight "
              f"gradients), medians of {args.rounds} interleaved rounds", flush=True)
    if "layer" in parts:
        results = []
        for tokens in [int(t) for t in args.tokens.split(",")]:
            results.append(layer_part(args, tokens, [GROUPED, EAGER], args.rounds))
            check(f"layer at {tokens} tokens", max(results[-1]["check"][GROUPED]))
        ratios = print_layer(args, results, [GROUPED, EAGER])
        verdicts.append(f"layer, grouped_mm ÷ eager tokens/s at {args.tokens} tokens: "
                        + "; ".join(met(r, LAYER_TARGET) for r in ratios))
    if "batched" in parts and args.batched_tokens:
        pairs = args.batched_tokens * args.top_k
        gathered = pairs * 3 * args.hidden * args.moe_intermediate * 4 / 2**30
        if gathered > args.batched_max_gib:
            print(f"\nbatched_mm skipped: {args.batched_tokens} tokens x top {args.top_k} gather {gathered:.1f} GiB of "
                  f"expert weights (> --batched-max-gib {args.batched_max_gib:g})")
        else:
            print(f"\nbatched_mm beside them at {args.batched_tokens} tokens (it gathers {gathered:.2f} GiB of expert "
                  f"weights: one copy per (token, expert) pair), {max(3, args.rounds // 2)} rounds:", flush=True)
            result = layer_part(args, args.batched_tokens, [GROUPED, EAGER, BATCHED], max(3, args.rounds // 2))
            for name, diffs in result["check"].items():
                check(f"{name} at {args.batched_tokens} tokens", max(diffs))
            print_layer(args, [result], [GROUPED, EAGER, BATCHED])
    if "model" in parts:
        print(f"\nmodel: tiny Qwen3-MoE causal LM, {args.model_layers} layers, hidden {args.model_hidden}, expert "
              f"intermediate {args.model_intermediate}, {args.model_experts} experts, top {args.model_top_k}, vocabulary "
              f"{args.vocab} (tied), router load-balancing loss x 0.001; fused AdamW; {args.batch} x {args.seq_len} "
              f"random tokens a step, {args.model_steps} timed steps per implementation after one, alternating",
              flush=True)
        print(matmul_split(args, args.vocab), flush=True)
        result = model_part(args)
        print(f"{result['params'] / 1e6:.1f}M parameters")
        check("model losses", result["diff"])
        verdicts.append(f"whole training step (plain torch loop), grouped_mm ÷ eager tokens/s: "
                        f"{met(print_model(args, result), STEP_TARGET)}")
    if "cli" in parts:
        print(f"\ncli: python -m hfsdp train, the same model with SmolLM2's tokenizer (vocabulary 49152), the contacts "
              f"task as text packed into rows of {args.seq_len}, {args.batch} rows a step, {args.cli_steps} steps, "
              f"{args.cli_rounds} runs per implementation alternating, OMP_NUM_THREADS={args.threads}", flush=True)
        print(matmul_split(args, 49152), flush=True)
        result = cli_part(args)
        check("hfsdp train losses", result["diff"])
        verdicts.append(f"whole training step (hfsdp train), grouped_mm ÷ eager tokens/s: "
                        f"{met(print_cli(result), STEP_TARGET)}")
    if "plan" in parts:
        print(f"\nplan: hfsdp bench of the cli part's model and config on 2 FSDP2 ranks, FULL_SHARD, {args.cli_steps} "
              f"steps, at parallel.ep_size {args.plan_ep}: hfsdp plan's peak per rank against the measured (peak RSS "
              "during the steps above the RSS before loading)", flush=True)
        worst = print_plan(plan_part(args))
        verdicts.append(f"plan within {worst:.1%} of the measured peak at ep {args.plan_ep} (target within 10 %: "
                        f"{'met' if worst <= 0.10 else 'NOT met'})")
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    for line in verdicts:
        print(line)
    print("implementations agree within " + (f"{args.tolerance:g}: yes" if not failures else
                                               f"{args.tolerance:g}: NO: " + "; ".join(failures)))
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
