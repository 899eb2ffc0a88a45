"""train.optimizer side by side on the tiny preset (issue 39): for each optimizer, one process (2 micro-batches of 2
rows) and 2 gloo ranks (2 rows each; FSDP2, or DDP via NO_SHARD for an optimizer refused on FSDP2's shards: none
is now) train the same global batches; printed: the largest relative difference of the losses and of the final
weights (per tensor, ||a - b|| / ||b||), the optimizer state bytes of rank 0 (live tensors of the 2-rank run, as
`hfsdp bench` counts them, and `hfsdp plan`'s figure for the same setup), and the median step time of the
one-process run over AdamW's.

Run: python benchmarks/optimizers.py --steps 8 [--optimizers adamw,muon] [--out DIR]
     python benchmarks/optimizers.py --dry    (the configs only; CI runs this)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import subprocesses


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import base_env, free_port, read_metrics, tiny_config  # noqa: E402

from hfsdp.config.schema import OPTIMIZER_NAMES  # noqa: E402

ARGS = {"sgd": {"momentum": 0.9}}


def sections(optimizer: str, steps: int, world: int) -> dict:
    train = {"max_steps": steps, "optimizer": optimizer, "optimizer_args": ARGS.get(optimizer, {}),
             "lr_scheduler": "constant", "weight_decay": 0.1, "eval_at_start": False, "max_eval_batches": 1,
             "per_device_batch_size": 2, "gradient_accumulation_steps": 2 if world == 1 else 1}
    # one process runs without FSDP; 2 ranks shard with FSDP2 (every optimizer runs on its shards)
    fsdp = {"version": 2, "sharding_strategy": "FULL_SHARD"}
    return {"train": train, "fsdp": fsdp}


def run(folder: Path, world: int, config: Path) -> Path:
    cmd = ([sys.executable, "-m", "hfsdp", "train", str(config)] if world == 1 else
           [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "hfsdp", "train", str(config)])
    subprocesses.run(cmd, check=True, env=base_env(), capture_output=True, text=True)
    return folder / "run"


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


def planned_optimizer_bytes(config: Path, world: int, strategy: str) -> int:
    out = subprocesses.run([sys.executable, "-m", "hfsdp", "plan", str(config), "--nproc", str(world),
                          "--strategies", strategy, "--json"], check=True, env=base_env(), capture_output=True,
                         text=True).stdout
    return next(r["optimizer"] for r in json.loads(out)["rows"] if r["strategy"] == strategy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZER_NAMES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry", action="store_true", help="write the configs only")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="hfsdp-optimizers-"))
    rows = []
    for optimizer in args.optimizers.split(","):
        done = {}
        for world in (1, 2):
            folder = root / f"{optimizer}-x{world}"
            folder.mkdir(parents=True, exist_ok=True)
            config = tiny_config(folder, **sections(optimizer, args.steps, world))
            if not args.dry:
                done[world] = (run(folder, world, config), config)
        if args.dry:
            print(f"{optimizer}: {root / f'{optimizer}-x1'}, {root / f'{optimizer}-x2'}")
            continue
        (one, _), (two, config_two) = done[1], done[2]
        loss = lambda r: [m["loss"] for m in read_metrics(r) if "loss" in m]  # noqa: E731
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(loss(two), loss(one)))
        w1, w2 = weights(one), weights(two)
        weight_rel = max(float((w2[k] - w1[k]).norm() / w1[k].norm()) for k in w1)
        measured = json.loads((two / "startup_rank0.json").read_text())["optimizer_state_bytes_this_rank"]
        strategy = sections(optimizer, args.steps, 2)["fsdp"]["sharding_strategy"]
        times = [m["step_time_s"] for m in read_metrics(one) if "step_time_s" in m][1:]  # the first step warms up
        rows.append({"optimizer": optimizer, "two_ranks": "DDP" if strategy == "NO_SHARD" else "FSDP2",
                     "loss_rel": loss_rel, "weight_rel": weight_rel, "state_bytes_rank0": measured,
                     "planned": planned_optimizer_bytes(config_two, 2, strategy),
                     "step_s": statistics.median(times)})
    if args.dry:
        return
    adamw = next((r["step_s"] for r in rows if r["optimizer"] == "adamw"), None)
    print("| optimizer | 2 ranks | losses: max rel diff | weights: max rel diff | state bytes/rank (live) | "
          "planned | step time / AdamW |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['step_s'] / adamw:.2f}" if adamw else "-"
        print(f"| {r['optimizer']} | {r['two_ranks']} | {r['loss_rel']:.1e} | {r['weight_rel']:.1e} | "
              f"{r['state_bytes_rank0']:,} | {r['planned']:,} | {ratio} |")
    (root / "optimizers.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
