"""hfsdp against its peers on the same work, interleaved in one invocation, with ratios of medians.

    python benchmarks/peers.py [--nproc 1] [--rounds 3] [--steps 10] [--warmup 2] [--out bench-results/peers]
                               [--tools hfsdp,bare,trl] [--config benchmarks/peers.yaml] [--set KEY=VALUE ...]

One process (default): ``hfsdp train``, a bare hand-written Accelerate loop (``benchmarks/bare_accelerate_loop.py``)
and TRL's ``SFTTrainer`` (``benchmarks/trl_sft.py``; TRL comes with ``pip install -e '.[bench]'``) each train the
same model on the same rows in the same order (hfsdp's tokenized cache and ``BatchPlan``), with the same batch,
AdamW, LR schedule and gradient clipping, fp32. ``--nproc 2``: ``hfsdp train`` and the bare loop as 2-rank torchrun
jobs under the config's FSDP strategy (TRL is left out: it has no CPU FSDP path). ``--tools hfsdp-compiled,...``
adds hfsdp with ``train.compile: true`` (its first step, the compile, is printed apart and not timed with
``--warmup`` >= 1). ``hfsdp-lora`` and ``trl-lora`` train LoRA adapters instead (hfsdp's ``lora`` plugin; TRL with
peft, the same ``LoraConfig``). ``floor`` is this machine's floor for the same steps (``benchmarks/floor.py``: the
step's GEMMs, attention and AdamW step, each timed alone; on N ranks the slowest rank's, plus the strategy's
collectives timed alone), so ``hfsdp ÷ floor`` is how close hfsdp runs to it.

Each round runs every tool once, in a rotated order (so that a slow spell of a shared machine does not always hit the
same tool). A tool's figure for a round is its median step time over the steps after ``--warmup`` (one step end to
the next, so that all of a tool's per-step work counts; on several ranks the slowest rank's), and its tokens/s is the
round's real (non-padding) tokens divided by the summed step times. The table prints every round, then the median
over rounds and the ratios of the medians. Writes ``peers.json`` and ``peers.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
# hfsdp as it runs by default, and with its transformer blocks compiled (train.compile: Inductor); both log every
# step's loss, so that their losses can be compared
# (and hfsdp-plain-loss: with the plain, unchunked loss, train.chunked_loss: false; hfsdp-lora: LoRA adapters)
HFSDP_TOOLS = {"hfsdp": ["--set", "train.log_every=1"],
               "hfsdp-compiled": ["--set", "train.log_every=1", "--set", "train.compile=true"],
               "hfsdp-plain-loss": ["--set", "train.log_every=1", "--set", "train.chunked_loss=false"],
               "hfsdp-lora": ["--set", "train.log_every=1"]}
SCRIPTS = {"bare": "bare_accelerate_loop.py", "trl": "trl_sft.py", "trl-lora": "trl_sft.py", "floor": "floor.py"}
# The tools that train LoRA adapters (the lora plugin's defaults, or the config's lora: section) instead of the model
LORA_TOOLS = ("hfsdp-lora", "trl-lora")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def _launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [PY]
    from hfsdp.parallel.launcher import free_port

    return [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}"]


def _command(tool: str, a: argparse.Namespace, work: Path) -> tuple[list[str], Path]:
    sets = [x for s in a.overrides for x in ("--set", s)]
    record = work / f"{tool}.json"
    lora = ["lora"] if tool in LORA_TOOLS else []
    if tool in HFSDP_TOOLS:
        from hfsdp.tools.bench import _probe_plugin

        run = work / "hfsdp-run"
        sets += ["--set", f"train.output_dir={run}", "--set", f"train.max_steps={a.steps}",
                 "--set", f"plugins=[{', '.join([_probe_plugin(), *lora])}]", *HFSDP_TOOLS[tool]]
        return [*_launcher(a.nproc), "-m", "hfsdp", "train", a.config, "--overwrite", *sets], run
    if lora:
        sets += ["--set", "plugins=[lora]"]
    return [*_launcher(a.nproc), str(REPO / "benchmarks" / SCRIPTS[tool]), a.config, "--steps", str(a.steps),
            "--json", str(record), *sets], record


def _read(tool: str, where: Path, nproc: int) -> tuple[list[float], list[int]]:
    """Per-step wall times (slowest rank) and tokens of one run."""
    if tool not in HFSDP_TOOLS:
        record = json.loads(where.read_text())
        return record["step_times_s"], record["tokens"]
    ranks = [json.loads((where / f"bench_rank{r}.json").read_text()) for r in range(nproc)]
    return [max(ts) for ts in zip(*(r["step_times_s"] for r in ranks))], ranks[0]["tokens"]


def run_round(tools: list[str], a: argparse.Namespace, r: int) -> dict[str, dict]:
    out = {}
    for tool in tools:
        work = a.out / f"round{r}" / tool
        work.mkdir(parents=True, exist_ok=True)
        cmd, where = _command(tool, a, work)
        t0 = time.perf_counter()
        with open(work / "log.txt", "w") as log:
            proc = subprocesses.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=REPO, timeout=a.timeout)
        if proc.returncode != 0:
            tail = (work / "log.txt").read_text()[-3000:]
            raise SystemExit(f"{tool} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
        times, tokens = _read(tool, where, a.nproc)
        steady_t, steady_n = times[a.warmup:], tokens[a.warmup:]
        losses = ([json.loads(line).get("loss") for line in (where / "metrics.jsonl").read_text().splitlines()]
                  if tool in HFSDP_TOOLS else [])
        out[tool] = {"step_s": statistics.median(steady_t), "tokens_per_s": sum(steady_n) / sum(steady_t),
                     "first_step_s": times[0], "losses": [x for x in losses if x is not None],
                     "step_times_s": times, "tokens": tokens, "wall_s": time.perf_counter() - t0,
                     "command": " ".join(cmd)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "benchmarks" / "peers.yaml"))
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tools", default=None, help="default: hfsdp,bare,trl on 1 process; hfsdp,bare on several; "
                                                 "hfsdp-compiled is hfsdp with train.compile: true, "
                                                 "hfsdp-plain-loss with train.chunked_loss: false, hfsdp-lora "
                                                 "and trl-lora train LoRA adapters (TRL + peft), floor the "
                                                 "machine's floor (benchmarks/floor.py)")
    p.add_argument("--out", type=Path, default=Path("bench-results/peers"))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every tool, e.g. --set fsdp.sharding_strategy=SHARD_GRAD_OP")
    a = p.parse_args()
    a.out = a.out.resolve()
    tools = (a.tools or ("hfsdp,bare,trl" if a.nproc == 1 else "hfsdp,bare")).split(",")
    unknown = [t for t in tools if t not in HFSDP_TOOLS and t not in SCRIPTS]
    if unknown:
        raise SystemExit(f"unknown --tools {','.join(unknown)}: choose from {','.join([*HFSDP_TOOLS, *SCRIPTS])}")
    if a.nproc > 1 and {"trl", "trl-lora"} & set(tools):
        raise SystemExit("--nproc > 1 compares hfsdp with the bare FSDP loop and the floor only (TRL has no CPU FSDP "
                         "path: drop trl and trl-lora from --tools)")
    if {"trl", "trl-lora"} & set(tools):
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -e '.[bench]' (or pass --tools hfsdp,bare)") from None
    if a.steps <= a.warmup:
        raise SystemExit("--steps must exceed --warmup")
    a.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    lines = [f"peers: {a.nproc} process(es), {a.rounds} interleaved rounds of {a.steps} steps "
             f"(first {a.warmup} not timed), config {a.config} {' '.join(a.overrides)}".rstrip(),
             "| round | " + " | ".join(f"{t} tok/s (s/step)" for t in tools) + " |",
             "|---|" + "---|" * len(tools)]
    print("\n".join(lines), flush=True)
    for r in range(a.rounds):
        order = tools[r % len(tools):] + tools[:r % len(tools)]
        result = run_round(order, a, r + 1)
        rounds.append(result)
        lines.append(f"| {r + 1} | " + " | ".join(
            f"{result[t]['tokens_per_s']:.1f} ({result[t]['step_s']:.3f})" for t in tools) + " |")
        print(lines[-1], flush=True)
    med = {t: {"tokens_per_s": statistics.median(x[t]["tokens_per_s"] for x in rounds),
               "step_s": statistics.median(x[t]["step_s"] for x in rounds)} for t in tools}
    lines.append("| median | " + " | ".join(
        f"{med[t]['tokens_per_s']:.1f} ({med[t]['step_s']:.3f})" for t in tools) + " |")
    lines.append("| first step s (median; with compile: the compile time) | " + " | ".join(
        f"{statistics.median(x[t]['first_step_s'] for x in rounds):.1f}" for t in tools) + " |")
    for variant in [t for t in tools if t in HFSDP_TOOLS and t not in ("hfsdp", *LORA_TOOLS)]:  # the same training
        if "hfsdp" in tools:
            diff = max(abs(a - b) for x in rounds for a, b in zip(x["hfsdp"]["losses"], x[variant]["losses"]))
            lines.append(f"{variant} vs hfsdp: largest step-loss difference {diff:.2e} over "
                         f"{len(rounds[0]['hfsdp']['losses'])} steps per round")
    ratios = {}
    for i, first in enumerate(tools):  # every hfsdp tool against every tool after it
        if first not in HFSDP_TOOLS:
            continue
        for other in tools[i + 1:]:
            ratios[f"{first}_tokens_per_s_vs_{other}"] = med[first]["tokens_per_s"] / med[other]["tokens_per_s"]
            ratios[f"{first}_step_s_vs_{other}"] = med[first]["step_s"] / med[other]["step_s"]
            lines.append(f"{first} ÷ {other}: tokens/s {ratios[f'{first}_tokens_per_s_vs_{other}']:.3f}, "
                         f"step time {ratios[f'{first}_step_s_vs_{other}']:.3f} (ratios of the medians)")
    print("\n".join(lines[lines.index(next(x for x in lines if x.startswith("| median"))):]), flush=True)
    (a.out / "peers.md").write_text("\n".join(lines) + "\n")
    (a.out / "peers.json").write_text(json.dumps({"nproc": a.nproc, "steps": a.steps, "warmup": a.warmup,
                                                   "config": a.config, "overrides": a.overrides, "rounds": rounds,
                                                   "medians": med, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
