"""Sequence and context parallelism's activation memory per rank, measured on CPU ranks beside `hfsdp plan`'s
prediction; writes DIR/sequence_parallel.md and .json.

    python benchmarks/sequence_parallel.py [--out DIR] [--model smollm2-bench] [--seq-len 4096] [--sp 1,2] [--cp 1]
        [--device-memory 80GiB]

Each (sp, cp) point is a real job of as many ranks as the largest sp x cp (`torchrun -m hfsdp train`, FSDP2
FULL_SHARD, gloo) training steps on rows of `--seq-len` tokens (the bundled ShareGPT chats laid end to end as plain
text: one row per rank where rows are not split, one row split over sp x cp ranks where they are). The measure is
bench_probe's `saved_activations_peak` (`bench_probe.activations: true`): the peak of the bytes autograd keeps for
backward during the steps, each saved tensor counted once until it is freed, parameters left out, the largest
rank's. Beside it: `hfsdp plan --sp --cp` (the activations it predicts per rank, the all-to-all and ring bytes a
step), and the ratio of each point to the first. The targets: sp 2 <= 0.6 x sp 1 at 4,096 tokens (issue 54), cp 2
<= 0.6 x cp 1 (issue 73), the plan within 10 %.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import subprocesses

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def long_text(path: Path, rows: int, chars: int) -> Path:
    """``rows`` plain-text rows of ``chars`` characters each: the bundled ShareGPT chats laid end to end."""
    from conftest import sharegpt_rows

    turns = [t["value"] for chat in sharegpt_rows() for t in chat["conversations"]]
    text, lines, n = "", [], 0
    while len(lines) < rows:
        text += turns[n % len(turns)] + "\n"
        n += 1
        if len(text) >= chars:
            lines.append(json.dumps({"text": text}))
            text = ""
    path.write_text("\n".join(lines) + "\n")
    return path


def config(out: Path, data: Path, model: str, seq_len: int, sp: int, cp: int, steps: int) -> Path:
    import yaml

    folder = out / (f"sp{sp}" + (f"-cp{cp}" if cp > 1 else ""))
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model": {"name_or_path": model},
           "data": {"format": "text", "path": str(data), "max_seq_len": seq_len},
           "train": {"output_dir": str(folder / "run"), "max_steps": steps, "per_device_batch_size": 1,
                     "report_to": "none", "loss_plot": False, "eval_at_start": False, "log_every": 1},
           "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD"},
           "parallel": {"sp_size": sp, "cp_size": cp}, "plugins": ["bench_probe"],
           "bench_probe": {"activations": True}}
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("sequence-parallel"))
    p.add_argument("--model", default="smollm2-bench")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--sp", default="1,2")
    p.add_argument("--cp", default="1", help="context-parallel sizes, each run with every --sp (default: 1)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device-memory", default="80GiB", help="the budget of plan's longest row (default: 80GiB)")
    a = p.parse_args()
    points = [(int(sp), int(cp)) for cp in a.cp.split(",") for sp in a.sp.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    nproc = max(sp * cp for sp, cp in points)
    data = long_text(a.out / "long_text.jsonl", rows=nproc * a.steps, chars=6 * a.seq_len)
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = []
    for sp, cp in points:
        cfg = config(a.out, data, a.model, a.seq_len, sp, cp, a.steps)
        proc = subprocesses.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                                 "--master-addr=127.0.0.1", "--master-port=29533", "-m", "hfsdp", "train", str(cfg),
                                 "--overwrite"],
                                env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"sp {sp} cp {cp}: the run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        run = cfg.parent / "run"
        ranks = [json.loads((run / f"bench_rank{r}.json").read_text()) for r in range(nproc)]
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        planned = subprocesses.run([sys.executable, "-m", "hfsdp", "plan", str(cfg), "--nproc", str(nproc),
                                    "--strategies", "FULL_SHARD", "--sp", str(sp), "--cp", str(cp), "--json",
                                    "--device-memory", a.device_memory],
                                   env=env, capture_output=True, text=True, check=True)
        row = json.loads(planned.stdout)["rows"][0]
        results.append({"sp": sp, "cp": cp, "ranks": nproc,
                        "tokens_per_step": max(m.get("tokens", 0) for m in metrics),
                        "measured": max(r["saved_activations_peak"] for r in ranks),
                        "planned": row["activations"], "all_to_all_bytes": row["sp_comm"], "ring_bytes": row["cp_comm"],
                        "longest_row": row["longest_row"], "step_s": min(ranks[0]["step_times_s"])})
    base = results[0]["measured"]
    lines = [f"`{a.model}`, rows of {a.seq_len} tokens, {nproc} CPU ranks (gloo), FSDP2 FULL_SHARD, float32; "
             f"`python benchmarks/sequence_parallel.py --model {a.model} --seq-len {a.seq_len} --sp {a.sp} "
             f"--cp {a.cp}`", "",
             "| sp | cp | tokens a step | saved activations per rank, measured | plan | plan / measured | "
             f"÷ the first | all-to-all MiB/step (plan) | ring MiB/step (plan) | longest row on {a.device_memory} "
             "(plan) | fastest step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['sp']} | {r['cp']} | {r['tokens_per_step']} | {r['measured'] / 2**20:.1f} MiB | "
                     f"{r['planned'] / 2**20:.1f} MiB | {r['planned'] / r['measured']:.3f} | "
                     f"{r['measured'] / base:.3f} | {r['all_to_all_bytes'] / 2**20:.1f} | "
                     f"{r['ring_bytes'] / 2**20:.1f} | {r['longest_row']:,} | {r['step_s']:.1f} |")
    text = "\n".join(lines)
    (a.out / "sequence_parallel.md").write_text(text + "\n")
    (a.out / "sequence_parallel.json").write_text(json.dumps(results, indent=2))
    print(text)


if __name__ == "__main__":
    main()
