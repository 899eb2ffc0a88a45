"""How accurate is `hfsdp plan`? One run measures it against real jobs and writes DIR/plan_accuracy.md and .json.

    python benchmarks/plan_accuracy.py [--out DIR] [--parts state,peak,grpo]

1. state: parameter + gradient + optimizer bytes per rank that plan predicts, against the bytes `hfsdp bench`'s
   bench_probe counts from live tensors, for FULL_SHARD / SHARD_GRAD_OP / NO_SHARD / HYBRID_SHARD x 1, 2, 4 ranks x
   FSDP1 / FSDP2 x full fine-tune / LoRA on the shrunk SmolLM2 (`smollm2-tiny`). Target: within 1 %.
   Combinations that cannot run are listed with the reason plan gives (FSDP1 HYBRID_SHARD needs a GPU; FSDP1 LoRA
   on a single shard of a tied-embedding model is refused by the lora plugin).
2. peak: predicted peak memory per rank against bench's measured peak during the steps, over max_seq_len {128, 256}
   x micro-batch {1, 2} x activation checkpointing off/on x FULL_SHARD / NO_SHARD at 2 ranks on `smollm2-bench`
   (75M parameters). Target: within 10 %. On CPU the measure is the peak RSS during the steps above the RSS before
   the model is loaded (bench's "peak above base"), with glibc returning freed memory to the OS (bench's
   MALLOC_RETURNS_FREED settings on CPU), so that RSS follows live tensors; plan is asked for the
   CPU optimizer (AdamW loops over parameters on CPU instead of its multi-tensor path).
   On a GPU host, `--parts gpu` runs the same grid on one GPU (SmolLM2-135M-Instruct, bf16 mixed precision,
   max_seq_len {1024, 2048}) against `torch.cuda.max_memory_allocated`.
3. grpo: the peak of GRPO steps (plugin grpo: sampling the global batch's completions with the KV cache, then
   training on prompts plus completions) on 2 ranks of `smollm2-bench`, completions of {32, 128} tokens x {4, 8}
   completions per micro-batch x FULL_SHARD / NO_SHARD, in the peak table. Target: within 10 %, as SFT.
4. side by side, on the peak grid's configs and the LoRA ones: `accelerate estimate-memory`'s arithmetic (its own
   functions: calculate_maximum_sizes + estimate_training_usage, the "Training using Adam" column) and DeepSpeed's
   ZeRO-3 formula (estimate_zero3_model_states_mem_needs: 4 x largest layer + 18 x parameters / GPUs), against the
   measured figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hfsdp.cli import cache_dir  # noqa: E402
from hfsdp.config.files import load_config  # noqa: E402
from hfsdp.model.loading import architecture_config  # noqa: E402
from hfsdp.tools.plan.planner import Planner  # noqa: E402
from hfsdp.units import MIB  # noqa: E402
from hfsdp.tools.plan.estimate import setup_from_config  # noqa: E402

DATA = REPO / "hfsdp" / "config" / "presets" / "data"
REUSE = False  # --reuse: run nothing, read back what an earlier run measured into --out


def write_yaml(path: Path, data: dict) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def bench(config: Path, strategy: str, nproc: int, out: Path, sets: list[str], env: dict[str, str],
          steps: int) -> dict | None:
    """One `hfsdp bench` combination; its table row, or None with the log kept when it failed. With --reuse,
    nothing runs: what an earlier run measured into the same folder is read back (None where it measured nothing)."""
    if REUSE:
        done = out / "bench.json"
        return json.loads(done.read_text())["rows"][0] if done.is_file() else None
    cmd = [sys.executable, "-m", "hfsdp", "bench", str(config), "--strategies", strategy, "--nproc", str(nproc),
           "--steps", str(steps), "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    proc = subprocesses.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        (out / "failed.txt").write_text(proc.stdout[-3000:] + proc.stderr[-6000:])
        return None
    return json.loads((out / "bench.json").read_text())["rows"][0]


_PLANNERS: dict[tuple, Planner] = {}


def _why_not(run: Path) -> str:
    if (run / "failed.txt").is_file():
        errors = [line.split("]: ", 1)[-1] for line in (run / "failed.txt").read_text().splitlines()
                  if "Error: " in line and "ChildFailedError" not in line and "bench run" not in line]
        return "the run failed: " + (errors[-1][:200] if errors else "see failed.txt")
    return "not measured"


def predict(config: Path, sets: list[str], strategy: str, nproc: int, on_cpu: bool):
    cfg, _ = load_config(str(config), sets)
    # One planner (meta model and traces) per config that differs in more than its fsdp section.
    key = (str(config), tuple(s for s in sets if not s.startswith("fsdp.")))
    if key not in _PLANNERS:
        _PLANNERS[key] = Planner(architecture_config(cfg.model.name_or_path, cfg.model, cache_dir()), cfg,
                                 budget=1 << 50)
    planner = _PLANNERS[key]
    setup = setup_from_config(cfg, strategy, nproc, 1)
    if on_cpu:
        setup = setup.changed(multi_tensor_adam=False)
    return planner.estimate(setup), planner


# ---- 1. state bytes


def state_grid(out: Path, env: dict[str, str]) -> list[dict]:
    base = {
        "model": {"name_or_path": "smollm2-tiny"},
        "data": {"format": "chat", "path": str(DATA / "contacts_train.jsonl"), "max_seq_len": 96},
        "train": {"output_dir": str(out / "unused"), "max_steps": 2, "per_device_batch_size": 2, "log_every": 1},
    }
    rows = []
    for version in (1, 2):
        for lora in (False, True):
            config = write_yaml(out / f"fsdp{version}{'-lora' if lora else ''}.yaml",
                                {**base, "fsdp": {"version": version}, "plugins": ["lora"] if lora else []})
            for nproc in (1, 2, 4):
                for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
                    sets = [f"fsdp.hybrid_shard_size={max(1, nproc // 2)}"] if strategy == "HYBRID_SHARD" else []
                    label = f"FSDP{version} {'LoRA' if lora else 'full'} {strategy} x{nproc}"
                    est, planner = predict(config, [f"fsdp.sharding_strategy={strategy}", *sets], strategy, nproc,
                                           True)
                    row = {"label": label, "version": version, "lora": lora, "strategy": strategy, "nproc": nproc,
                           "plan_params": est.params, "plan_grads": est.grads, "plan_optim": est.optimizer}
                    reason = est.problem or ("FSDP1 HYBRID_SHARD needs a GPU (CPU rehearsal refuses it)"
                                             if version == 1 and strategy == "HYBRID_SHARD" else None)
                    if reason:
                        rows.append({**row, "skipped": reason})
                        print(f"state: {label}: not run ({reason})", flush=True)
                        continue
                    t0 = time.perf_counter()
                    measured = bench(config, strategy, nproc, out / "runs" / label.replace(" ", "_"), sets, env, 2)
                    if measured is None:
                        rows.append({**row, "skipped": _why_not(out / "runs" / label.replace(" ", "_"))})
                        continue
                    row.update(bench_params=measured["param_bytes"], bench_grads=measured["grad_bytes"],
                               bench_optim=measured["optim_bytes"])
                    row["bench_state"] = row["bench_params"] + row["bench_grads"] + row["bench_optim"]
                    row["ratio"] = est.state / row["bench_state"]
                    row.update(others(planner, est))
                    rows.append(row)
                    print(f"state: {label}: plan/bench p+g+o {row['ratio']:.4f} ({time.perf_counter() - t0:.0f} s)",
                          flush=True)
    return rows


# ---- 2. peak memory


def long_text_data(path: Path, rows: int = 64, words: int = 600) -> Path:
    """Rows long enough that every sample is truncated to max_seq_len, so every micro-batch is full."""
    import random

    rng = random.Random(0)
    vocab = "the of and to in is was for on that with as by at from his her it an are this which be or".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n"
                            for _ in range(rows)))
    return path


def peak_grid(out: Path, env: dict[str, str], on_cpu: bool = True) -> list[dict]:
    """On CPU: 2 ranks of smollm2-bench in fp32. On a GPU (`--parts gpu`, one GPU): 1 rank of the real
    SmolLM2-135M-Instruct with bf16 mixed precision, against torch.cuda.max_memory_allocated."""
    out.mkdir(parents=True, exist_ok=True)
    data = long_text_data(out / "long_text.jsonl", words=3000 if not on_cpu else 600)
    config = write_yaml(out / "peak.yaml", {
        "model": {"name_or_path": "smollm2-bench" if on_cpu else "smollm2-135m-instruct"},
        "data": {"format": "text", "path": str(data), "max_seq_len": 128},
        "train": {"output_dir": str(out / "unused"), "max_steps": 3, "per_device_batch_size": 1, "log_every": 1},
        "fsdp": {"version": 2, "mixed_precision": "no" if on_cpu else "bf16"},
    })
    nproc, seqs = (2, (128, 256)) if on_cpu else (1, (1024, 2048))
    combos = [(f"{strategy} seq {seq} mb {batch} AC {'on' if ac else 'off'}", strategy,
               [f"data.max_seq_len={seq}", f"train.per_device_batch_size={batch}",
                f"fsdp.activation_checkpointing={str(ac).lower()}"], {"seq": seq, "batch": batch, "ac": ac})
              for seq in seqs for batch in (1, 2) for ac in (False, True) for strategy in ("FULL_SHARD", "NO_SHARD")]
    return peak_rows(config, combos, out, env, on_cpu, nproc)


def grpo_grid(out: Path, env: dict[str, str]) -> list[dict]:
    """GRPO (plugin grpo) on 2 ranks of smollm2-bench in fp32: completions of {32, 128} tokens (the random model
    never stops early) x {4, 8} completions per micro-batch x FULL_SHARD / NO_SHARD; each rank generates its
    micro-batch's completions with the KV cache, then trains on its micro-batch of prompts plus completions."""
    config = write_yaml(out / "grpo.yaml", {
        "model": {"name_or_path": "smollm2-bench"},
        "plugins": ["grpo"],
        "data": {"format": "prompt", "path": str(DATA / "contacts_prompts_train.jsonl"), "max_seq_len": 96},
        "grpo": {"num_generations": 4, "rewards": [{"name": "json_fields"}]},
        "train": {"output_dir": str(out / "unused"), "max_steps": 3, "log_every": 1},
        "fsdp": {"version": 2, "mixed_precision": "no"},
    })
    combos = [(f"GRPO {strategy} new {new} mb {batch}", strategy,
               [f"grpo.max_new_tokens={new}", f"train.per_device_batch_size={batch}"],
               {"seq": 96 + new, "batch": batch, "ac": False})
              for new in (32, 128) for batch in (4, 8) for strategy in ("FULL_SHARD", "NO_SHARD")]
    return peak_rows(config, combos, out, env, True, 2)


def peak_rows(config: Path, combos: list[tuple[str, str, list[str], dict]], out: Path, env: dict[str, str],
              on_cpu: bool, nproc: int) -> list[dict]:
    """Plan's peak and bench's measured peak of each (label, strategy, overrides, fields) combination."""
    rows = []
    for label, strategy, sets, fields in combos:
        est, planner = predict(config, [*sets, f"fsdp.sharding_strategy={strategy}"], strategy, nproc, on_cpu)
        t0 = time.perf_counter()
        measured = bench(config, strategy, nproc, out / "runs" / label.replace(" ", "_"), sets, env, 3)
        row = {"label": label, "device": "cpu" if on_cpu else "gpu", "strategy": strategy, **fields,
               "plan_peak": est.device_peak, "plan_state": est.state,
               "plan_activations": est.activations + est.loss_transient, "plan_gathered": est.gathered,
               "plan_sampling": est.generation}
        if measured is None:
            rows.append({**row, "skipped": _why_not(out / "runs" / label.replace(" ", "_"))})
            continue
        # CPU: peak RSS above the pre-load RSS; GPU: max_memory_allocated (bench's same column).
        row.update(measured_peak=measured["mem_peak_above_base_mib"] * MIB,
                   measured_peak_abs=measured["mem_peak_mib"] * MIB,
                   measured_state=measured["state_bytes"])
        row["ratio"] = row["plan_peak"] / row["measured_peak"]
        row.update(others(planner, est))
        rows.append(row)
        print(f"peak: {label}: plan {est.device_peak / MIB:.0f} MiB, measured "
              f"{row['measured_peak'] / MIB:.0f} MiB above base, ratio {row['ratio']:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


# ---- 3. the other estimators


def others(planner: Planner, est) -> dict:
    """accelerate estimate-memory's and DeepSpeed ZeRO-3's figures for the same model and world size."""
    import torch
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(planner.model_config, dtype=torch.float32)
    total_size, _ = calculate_maximum_sizes(model)
    accelerate_adam = max(estimate_training_usage(total_size, "float32").values())
    # DeepSpeed's largest layer: the most parameters any one module holds directly.
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    params = sum(p.numel() for p in model.parameters())
    deepspeed_zero3 = 4 * largest + int(18 * params / est.setup.world)  # no offload
    return {"accelerate": accelerate_adam, "deepspeed_zero3": deepspeed_zero3}


# ---- report


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def report(state: list[dict], peak: list[dict]) -> str:
    lines = ["# hfsdp plan accuracy", ""]
    if state:
        ran = [r for r in state if "ratio" in r]
        worst = max((abs(r["ratio"] - 1) for r in ran), default=float("nan"))
        lines += ["## Parameters + gradients + optimizer bytes per rank (largest rank), plan vs live tensors",
                  "", f"{len(ran)} combinations run; largest deviation {100 * worst:.3f} % (target 1 %).", "",
                  "| combination | plan p / g / o MiB | bench p / g / o MiB | plan ÷ bench |", "|---|---|---|---|"]
        for r in state:
            p = f"{_mib(r['plan_params'])} / {_mib(r['plan_grads'])} / {_mib(r['plan_optim'])}"
            if "ratio" in r:
                b = f"{_mib(r['bench_params'])} / {_mib(r['bench_grads'])} / {_mib(r['bench_optim'])}"
                lines.append(f"| {r['label']} | {p} | {b} | {r['ratio']:.4f} |")
            else:
                lines.append(f"| {r['label']} | {p} | not run: {r['skipped']} | - |")
        lora = [r for r in ran if r["lora"] and r["strategy"] == "FULL_SHARD" and r["nproc"] > 1]
        lines += ["", "LoRA model states against the other estimators (neither knows LoRA or FSDP1's padding):", "",
                  "| combination | bench p+g+o MiB | hfsdp plan | accelerate estimate-memory (fp32 Adam) "
                  "| DeepSpeed ZeRO-3 formula |", "|---|---|---|---|---|"]
        for r in lora:
            m = r["bench_state"]
            lines.append(f"| {r['label']} | {_mib(m)} | {_mib(m * r['ratio'])} ({r['ratio']:.3f}x) | "
                         f"{_mib(r['accelerate'])} ({r['accelerate'] / m:.1f}x) | "
                         f"{_mib(r['deepspeed_zero3'])} ({r['deepspeed_zero3'] / m:.1f}x) |")
        lines.append("")
    if peak:
        ran = [r for r in peak if "ratio" in r]
        worst = max((abs(r["ratio"] - 1) for r in ran), default=float("nan"))
        lines += ["## Peak memory per rank during the steps", "",
                  f"{len(ran)} combinations; largest deviation {100 * worst:.1f} % (target 10 %). CPU rows (seq 128 "
                  "and 256): 2 ranks of smollm2-bench (75M), FSDP2 fp32, peak RSS during the steps above the RSS "
                  "before the model is loaded, glibc returning freed memory."
                  + (" GPU rows (seq 1024 and 2048): 1 rank of SmolLM2-135M-Instruct, bf16 mixed precision, "
                     "torch.cuda.max_memory_allocated." if any(r.get("device") == "gpu" for r in peak) else "")
                  + (" GRPO rows: the same, prompts of up to 96 tokens and completions of 32 or 128 (every rank "
                     "samples the global batch's), `sampling` the planned moment of generation."
                     if any(r["label"].startswith("GRPO") for r in peak) else ""), "",
                  "| combination | plan state / activations+loss / gathered MiB | plan peak MiB | measured peak MiB "
                  "| plan ÷ measured |", "|---|---|---|---|---|"]
        for r in peak:
            parts = f"{_mib(r['plan_state'])} / {_mib(r['plan_activations'])} / {_mib(r['plan_gathered'])}"
            parts += f" (sampling {_mib(r['plan_sampling'])})" if r.get("plan_sampling") else ""
            if "ratio" in r:
                lines.append(f"| {r['label']} | {parts} | {_mib(r['plan_peak'])} | {_mib(r['measured_peak'])} "
                             f"| {r['ratio']:.3f} |")
            else:
                lines.append(f"| {r['label']} | {parts} | {_mib(r['plan_peak'])} | not run: {r['skipped']} | - |")
        lines += ["", "## Side by side: the other estimators on the same runs", "",
                  "| combination | measured p+g+o MiB | measured peak MiB | hfsdp plan peak | accelerate estimate-memory "
                  "(fp32 Adam) | DeepSpeed ZeRO-3 formula |", "|---|---|---|---|---|---|"]
        for r in ran:
            m = r["measured_peak"]
            lines.append(f"| {r['label']} | {_mib(r['measured_state'])} | {_mib(m)} | {_mib(r['plan_peak'])} "
                         f"({r['plan_peak'] / m:.2f}x) | {_mib(r['accelerate'])} ({r['accelerate'] / m:.2f}x) | "
                         f"{_mib(r['deepspeed_zero3'])} ({r['deepspeed_zero3'] / m:.2f}x) |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("plan_accuracy"))
    parser.add_argument("--parts", default="state,peak", help="state, peak (CPU), grpo (CPU), gpu (one CUDA GPU)")
    parser.add_argument("--reuse", action="store_true",
                        help="run nothing: read back the measurements an earlier run left in --out and recompute "
                             "the predictions and the report")
    args = parser.parse_args()
    global REUSE
    REUSE = args.reuse
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    parts = args.parts.split(",")
    peak = peak_grid(args.out / "peak", env) if "peak" in parts else []
    if "grpo" in parts:
        peak += grpo_grid(args.out / "grpo", env)
    if "gpu" in parts:
        peak += peak_grid(args.out / "gpu", env, on_cpu=False)
    state = state_grid(args.out / "state", env) if "state" in parts else []
    (args.out / "plan_accuracy.json").write_text(json.dumps({"state": state, "peak": peak}, indent=2))
    text = report(state, peak)
    (args.out / "plan_accuracy.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
