"""``hfsdp bench``: run a config under several sharding strategies and world sizes, side by side, and tabulate
per-rank memory and throughput.

Every combination is a real multi-process run: ``torchrun --nproc-per-node N -m hfsdp train CONFIG`` (gloo on
CPU, NCCL on GPUs) with the ``bench_probe`` plugin enabled, which writes ``bench_rank<R>.json`` into the run's
output folder. This module only launches runs and reads those files (it asks the degrees, ``hfsdp.layout.degrees``,
what one process runs); its own process imports neither torch nor transformers (tests/test_architecture.py).

One process trains without a wrapper by default (``fsdp.single_process: auto``), the same steps whatever the
strategy: those strategies are run once at one process, as the row ``none (1 process)``, the baseline of the
"÷ 1 proc" ratios. With ``--set fsdp.single_process=fsdp`` every strategy runs as a one-rank FSDP.

Outputs in ``--out``: ``bench.md``, ``bench.csv``, ``bench.json`` and ``bench.png`` (memory per rank and tokens/s
per strategy), plus ``runs/<strategy>-np<N>/`` with each run's logs and probe files. ``--profile`` (CPU) adds where
each rank's step went (``bench_probe.split``: medians over the timed steps) to all four.

``--seq-lens`` / ``--micro-batches`` sweep the work: every combination runs at each sequence length
(``data.max_seq_len``) and micro-batch (``train.per_device_batch_size``), and each row gets the tokens a rank's
micro-batch really held, and ``hfsdp plan``'s predicted peak for the same point beside the measured one (the plan
computed in a child process, :mod:`hfsdp.tools.plan.points`); ``bench.png`` then plots tokens/s and peak memory per
rank (measured, and the plan's) against the tokens of a micro-batch, a line per world size and strategy.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfsdp.config.schema import STRATEGIES
from hfsdp.parallel.launcher import free_port
from hfsdp.units import MIB

# The split of an iteration (seconds each) that the bench_probe plugin measures, in order; its parts but
# "collectives" add up to the iteration.
SPLIT = ("forward", "backward", "fsdp_hooks", "clip", "optimizer", "other", "collectives")
ONE_PROCESS = "none (1 process)"  # the strategy column of a one-process run without a wrapper

COLUMNS = [
    # (key, header, format)
    ("model", "model", "{}"),
    ("parameters_m", "params (M)", "{:.1f}"),
    ("active_parameters_m", "active params (M)", "{:.1f}"),  # a mixture of experts: those a token computes with
    ("world_size", "ranks", "{}"),
    ("strategy", "strategy", "{}"),
    ("fsdp_version", "FSDP", "{}"),
    ("precision", "precision", "{}"),
    ("param_mib", "params MiB/rank", "{:.1f}"),
    ("grad_mib", "grads MiB/rank", "{:.1f}"),
    ("optim_mib", "optim MiB/rank", "{:.1f}"),
    ("state_mib", "p+g+o MiB/rank", "{:.1f}"),
    ("mem_base_mib", "mem before load MiB", "{:.0f}"),
    ("mem_prepared_mib", "mem after prepare MiB", "{:.0f}"),
    ("mem_peak_mib", "peak mem steps MiB", "{:.0f}"),
    ("mem_peak_above_base_mib", "peak above base MiB", "{:.0f}"),
    ("step_time_s", "step s (median)", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("state_vs_no_shard", "p+g+o ÷ NO_SHARD", "{:.3f}"),
    ("peak_vs_no_shard", "peak ÷ NO_SHARD", "{:.3f}"),
    ("peak_above_base_vs_no_shard", "peak above base ÷ NO_SHARD", "{:.3f}"),
    ("tokens_per_s_vs_no_shard", "tokens/s ÷ NO_SHARD", "{:.2f}"),
    ("state_vs_1proc", "p+g+o ÷ 1 proc", "{:.3f}"),
    ("peak_vs_1proc", "peak ÷ 1 proc", "{:.3f}"),
    ("tokens_per_s_vs_1proc", "tokens/s ÷ 1 proc", "{:.2f}"),
    ("seq_len", "seq len", "{}"),
    ("micro_batch", "micro-batch", "{}"),
    ("micro_batch_tokens", "tokens/micro-batch", "{:.0f}"),
    ("plan_peak_mib", "plan peak MiB", "{:.0f}"),
    ("plan_vs_measured", "plan ÷ measured peak", "{:.3f}"),
]
# The printed and bench.md table (``--wide``: every column; bench.csv and bench.json always have every figure):
# the seeds' columns (model, ranks, strategy, memory per rank, throughput) and the ratios a reader compares.
NARROW = ["model", "world_size", "strategy", "fsdp_version", "state_mib", "mem_peak_above_base_mib", "tokens_per_s",
          "state_vs_no_shard", "peak_above_base_vs_no_shard", "peak_vs_no_shard", "tokens_per_s_vs_no_shard"]
# CPU runs: glibc otherwise keeps freed memory (the full model loaded before sharding, FSDP's per-unit all-gather
# and reduce-scatter buffers) in the heap, so RSS would show the largest buffer ever used instead of what a rank
# holds. Large allocations are mmapped (and unmapped when freed) and the heap is trimmed on every free.
MALLOC_RETURNS_FREED = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
# The table of a sweep (--seq-lens / --micro-batches): the work, its speed, the measured peak and the plan's.
SWEEP = ["model", "world_size", "strategy", "seq_len", "micro_batch", "micro_batch_tokens", "tokens_per_s",
         "mem_peak_above_base_mib", "plan_peak_mib", "plan_vs_measured"]


@dataclass
class BenchOptions:
    config: str | None
    strategies: list[str]
    nprocs: list[int]
    steps: int
    out: Path
    overrides: list[str]
    warmup: int = 1
    timeout: float = 1800
    wide: bool = False
    profile: bool = False
    cache_dir: Path | None = None  # where built-in models are built (the CLI's): a sweep's plan needs it
    seq_lens: list[int] = field(default_factory=list)  # a sweep's data.max_seq_len values (empty: the config's)
    micro_batches: list[int] = field(default_factory=list)  # its train.per_device_batch_size values

    @property
    def sweep(self) -> bool:
        return bool(self.seq_lens or self.micro_batches)

    def points(self) -> list[tuple[int | None, int | None]]:
        """(sequence length, micro-batch) of each run of a combination (None: the config's)."""
        return [(seq, batch) for seq in self.seq_lens or [None] for batch in self.micro_batches or [None]]


def point_overrides(point: tuple[int | None, int | None]) -> list[str]:
    seq, batch = point
    return [*([f"data.max_seq_len={seq}"] if seq else []), *([f"train.per_device_batch_size={batch}"] if batch else [])]


def _probe_plugin() -> str:
    from hfsdp.hooks.host import discover

    # Stale install metadata may lack the entry point; the dotted path always works.
    return "bench_probe" if "bench_probe" in discover() else "hfsdp.builtin.bench_probe"


def _raw_config(config: str | None, overrides: list[str]) -> dict[str, Any]:
    from hfsdp.config.files import apply_overrides, read_config, resolve_config_path

    return apply_overrides(read_config(resolve_config_path(config)), overrides)


def quiet_run(raw: dict[str, Any]) -> list[str]:
    """The overrides that leave only the steps in a bench run of the config ``raw``: no export, checkpoints, eval,
    trackers, loss plot or generations. A config with the deprecated ``train.tensorboard`` key gets it set false
    (setting ``train.report_to`` beside it would be refused: the key it replaced)."""
    trackers = "train.tensorboard=false" if "tensorboard" in (raw.get("train") or {}) else "train.report_to=none"
    return ["train.export_final=false", "train.save_every=null", "train.eval_at_start=false", "train.eval_every=null",
            trackers, "train.loss_plot=false", "generation_eval=null"]


def _unwrapped_at_one(opts: BenchOptions, strategy: str) -> bool:
    """Whether one process trains without a wrapper under ``strategy`` (train's own rule)."""
    from hfsdp.config.schema import FSDPConfig, ParallelConfig
    from hfsdp.layout.degrees import ParallelDims

    raw = _raw_config(opts.config, opts.overrides)
    fsdp = FSDPConfig.model_validate({**(raw.get("fsdp") or {}), "sharding_strategy": strategy})
    return ParallelDims.of(fsdp, ParallelConfig.model_validate(raw.get("parallel") or {}), 1, 1).wrapper == "none"


def _runs(opts: BenchOptions) -> list[tuple[int, str, bool]]:
    """(processes, strategy, unwrapped) to run: at one process, the strategies without a wrapper only once."""
    runs = []
    for nproc in sorted(opts.nprocs):
        for strategy in opts.strategies:
            unwrapped = nproc == 1 and _unwrapped_at_one(opts, strategy)
            if not (unwrapped and any(u for _, _, u in runs)):
                runs.append((nproc, strategy, unwrapped))
    return runs


def _cuda_devices() -> int:
    """GPUs visible to the runs, asked in a child process so that this one never imports torch."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):
        return 0


def run_one(opts: BenchOptions, strategy: str, nproc: int, plugins: list[str], env: dict[str, str],
            point: tuple[int | None, int | None] = (None, None)) -> dict[str, Any]:
    """One torchrun job (at a sweep's ``point``); returns the per-rank probe records (raises with the log tail if
    it failed)."""
    seq, batch = point
    run_dir = opts.out / "runs" / f"{strategy}-np{nproc}{f'-seq{seq}' if seq else ''}{f'-mb{batch}' if batch else ''}"
    run_dir.mkdir(parents=True, exist_ok=True)
    sets = [
        *opts.overrides,
        *point_overrides(point),
        f"train.output_dir={run_dir / 'train'}",
        f"train.max_steps={opts.steps}",
        f"fsdp.sharding_strategy={strategy}",
        f"plugins=[{', '.join(plugins)}]",
        *quiet_run(_raw_config(opts.config, opts.overrides)),
        *(["bench_probe.profile=true"] if opts.profile else []),
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "hfsdp", "train", *( [opts.config] if opts.config else [] ),
           "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=opts.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (run_dir / "log.txt").read_text()[-4000:]
        raise RuntimeError(f"bench run {strategy} x{nproc} failed (exit {proc.returncode}); log {run_dir / 'log.txt'}:\n{tail}")
    ranks = []
    for r in range(nproc):
        path = run_dir / "train" / f"bench_rank{r}.json"
        if not path.is_file():
            raise RuntimeError(f"bench run {strategy} x{nproc}: rank {r} wrote no {path.name} (is bench_probe enabled?)")
        ranks.append(json.loads(path.read_text()))
    return {"ranks": ranks, "wall_s": wall, "command": " ".join(cmd)}


def summarize(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """One table row from the per-rank records: the worst rank for memory, the slowest rank for time."""
    r0 = ranks[0]

    def worst(key: str) -> float:
        return max(float(r.get(key) or 0) for r in ranks)

    times = [r["step_times_s"][warmup:] or r["step_times_s"] for r in ranks]
    # The same step ends on all ranks within one collective of each other: take the slowest rank per step.
    per_step = [max(ts) for ts in zip(*times)]
    step_time = statistics.median(per_step)
    tokens = r0["tokens"][warmup:] or r0["tokens"]
    state = worst("param_bytes") + worst("grad_bytes") + worst("optim_bytes")
    return {
        "model": r0["model"],
        "parameters_m": r0["parameters"] / 1e6,
        "active_parameters_m": r0["active_parameters"] / 1e6 if r0.get("active_parameters") else None,
        "world_size": r0["world_size"],
        "strategy": r0["strategy"],
        "runs_as": r0["distributed_type"],
        "fsdp_version": r0["fsdp_version"] if r0["distributed_type"] == "FSDP" else
                        "- (no wrapper)" if r0["distributed_type"] == "NO" else "- (DDP)",
        "precision": r0["precision"],
        "device": r0["device"],
        "memory_kind": r0["memory_kind"],
        "param_bytes": worst("param_bytes"),
        "quant_linear_bytes": worst("quant_linear_bytes"),  # QLoRA: the 4-bit Linears with their quant state
        "quant_linear_bf16_bytes": worst("quant_linear_bf16_bytes"),
        "grad_bytes": worst("grad_bytes"),
        "optim_bytes": worst("optim_bytes"),
        "state_bytes": state,
        "param_mib": worst("param_bytes") / MIB,
        "grad_mib": worst("grad_bytes") / MIB,
        "optim_mib": worst("optim_bytes") / MIB,
        "state_mib": state / MIB,
        "mem_base_mib": worst("rss_before_load") / MIB if r0["memory_kind"] == "rss" else 0.0,
        "mem_prepared_mib": worst("mem_after_prepare") / MIB,
        "mem_peak_mib": worst("mem_peak_steps") / MIB,
        "mem_peak_above_base_mib": max(
            (r["mem_peak_steps"] - (r.get("rss_before_load") or 0 if r["memory_kind"] == "rss" else 0)) for r in ranks
        ) / MIB,
        "step_time_s": step_time,
        "step_times_s": per_step,
        "tokens_per_step": statistics.median(tokens),
        "tokens_per_s": statistics.median(tokens) / step_time if step_time > 0 else 0.0,
        # --profile: each rank's median split of its timed steps (seconds per part)
        "profile_s": [{part: statistics.median(values[warmup:] or values) for part, values in r["profile_s"].items()}
                      for r in ranks] if "profile_s" in r0 else None,
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    def ratio(a, b):
        return a / b if b else None

    for row in rows:
        base = next((r for r in rows if r["strategy"] == "NO_SHARD" and r["world_size"] == row["world_size"]), None)
        # One process: the same strategy as a one-rank FSDP, or else the run without a wrapper.
        one = next((r for r in rows if r["world_size"] == 1 and r["strategy"] == row["strategy"]),
                   next((r for r in rows if r["strategy"] == ONE_PROCESS), None))
        for key, ref in (("no_shard", base), ("1proc", one)):
            row[f"state_vs_{key}"] = ratio(row["state_bytes"], ref["state_bytes"]) if ref else None
            row[f"peak_vs_{key}"] = ratio(row["mem_peak_mib"], ref["mem_peak_mib"]) if ref else None
            row[f"tokens_per_s_vs_{key}"] = ratio(row["tokens_per_s"], ref["tokens_per_s"]) if ref else None
        row["peak_above_base_vs_no_shard"] = (
            ratio(row["mem_peak_above_base_mib"], base["mem_peak_above_base_mib"]) if base else None
        )


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def _columns(wide: bool, sweep: bool = False, experts: bool = False) -> list[tuple[str, str, str]]:
    """The table's columns; ``experts`` (a mixture of experts was run): its total and active parameters after the
    model's name."""
    if wide:
        return COLUMNS
    keys = SWEEP if sweep else NARROW
    if experts:
        keys = [keys[0], "parameters_m", "active_parameters_m", *keys[1:]]
    return [c for key in keys for c in COLUMNS if c[0] == key]


def markdown_table(rows: list[dict[str, Any]], wide: bool = False, sweep: bool = False) -> str:
    columns = _columns(wide, sweep, any(r.get("active_parameters_m") for r in rows))
    headers = [h for _, h, _ in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, k, f) for k, _, f in columns) + " |")
    return "\n".join(lines)


def text_table(rows: list[dict[str, Any]], wide: bool = False, sweep: bool = False) -> str:
    columns = _columns(wide, sweep, any(r.get("active_parameters_m") for r in rows))
    cells = [[h for _, h, _ in columns]] + [[_cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c[i].rjust(widths[i]) for i in range(len(columns))) for c in cells)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([k for k, _, _ in COLUMNS])
        for row in rows:
            writer.writerow(["" if row.get(k) is None else row.get(k) for k, _, _ in COLUMNS])


def profile_table(rows: list[dict[str, Any]]) -> str:
    """--profile: where each rank's median step went, one line per run and rank (Markdown)."""
    lines = ["| strategy | ranks | rank | step s | " + " | ".join(f"{p} s" for p in SPLIT) + " |",
             "|" + "---|" * (4 + len(SPLIT))]
    for row in rows:
        for rank, parts in enumerate(row["profile_s"] or []):
            lines.append(f"| {row['strategy']} | {row['world_size']} | {rank} | "
                         f"{sum(parts[p] for p in SPLIT if p != 'collectives'):.3f} | "
                         + " | ".join(f"{parts[p]:.3f}" for p in SPLIT) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """bench.png; PlotUnavailable without matplotlib."""
    from hfsdp.run.plots import pyplot

    plt = pyplot(str(path))
    labels = [f"{r['strategy']}\n{r['world_size']} proc" for r in rows]
    mem_kind = "GPU max allocated" if rows and rows[0]["memory_kind"] == "cuda_allocated" else "peak RSS"
    profiled = [(f"{r['strategy']}\n{r['world_size']} proc, rank {rank}", parts) for r in rows
                for rank, parts in enumerate(r["profile_s"] or [])]
    fig, axes = plt.subplots(1, 3 if profiled else 2, figsize=(max(8, 1.6 * len(rows) + 2) + 5 * bool(profiled), 4.5))
    if profiled:
        _plot_split(axes[2], profiled)
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["state_mib"] for r in rows], width=0.4, label="params+grads+optim")
    axes[0].bar([i + 0.2 for i in x], [r["mem_peak_mib"] for r in rows], width=0.4, label=f"{mem_kind} (steps)")
    axes[0].set_ylabel("MiB per rank")
    axes[0].set_title("memory per rank")
    axes[0].legend(fontsize=8)
    axes[1].bar(list(x), [r["tokens_per_s"] for r in rows], color="tab:green")
    axes[1].set_ylabel("tokens/s (all ranks)")
    axes[1].set_title("throughput")
    for ax in axes[:2]:
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=8)
    fig.suptitle(f"{rows[0]['model']} ({rows[0]['parameters_m']:.1f}M params, {rows[0]['device']})" if rows else "")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_split(ax, profiled: list[tuple[str, dict[str, float]]]) -> None:
    """Stacked bars of each rank's median step by part; collectives in flight (overlapping the parts) as a line."""
    x = list(range(len(profiled)))
    bottom = [0.0] * len(profiled)
    for part in [p for p in SPLIT if p != "collectives"]:
        heights = [parts[part] for _, parts in profiled]
        ax.bar(x, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.scatter(x, [parts["collectives"] for _, parts in profiled], marker="_", s=600, color="black",
               label="collectives in flight", zorder=3)
    ax.set_xticks(x)
    ax.set_xticklabels([label for label, _ in profiled], fontsize=7)
    ax.set_ylabel("s per step (median, profiled)")
    ax.set_title("where a step goes")
    ax.legend(fontsize=7, loc="upper left")


def bench(opts: BenchOptions, echo=print) -> list[dict[str, Any]]:
    for s in opts.strategies:
        if s not in STRATEGIES:
            raise ValueError(f"unknown strategy {s}; choose from {', '.join(STRATEGIES)}")
    opts.out.mkdir(parents=True, exist_ok=True)
    raw_config = _raw_config(opts.config, opts.overrides)
    plugins = list(raw_config.get("plugins") or [])
    probe = _probe_plugin()
    if probe not in plugins:
        plugins.append(probe)
    gpus = _cuda_devices()
    if gpus and opts.profile:
        raise ValueError("--profile splits CPU steps; on GPUs the host-side times it reads would be kernel launches, "
                         "not kernels (not built yet): run without --profile, or on CPU (CUDA_VISIBLE_DEVICES=)")
    if gpus and max(opts.nprocs) > gpus:
        raise ValueError(f"--nproc {max(opts.nprocs)} needs that many GPUs; {gpus} visible")
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not gpus:
        # CPU rehearsal: one compute thread per rank unless the caller chose otherwise; ranks share the cores.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(opts.nprocs))))
        for key, value in MALLOC_RETURNS_FREED.items():
            env.setdefault(key, value)
    for key in [k for k in env if k.startswith(("FSDP_", "ACCELERATE_"))]:
        env.pop(key)
    rows, raw = [], []
    for (nproc, strategy, unwrapped), point in ((run, point) for run in _runs(opts) for point in opts.points()):
        at = f" at {', '.join(point_overrides(point))}" if opts.sweep else ""
        if unwrapped:
            echo(f"bench: 1 process without a wrapper (fsdp.single_process: auto; the same steps under every "
                 f"strategy that needs no FSDP){at}, {opts.steps} steps ...")
        else:
            echo(f"bench: {strategy} on {nproc} process(es){at}, {opts.steps} steps ...")
        result = run_one(opts, strategy, nproc, plugins, env, point)
        row = summarize(result["ranks"], opts.warmup)
        row["requested_strategy"] = strategy
        if row["runs_as"] == "NO":
            row["strategy"] = ONE_PROCESS
        row["wall_s"] = result["wall_s"]
        if opts.sweep:
            row.update(_work(raw_config, point, row))
        rows.append(row)
        raw.append({"strategy": strategy, "nproc": nproc, "point": point, **result})
        echo(f"  p+g+o {row['state_mib']:.1f} MiB/rank, peak {row['mem_peak_mib']:.0f} MiB/rank, "
             f"step {row['step_time_s']:.3f} s, {row['tokens_per_s']:.0f} tokens/s ({row['wall_s']:.0f} s wall)")
    if opts.sweep:
        add_plan(rows, opts, env, on_cpu=not gpus, echo=echo)
    else:
        add_ratios(rows)
    (opts.out / "bench.md").write_text(_markdown_report(rows, opts, gpus) + "\n")
    write_csv(rows, opts.out / "bench.csv")
    (opts.out / "bench.json").write_text(json.dumps({"rows": rows, "runs": raw, "gpus": gpus,
                                                      "steps": opts.steps, "warmup": opts.warmup}, indent=2,
                                                     default=str))
    written = ["bench.md", "bench.csv", "bench.json"]
    from hfsdp.run.plots import PlotUnavailable

    try:
        (plot_sweep if opts.sweep else plot)(rows, opts.out / "bench.png")
        written.append("bench.png")
    except PlotUnavailable as missing:
        echo(f"bench: {missing}")
    echo(text_table(rows, opts.wide, opts.sweep))
    if opts.profile:
        echo("where each rank's step went (median of the timed steps, profiled; collectives in flight overlap the "
             "other parts):\n" + profile_table(rows))
    echo(f"bench: wrote {opts.out}/{', '.join(written)}")
    return rows


def _work(raw: dict[str, Any], point: tuple[int | None, int | None], row: dict[str, Any]) -> dict[str, Any]:
    """A sweep row's work: its sequence length and micro-batch (the point's, else the config's, ``raw``) and the
    tokens a rank's micro-batch held (the step's real tokens over the data-parallel ranks' micro-batches: rows
    shorter than the sequence length hold fewer; the ``packing`` plugin fills them)."""
    train, data = raw.get("train") or {}, raw.get("data") or {}
    micro_steps = (row["world_size"] // int((raw.get("parallel") or {}).get("tp_size") or 1)
                   * int(train.get("gradient_accumulation_steps") or 1))
    return {"seq_len": point[0] or data.get("max_seq_len"), "micro_batch": point[1] or train.get("per_device_batch_size"),
            "micro_batch_tokens": row["tokens_per_step"] / micro_steps}


def add_plan(rows: list[dict[str, Any]], opts: BenchOptions, env: dict[str, str], on_cpu: bool, echo) -> None:
    """Each sweep row's predicted peak per rank (``hfsdp plan``'s estimate for the same config, point, world size
    and strategy; on CPU for CPU ranks) and its ratio to the measured peak above the pre-load baseline."""
    request = {"config": opts.config, "overrides": opts.overrides, "cache_dir": str(opts.cache_dir), "on_cpu": on_cpu,
               "points": [{"nproc": r["world_size"], "strategy": r["requested_strategy"],
                           "overrides": point_overrides((r["seq_len"], r["micro_batch"]))} for r in rows]}
    proc = subprocess.run([sys.executable, "-m", "hfsdp.tools.plan.points"], input=json.dumps(request),
                          capture_output=True, text=True, env=env, timeout=opts.timeout)
    if proc.returncode != 0:
        echo(f"bench: no plan column, the plan failed:\n{proc.stderr[-2000:]}")
        return
    for row, est in zip(rows, json.loads(proc.stdout)):
        if est["problem"]:
            row["plan_problem"] = est["problem"]
            continue
        row["plan_peak_mib"] = est["device_peak"] / MIB
        measured = row["mem_peak_above_base_mib"]
        row["plan_vs_measured"] = row["plan_peak_mib"] / measured if measured > 0 else None


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    """A sweep's bench.png: tokens/s and peak memory per rank (measured, and the plan's dashed) against the tokens
    of a rank's micro-batch, a line per world size and strategy; PlotUnavailable without matplotlib."""
    from hfsdp.run.plots import pyplot

    plt = pyplot(str(path))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    mem_kind = "GPU max allocated" if rows and rows[0]["memory_kind"] == "cuda_allocated" else "peak RSS above base"
    for key in dict.fromkeys((r["world_size"], r["strategy"]) for r in rows):
        line = sorted((r for r in rows if (r["world_size"], r["strategy"]) == key),
                      key=lambda r: r["micro_batch_tokens"])
        x = [r["micro_batch_tokens"] for r in line]
        label = f"{key[1]}, {key[0]} proc"
        axes[0].plot(x, [r["tokens_per_s"] for r in line], marker="o", label=label)
        drawn = axes[1].plot(x, [r["mem_peak_above_base_mib"] for r in line], marker="o", label=f"{label}: measured")
        planned = [(r["micro_batch_tokens"], r["plan_peak_mib"]) for r in line if r.get("plan_peak_mib")]
        if planned:
            axes[1].plot(*zip(*planned), linestyle="--", marker="x", color=drawn[0].get_color(),
                         label=f"{label}: plan")
    axes[0].set_ylabel("tokens/s (all ranks)")
    axes[0].set_title("throughput")
    axes[1].set_ylabel(f"MiB per rank ({mem_kind})")
    axes[1].set_title("peak memory per rank")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per micro-batch (sequence length x micro-batch)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{rows[0]['model']} ({rows[0]['parameters_m']:.1f}M params, {rows[0]['device']})" if rows else "")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown_report(rows: list[dict[str, Any]], opts: BenchOptions, gpus: int) -> str:
    device = f"{gpus} CUDA GPU(s), NCCL" if gpus else f"CPU ({os.cpu_count()} cores), gloo"
    mem = ("peak = torch.cuda.max_memory_allocated during the steps" if gpus else
           "peak = peak RSS during the steps (kernel high-water mark reset after prepare); "
           "base = RSS before the model is loaded (interpreter, libraries, tokenizer, data); "
           "peak above base is the CPU analogue of max_memory_allocated; glibc returns freed memory to the OS "
           "(" + " ".join(f"{k}={v}" for k, v in MALLOC_RETURNS_FREED.items()) + ")")
    one = (f" `{ONE_PROCESS}`: one process trains without a wrapper (fsdp.single_process: auto), the same steps "
           "under every strategy, so it ran once; the ÷ 1 proc ratios compare with it (--set "
           "fsdp.single_process=fsdp runs each strategy as a one-rank FSDP)." if any(
               r["strategy"] == ONE_PROCESS for r in rows) else "")
    return (f"# hfsdp bench\n\nconfig `{opts.config or 'default'}`, {opts.steps} steps (first {opts.warmup} not "
            f"timed), {device}. Bytes are counted from live tensors (DTensor local shards, FSDP1 flat-parameter "
            f"views, plain tensors); per-rank figures are the largest rank's; {mem}.{one} Every figure is in "
            f"bench.csv and bench.json.{SWEEP_NOTE if opts.sweep else ''}\n\n"
            + markdown_table(rows, opts.wide, opts.sweep)
            + ("\n\n## Where a step goes (--profile)\n\nEach rank's median over the timed steps, from a torch.profiler "
               "trace (the profiled steps run slower than the table's): hfsdp's phases less FSDP's hooks inside "
               "them, those hooks (collectives waited for, their copies), `other` the rest of the iteration; the "
               "parts but `collectives` add up to the step. `collectives` is the time a collective was in flight "
               "on the communication threads, concurrent with the other parts where FSDP overlaps it.\n\n"
               + profile_table(rows) if opts.profile else ""))


SWEEP_NOTE = (" A sweep: each combination ran at every sequence length and micro-batch; `tokens/micro-batch` is "
              "what a rank's micro-batch really held (rows shorter than the sequence length hold fewer: "
              "`plugins: [packing]` fills them); `plan peak MiB` is `hfsdp plan`'s estimate for the same point, "
              "beside the measured peak above the pre-load baseline (bench.png plots both).")


def parse_list(text: str, kind=str) -> list:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]
