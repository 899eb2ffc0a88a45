"""A longer chaos campaign than CI's (issue 53): for each feature (tests/test_chaos.py's ``CHAOS``), an uninterrupted
2-rank run, then ``--trials`` runs whose whole job (torchrun and both ranks) is SIGKILLed ``--kills`` times at
moments drawn from a seed (tests/chaos.py), each started again with the same ``--resume`` command line until it
finishes; a trial passes when the run holds every step once with the uninterrupted run's losses and gradient norms
and exports its weights, bit for bit.

    python benchmarks/chaos_campaign.py [--features grpo+async_save,tp2+schedule_free] [--trials 3] [--kills 5]
                                        [--seed 1000] [--out bench-results/chaos]

Prints a row per feature (trials, kills that interrupted the job, what they interrupted, failures) and the total;
exits 1 if a trial failed (its seed and attempts are printed; the logs stay in --out). SIGTERM or Ctrl-C stops it and
the job it is running.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from chaos import FAULT_PLUGIN, campaign, schedule  # noqa: E402
from conftest import base_env, read_metrics, tiny_config  # noqa: E402
from test_chaos import CHAOS, STEPS, sections_of  # noqa: E402
from test_combinations import _merge, exported, losses  # noqa: E402


def same_run(run: Path, reference: Path) -> str:
    """'' when ``run`` holds every step once with ``reference``'s losses and exports its weights bit for bit, else
    what differs."""
    import torch

    records = [m["step"] for m in read_metrics(run) if "loss" in m]
    if records != list(range(1, STEPS + 1)):
        return f"metrics steps {records}"
    if losses(run) != losses(reference):
        return "losses or gradient norms differ"
    got, want = exported(run), exported(reference)
    for name, tensors in want.items():
        for key, tensor in tensors.items():
            if key not in got.get(name, {}) or not torch.equal(got[name][key], tensor):
                return f"exported {name}:{key} differs"
    if list((run / "checkpoints").glob(".tmp-*")) or list(run.glob(".final.tmp-*")):
        return "temporary folders left"
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", default=",".join(CHAOS), help=f"comma-separated, of: {', '.join(CHAOS)}")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--seed", type=int, default=1000, help="trial t of feature f uses seed + 100 f + t")
    p.add_argument("--out", default="bench-results/chaos")
    a = p.parse_args()
    # SIGTERM as Ctrl-C: the campaign stops, and the job it was running is killed with it (tests/chaos.py)
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.default_int_handler(signum, frame))
    features = a.features.split(",")
    unknown = [f for f in features if f not in CHAOS]
    if unknown:
        raise SystemExit(f"unknown feature(s) {', '.join(unknown)}; choose from {', '.join(CHAOS)}")
    out = Path(a.out).resolve()
    env = base_env(PYTHONPATH=os.pathsep.join([str(FAULT_PLUGIN), str(REPO / "tests" / "reward_plugin")]))
    rows, failures, started = [], [], time.monotonic()
    for f, feature in enumerate(features):
        options, _ = CHAOS[feature]
        sections = sections_of(options)
        folder = out / feature
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "reference").mkdir(parents=True)
        config = tiny_config(folder / "reference", **_merge(sections, {"plugins": ["hfsdp_faults"]}))
        campaign(2, config, folder / "reference" / "run", STEPS, [], env, folder / "reference" / "logs")
        interrupted: collections.Counter = collections.Counter()
        kills = failed = 0
        for t in range(a.trials):
            seed = a.seed + 100 * f + t
            trial = folder / f"trial-{t}"
            trial.mkdir()
            config = tiny_config(trial, **_merge(sections, {"plugins": ["hfsdp_faults"], "train": {"save_every": 1}}))
            try:
                done = campaign(2, config, trial / "run", STEPS, schedule(seed, a.kills), env, trial / "logs")
                differs = same_run(trial / "run", folder / "reference" / "run")
                said = done.describe()
            except AssertionError as err:
                done, differs, said = None, "did not finish", str(err).splitlines()[0]
            if done is not None:
                kills += len(done.kills)
                interrupted.update(k.interrupted for k in done.kills)
            if differs:
                failed += 1
                failures.append(f"{feature} seed {seed}: {differs}; {said}")
            else:
                shutil.rmtree(trial)  # a passing trial's checkpoints: gigabytes over a campaign
        rows.append((feature, a.trials, kills, dict(interrupted), failed))
        print(f"{feature}: {a.trials} trials, {kills} kills ({', '.join(f'{k} {v}' for k, v in interrupted.items())}), "
              f"{failed} failed", flush=True)
    print(f"\n2 gloo ranks, FSDP2, the tiny model, {STEPS} steps a run, a checkpoint every step; {a.kills} kills "
          f"scheduled per trial (the first in the start-up, the last after the last step); "
          f"{(time.monotonic() - started) / 60:.0f} min\n")
    print("| feature | trials | kills survived | what they interrupted | failures |\n|---|---|---|---|---|")
    for feature, trials, kills, what, failed in rows:
        print(f"| {feature} | {trials} | {kills} | {', '.join(f'{k} {v}' for k, v in sorted(what.items()))} | {failed} |")
    total = sum(r[2] for r in rows)
    print(f"| all | {sum(r[1] for r in rows)} | {total} | | {len(failures)} |")
    for line in failures:
        print(f"FAILED {line}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("chaos_campaign.py: stopped; the job in flight was killed", file=sys.stderr)
        sys.exit(130)
