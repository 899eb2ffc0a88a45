"""Measure every performance goal side by side and print one table of ratios (goals.md/goals.json in --out).

    python benchmarks/goals.py --out bench-results [--bench-dir bench-results/strategies]

Goals (ratio, threshold):
  state_2   per-rank params+grads+optimizer bytes, FULL_SHARD ÷ NO_SHARD on 2 ranks       ≤ 0.51   (from hfsdp bench)
  state_4   the same on 4 ranks                                                             ≤ 0.26   (from hfsdp bench)
  peak_2    peak memory per rank during the steps above the pre-load baseline (and absolute),
            FULL_SHARD ÷ NO_SHARD on 2 ranks                                                ≤ 0.60   (from hfsdp bench)
  peak_4    the same on 4 ranks                                          below the 2-rank ratio   (from hfsdp bench)
  overhead  hfsdp step time ÷ bare Accelerate loop (same model, data, plugin), interleaved   ≤ 1.02
  help      `hfsdp --help` ÷ `accelerate --help` wall time (medians)                         ≤ 0.06
  export    `hfsdp export` peak RSS ÷ `accelerate merge-weights`, same SHARDED checkpoint    ≤ 0.5
  preproc   second preprocessing ÷ first (cache hit vs tokenizing)                           ≤ 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_", "ACCELERATE_"))}
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("TOKENIZERS_PARALLELISM", "false")
    return e


def wall(cmd: list[str], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocesses.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env())
        times.append(time.perf_counter() - t0)
    return times


def peak_rss_of(cmd: list[str]) -> tuple[int, float]:
    """Peak RSS (bytes) of ``cmd`` and its children, measured in a fresh wrapper process (RUSAGE_CHILDREN)."""
    # (the wrapper passes SIGTERM / SIGINT on to the command, as benchmarks/subprocesses.py does)
    code = ("import resource, signal, subprocess, sys, time, json; t=time.perf_counter(); "
            "p=subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
            "[signal.signal(s, lambda n, f: p.send_signal(n)) for s in (signal.SIGTERM, signal.SIGINT)]; "
            "err=p.communicate()[1]; "
            "print(json.dumps([p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
            "time.perf_counter()-t, err[-2000:]]))")
    out = subprocesses.run([PY, "-c", code, *cmd], capture_output=True, text=True, env=env(), check=True)
    rc, peak, seconds, err = json.loads(out.stdout.strip().splitlines()[-1])
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}: {err}")
    return peak, seconds


def goal_help(reps: int) -> dict:
    accelerate = shutil.which("accelerate") or str(Path(PY).parent / "accelerate")
    hfsdp = shutil.which("hfsdp") or str(Path(PY).parent / "hfsdp")
    wall([hfsdp, "--help"], 1), wall([accelerate, "--help"], 1)  # warm the page cache
    h, a = [], []
    for _ in range(reps):  # interleaved
        h += wall([hfsdp, "--help"], 1)
        a += wall([accelerate, "--help"], 1)
    return {"hfsdp_s": statistics.median(h), "accelerate_s": statistics.median(a),
            "ratio": statistics.median(h) / statistics.median(a), "reps": reps}


def goal_preprocess(config: str) -> dict:
    code = ("import json, sys; from pathlib import Path; from hfsdp.model import loading; "
            "from hfsdp.config.files import load_config; from hfsdp.data.prepare import prepare_datasets; "
            "cfg, host = load_config(sys.argv[1]); cache = Path(sys.argv[2]); "
            "tok = loading.load_tokenizer(loading.resolve_model_path(cfg.model.name_or_path, Path(sys.argv[3])), cfg.model); "
            "print(json.dumps(prepare_datasets(cfg, host, tok, cache)[3]))")
    models_cache = os.environ.get("HFSDP_CACHE_DIR", str(Path.home() / ".cache" / "hfsdp"))
    with tempfile.TemporaryDirectory() as cache:
        runs = []
        for _ in range(2):
            out = subprocesses.run([PY, "-c", code, config, cache, models_cache], capture_output=True, text=True,
                                 env=env(), check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert not first["cache_hit"] and second["cache_hit"], runs
    return {"first_s": first["preprocess_s"], "second_s": second["preprocess_s"],
            "ratio": second["preprocess_s"] / first["preprocess_s"], "rows": first["train"]}


def goal_export(work: Path, config: str, max_shard: str) -> dict:
    from hfsdp.parallel.launcher import free_port

    run = work / "export-run"
    shutil.rmtree(run, ignore_errors=True)
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "hfsdp", "train", config, "--set", f"train.output_dir={run}",
           "--set", "train.max_steps=1", "--set", "train.save_every=1", "--set", "train.export_final=false",
           "--set", "fsdp.sharding_strategy=FULL_SHARD", "--set", "fsdp.state_dict_type=SHARDED_STATE_DICT"]
    subprocesses.run(cmd, check=True, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = run / "checkpoints" / "step-1"
    hfsdp = shutil.which("hfsdp") or str(Path(PY).parent / "hfsdp")
    accelerate = shutil.which("accelerate") or str(Path(PY).parent / "accelerate")
    ours, theirs = [], []
    for i in range(2):  # interleaved, fresh processes
        out1, out2 = work / f"export-hfsdp-{i}", work / f"export-merge-{i}"
        shutil.rmtree(out1, ignore_errors=True), shutil.rmtree(out2, ignore_errors=True)
        ours.append(peak_rss_of([hfsdp, "export", str(ckpt), str(out1), "--max-shard-size", max_shard]))
        theirs.append(peak_rss_of([accelerate, "merge-weights", str(ckpt / "pytorch_model_fsdp_0"), str(out2)]))
    weights = sum(p.stat().st_size for p in (work / "export-hfsdp-0").glob("*.safetensors"))
    h, a = statistics.median(p for p, _ in ours), statistics.median(p for p, _ in theirs)
    return {"hfsdp_peak_rss_mib": h / 2**20, "merge_weights_peak_rss_mib": a / 2**20, "ratio": h / a,
            "weights_mib": weights / 2**20, "max_shard_size": max_shard,
            "hfsdp_s": statistics.median(s for _, s in ours), "merge_weights_s": statistics.median(s for _, s in theirs)}


def goal_overhead(work: Path, config: str, nproc: int, steps: int, rounds: int, strategy: str) -> dict:
    from hfsdp.tools.bench import BenchOptions, _probe_plugin, run_one
    from hfsdp.parallel.launcher import free_port

    hf, bare = [], []
    opts = BenchOptions(config=config, strategies=[strategy], nprocs=[nproc], steps=steps, out=work / "overhead",
                        overrides=[])
    for r in range(rounds):  # interleaved: hfsdp, bare, hfsdp, bare, ...
        result = run_one(opts, strategy, nproc, [_probe_plugin()], env())
        rank_times = [rec["step_times_s"] for rec in result["ranks"]]
        hf += [max(ts) for ts in zip(*rank_times)][1:]
        out = work / "overhead" / f"bare-{r}.json"
        subprocesses.run([PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
                        f"--master-port={free_port()}", str(REPO / "benchmarks" / "bare_accelerate_loop.py"), config,
                        "--steps", str(steps), "--json", str(out), "--set", f"fsdp.sharding_strategy={strategy}"],
                       check=True, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bare += json.loads(out.read_text())["step_times_s"][1:]
    return {"hfsdp_median_s": statistics.median(hf), "bare_median_s": statistics.median(bare),
            "ratio": statistics.median(hf) / statistics.median(bare), "hfsdp_steps": hf, "bare_steps": bare,
            "nproc": nproc, "strategy": strategy, "rounds": rounds}


def from_bench(bench_dir: Path, nproc: int) -> dict:
    rows = json.loads((bench_dir / "bench.json").read_text())["rows"]
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    full, ddp = by[("FULL_SHARD", nproc)], by[("NO_SHARD", nproc)]
    return {"state_ratio": full["state_bytes"] / ddp["state_bytes"],
            "peak_ratio": full["mem_peak_mib"] / ddp["mem_peak_mib"],
            "peak_above_base_ratio": full["mem_peak_above_base_mib"] / ddp["mem_peak_above_base_mib"],
            "full_state_mib": full["state_mib"], "ddp_state_mib": ddp["state_mib"],
            "full_peak_mib": full["mem_peak_mib"], "ddp_peak_mib": ddp["mem_peak_mib"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--config", default="bench")
    p.add_argument("--bench-dir", type=Path, help="output of `hfsdp bench --nproc 1,2,4` (bench's defaults)")
    p.add_argument("--only", default="help,preproc,export,overhead")
    p.add_argument("--help-reps", type=int, default=7)
    p.add_argument("--overhead-steps", type=int, default=8)
    p.add_argument("--overhead-rounds", type=int, default=2)
    p.add_argument("--overhead-nproc", type=int, default=2)
    p.add_argument("--max-shard-size", default="50MB")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(","))
    results: dict = {}
    goals = []
    if a.bench_dir and (a.bench_dir / "bench.json").is_file():
        b = results["bench_2"] = from_bench(a.bench_dir, 2)
        goals.append(("per-rank p+g+o bytes FULL_SHARD ÷ NO_SHARD, 2 ranks", b["state_ratio"], 0.51))
        goals.append(("peak memory/rank during the steps above the pre-load RSS baseline (CPU analogue of "
                      "max_memory_allocated), FULL_SHARD ÷ NO_SHARD, 2 ranks", b["peak_above_base_ratio"], 0.60))
        goals.append(("  same, absolute peak RSS (reported beside it)", b["peak_ratio"], None))
        b4 = results["bench_4"] = from_bench(a.bench_dir, 4)
        goals.append(("per-rank p+g+o bytes FULL_SHARD ÷ NO_SHARD, 4 ranks", b4["state_ratio"], 0.26))
        goals.append(("peak above the pre-load baseline FULL_SHARD ÷ NO_SHARD, 4 ranks (falls below 2 ranks)",
                      b4["peak_above_base_ratio"], round(b["peak_above_base_ratio"], 3)))
        goals.append(("  same, absolute peak RSS (reported beside it)", b4["peak_ratio"], None))
    if "help" in only:
        r = results["help"] = goal_help(a.help_reps)
        goals.append((f"`hfsdp --help` ÷ `accelerate --help` ({r['hfsdp_s']:.3f} s vs {r['accelerate_s']:.3f} s)",
                      r["ratio"], 0.06))
    if "preproc" in only:
        r = results["preproc"] = goal_preprocess(a.config)
        goals.append((f"second preprocessing ÷ first ({r['second_s']:.3f} s vs {r['first_s']:.3f} s)", r["ratio"], 0.05))
    if "export" in only:
        r = results["export"] = goal_export(a.out, a.config, a.max_shard_size)
        goals.append((f"`hfsdp export --max-shard-size {a.max_shard_size}` peak RSS ÷ `accelerate merge-weights` "
                      f"({r['hfsdp_peak_rss_mib']:.0f} vs {r['merge_weights_peak_rss_mib']:.0f} MiB, "
                      f"{r['weights_mib']:.0f} MiB of weights)", r["ratio"], 0.5))
    if "overhead" in only:
        r = results["overhead"] = goal_overhead(a.out, a.config, a.overhead_nproc, a.overhead_steps,
                                                a.overhead_rounds, "FULL_SHARD")
        goals.append((f"hfsdp step ÷ bare Accelerate loop, {r['nproc']} ranks FULL_SHARD, interleaved "
                      f"({r['hfsdp_median_s']:.3f} s vs {r['bare_median_s']:.3f} s)", r["ratio"], 1.02))
    lines = ["| goal | ratio | target | met |", "|---|---|---|---|"]
    for name, ratio, target in goals:
        lines.append(f"| {name} | {ratio:.3f} | " + ("- | - |" if target is None else
                                                     f"≤ {target} | {'yes' if ratio <= target else 'NO'} |"))
    table = "\n".join(lines)
    (a.out / "goals.md").write_text(table + "\n")
    (a.out / "goals.json").write_text(json.dumps({"goals": goals, "details": results}, indent=2, default=str))
    print(table)


if __name__ == "__main__":
    main()
