"""`hfsdp bench` end to end: real 1- and 2-rank gloo runs of the shrunk SmolLM2, and the table files they produce."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from conftest import REPO, base_env, run_cli

pytestmark = pytest.mark.slow


def test_bench_tiny_full_shard_halves_state_bytes(tmp_path, tiny_model_dir):
    out = tmp_path / "bench"
    proc = run_cli("bench", "--strategies", "FULL_SHARD,NO_SHARD", "--nproc", "1,2", "--steps", "2", "--profile",
                   "--out", str(out), "--set", "model.name_or_path=smollm2-tiny", "--set", "data.max_seq_len=64",
                   timeout=900)
    assert "p+g+o ÷ NO_SHARD" in proc.stdout
    for name in ("bench.md", "bench.csv", "bench.json", "bench.png"):
        assert (out / name).is_file(), name
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    expected = {"model", "parameters_m", "world_size", "strategy", "fsdp_version", "precision", "param_mib",
                "grad_mib", "optim_mib", "state_mib", "mem_peak_mib", "step_time_s", "tokens_per_s",
                "state_vs_no_shard", "peak_vs_no_shard", "tokens_per_s_vs_1proc"}
    assert expected <= set(rows[0]), expected - set(rows[0])
    # One process trains without a wrapper (fsdp.single_process: auto), the same steps for both: run once.
    assert [(r["strategy"], r["world_size"]) for r in rows] == [
        ("none (1 process)", "1"), ("FULL_SHARD", "2"), ("NO_SHARD", "2")]
    assert "1 process without a wrapper" in proc.stdout and proc.stdout.count("bench: ") == 4  # 3 runs + wrote
    report = (out / "bench.md").read_text()
    assert "| model | ranks | strategy | FSDP | p+g+o MiB/rank | peak above base MiB | tokens/s |" in report
    assert "MALLOC_MMAP_THRESHOLD_=65536" in report  # CPU runs return freed memory, and say so

    data = json.loads((out / "bench.json").read_text())["rows"]
    by = {(r["strategy"], r["world_size"]): r for r in data}
    full, ddp = by[("FULL_SHARD", 2)], by[("NO_SHARD", 2)]
    # Deterministic byte counts from live tensors, not timings.
    assert full["grad_bytes"] > 0 and full["optim_bytes"] > 0
    assert full["state_bytes"] <= 0.51 * ddp["state_bytes"]
    one = by[("none (1 process)", 1)]
    assert one["runs_as"] == "NO" and one["fsdp_version"] == "- (no wrapper)"
    assert ddp["state_bytes"] == one["state_bytes"]
    assert full["state_vs_1proc"] == full["state_bytes"] / one["state_bytes"]
    assert full["optim_bytes"] == 2 * full["param_bytes"]  # Adam: two moments per local parameter
    assert all(r["tokens_per_s"] > 0 and r["mem_peak_mib"] > 0 for r in data)
    # --profile: every rank's step split; FSDP's hooks only under FSDP, collectives only on 2 ranks (DDP's
    # all-reduces too); the phases fit inside the iteration they were measured in (other: what is left of it)
    assert [len(r["profile_s"]) for r in data] == [1, 2, 2]
    for row in data:
        for parts in row["profile_s"]:
            assert all(parts[p] > 0 for p in ("forward", "backward", "clip", "optimizer")), parts
            assert parts["other"] > -0.01 * row["step_time_s"], parts
            assert (parts["fsdp_hooks"] > 0) == (row["runs_as"] == "FSDP"), (row["strategy"], parts)
            assert (parts["collectives"] > 0) == (row["world_size"] == 2), (row["strategy"], parts)
    assert "## Where a step goes (--profile)" in report and all(f"| FULL_SHARD | 2 | {r} | " in report for r in (0, 1))
    assert "where each rank's step went" in proc.stdout


def test_bench_one_process_runs_each_strategy_as_fsdp_when_asked(tmp_path, tiny_model_dir):
    """With fsdp.single_process: fsdp one process is a one-rank FSDP, a real strategy per row; FSDP2 NO_SHARD
    (DDP, nothing at one process) still runs without a wrapper."""
    out = tmp_path / "bench"
    run_cli("bench", "--strategies", "FULL_SHARD,NO_SHARD", "--nproc", "1", "--steps", "2", "--out", str(out),
            "--set", "model.name_or_path=smollm2-tiny", "--set", "data.max_seq_len=64",
            "--set", "fsdp.single_process=fsdp", timeout=900)
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(r["strategy"], r["runs_as"]) for r in rows] == [("FULL_SHARD", "FSDP"), ("none (1 process)", "NO")]


def test_bench_profile_splits_fsdp1_steps_with_accumulation_and_lora(tmp_path, tiny_model_dir):
    """--profile under FSDP1 (its hooks are named FullyShardedDataParallel.*), two micro-batches a step (the
    phases summed over them) and LoRA adapters: FSDP's hooks and collectives found on both ranks."""
    out = tmp_path / "bench"
    run_cli("bench", "--strategies", "FULL_SHARD", "--nproc", "2", "--steps", "2", "--profile", "--out", str(out),
            "--set", "model.name_or_path=smollm2-tiny", "--set", "data.max_seq_len=64", "--set", "fsdp.version=1",
            "--set", "train.gradient_accumulation_steps=2", "--set", "plugins=[lora]", timeout=600)
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert row["fsdp_version"] == 1 and len(row["profile_s"]) == 2
    for parts in row["profile_s"]:
        assert all(parts[p] > 0 for p in ("forward", "backward", "fsdp_hooks", "clip", "optimizer", "collectives"))
        assert parts["other"] > -0.01 * row["step_time_s"], parts


def test_profile_split_subtracts_fsdp_hooks_from_their_phase_and_unites_collectives_in_flight():
    """bench_probe.split on a trace of two iterations: a hook nested in another counts once, inside the phase
    that holds it; overlapping collectives on two threads count their union; events outside the iterations none."""
    from types import SimpleNamespace

    from hfsdp.builtin.bench_probe import STEP_MARK, split

    def event(name, start, end, parent=None):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, time_range=span, cpu_parent=parent)

    forward = event("hfsdp.forward", 100, 600_100)
    hook = event("FSDP::pre_forward (0)", 200, 100_200, forward)
    events = [event(STEP_MARK, 0, 0), forward, hook, event("FSDP::all_gather (0)", 300, 50_300, hook),
              event("hfsdp.backward", 600_200, 900_200), event("gloo:all_gather", 250, 80_250),
              event("gloo:all_reduce", 50_000, 100_000), event("hfsdp.optimizer", 900_300, 950_300),
              event(STEP_MARK, 1_000_000, 1_000_000), event("hfsdp.forward", 1_000_100, 1_500_100),
              event(STEP_MARK, 2_000_000, 2_000_000), event("hfsdp.forward", 2_100_000, 2_200_000)]
    parts = split(events, [1.0, 1.0])
    assert parts["forward"] == [0.5, 0.5] and parts["fsdp_hooks"] == [0.1, 0.0]
    assert parts["backward"] == [0.3, 0.0] and parts["optimizer"] == [0.05, 0.0] and parts["clip"] == [0.0, 0.0]
    assert parts["collectives"] == [0.09975, 0.0]  # 250..100,000 us
    assert parts["other"] == pytest.approx([0.05, 0.5])


def test_bench_profile_is_refused_on_gpus_before_any_run(tmp_path, monkeypatch):
    from hfsdp.tools import bench

    monkeypatch.setattr(bench, "_cuda_devices", lambda: 1)
    with pytest.raises(ValueError, match="--profile splits CPU steps"):
        bench.bench(bench.BenchOptions(config="tiny", strategies=["FULL_SHARD"], nprocs=[1], steps=2,
                                       out=tmp_path, overrides=[], profile=True))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("trackers", ["tensorboard: true", "report_to: [tensorboard]", ""])
def test_bench_quiets_a_config_with_the_deprecated_tensorboard_key(tmp_path, trackers):
    """A config that still says train.tensorboard (benchmarks/peers.yaml did) benches: bench's own overrides
    turn its trackers off without adding train.report_to beside the key it replaced (refused)."""
    from hfsdp.config.files import read_config
    from hfsdp.rules.table import load_checked
    from hfsdp.tools.bench import quiet_run

    path = tmp_path / "c.yaml"
    path.write_text(f"base: tiny\ntrain: {{max_steps: 2, {trackers}}}\n".replace(", }", "}"))
    config, _ = load_checked(str(path), quiet_run(read_config(path)))
    assert config.train.report_to == [] and not config.train.loss_plot and not config.train.export_final


def test_bench_table_is_narrow_unless_wide():
    from hfsdp.tools.bench import COLUMNS, NARROW, markdown_table, text_table

    row = {key: 1.0 for key, _, _ in COLUMNS} | {"model": "m", "strategy": "FULL_SHARD", "active_parameters_m": None}
    narrow, wide = markdown_table([row]).splitlines()[0], markdown_table([row], wide=True).splitlines()[0]
    assert narrow.count("|") == len(NARROW) + 1 and wide.count("|") == len(COLUMNS) + 1
    assert "mem before load MiB" in wide and "mem before load MiB" not in narrow
    assert text_table([row]).splitlines()[0].split()[:2] == ["model", "ranks"]
    moe = markdown_table([row | {"active_parameters_m": 0.5}]).splitlines()[0]  # a mixture of experts: both counts
    assert moe.startswith("| model | params (M) | active params (M) | ranks |")


def test_help_does_not_import_torch():
    code = "import sys, hfsdp.cli; sys.argv=['hfsdp','bench','--help']\ntry:\n hfsdp.cli.main()\nexcept SystemExit: pass\n" \
           "assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=base_env(), capture_output=True)


def test_bench_without_matplotlib_does_not_claim_a_chart(tmp_path):
    """Without matplotlib (an import that fails, as when it is not installed) no bench.png is written or claimed."""
    blocker = tmp_path / "no_matplotlib"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    out = tmp_path / "bench"
    proc = run_cli("bench", "--strategies", "FULL_SHARD", "--nproc", "1", "--steps", "2", "--out", str(out),
                   "--set", "model.name_or_path=smollm2-tiny", "--set", "data.max_seq_len=64",
                   env=base_env(PYTHONPATH=str(blocker)), timeout=300)
    assert not (out / "bench.png").exists()
    assert "matplotlib is not installed" in proc.stdout and "bench.png" not in proc.stdout.splitlines()[-1]
    assert proc.stdout.splitlines()[-1] == f"bench: wrote {out}/bench.md, bench.csv, bench.json"


def test_a_sweep_runs_every_point_and_puts_the_plans_peak_beside_the_measured(tmp_path, tiny_model_dir):
    """``--seq-lens`` x ``--micro-batches`` on the tiny model, packed rows (chat rows are ~86 tokens: a 256-token
    sequence holds two or three), 1 process and 2 ranks: every point a real run, its tokens per micro-batch, and
    hfsdp plan's peak for the same point (issue 56, part 3: the sweep that CI runs in under a minute)."""
    out = tmp_path / "sweep"
    proc = run_cli("bench", "--strategies", "FULL_SHARD", "--nproc", "1,2", "--seq-lens", "128,256",
                   "--micro-batches", "1", "--steps", "2", "--out", str(out), "--set", "model.name_or_path=smollm2-tiny",
                   "--set", "plugins=[packing]", timeout=600)
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(r["world_size"], r["seq_len"], r["micro_batch"]) for r in rows] == [
        (1, 128, 1), (1, 256, 1), (2, 128, 1), (2, 256, 1)]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "FULL_SHARD-np1-seq128-mb1", "FULL_SHARD-np1-seq256-mb1", "FULL_SHARD-np2-seq128-mb1",
        "FULL_SHARD-np2-seq256-mb1"]
    for row in rows:
        assert 0 < row["micro_batch_tokens"] <= row["seq_len"] * row["micro_batch"]
        assert row["plan_peak_mib"] > 0 and row["tokens_per_s"] > 0
        assert row["plan_vs_measured"] == row["plan_peak_mib"] / row["mem_peak_above_base_mib"]
    by = {(r["world_size"], r["seq_len"]): r for r in rows}
    for world in (1, 2):  # packing fills the longer sequences with more rows; the plan's peak grows with them
        assert by[(world, 256)]["micro_batch_tokens"] > by[(world, 128)]["micro_batch_tokens"]
        assert by[(world, 256)]["plan_peak_mib"] > by[(world, 128)]["plan_peak_mib"]
    header = "| model | ranks | strategy | seq len | micro-batch | tokens/micro-batch | tokens/s | peak above base MiB |"
    report = (out / "bench.md").read_text()
    assert header in report and (out / "bench.png").is_file()
    assert "`plugins: [packing]` fills them" in report  # the config change the hint names exists
    assert "data.max_seq_len=256, train.per_device_batch_size=1" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["bench", "--seq-lens", "256,0"], "--seq-lens '256,0': give positive integers, e.g. 256,1024"),
    (["bench", "--micro-batches", "1,x"], "--micro-batches '1,x': give positive integers, e.g. 1,4"),
    (["plan", "--nproc", "0"], "--nproc '0': give positive process counts per node, e.g. 1,2,8"),
    (["plan", "--tp", ""], None),  # empty: the config's tp size, accepted
    (["plan", "--tp", "2,-1"], "--tp '2,-1': give positive tensor-parallel sizes, e.g. 1,8"),
], ids=["seq-lens", "micro-batches", "plan-nproc", "plan-tp-empty", "plan-tp"])
def test_lists_of_non_positive_integers_are_refused_before_anything_runs(tmp_path, args, message):
    out = ["--out", str(tmp_path / "b")] if args[0] == "bench" else ["--set", "model.name_or_path=smollm2-tiny"]
    proc = run_cli(*args, *out, check=False)
    if message is None:
        assert proc.returncode == 0, proc.stderr
        return
    assert proc.returncode == 2 and message in proc.stderr
    assert not (tmp_path / "b").exists()


def test_a_mixture_of_experts_is_benched_with_its_total_and_active_parameters(tmp_path):
    """The tiny Qwen3-MoE (8 experts a layer, 2 a token), one process: the table has its parameters and those a
    token computes with (the plan's count)."""
    from conftest import tiny_moe_folder
    from test_plan import plan_json

    out = tmp_path / "bench"
    overrides = ["--set", f"model.name_or_path={tiny_moe_folder('qwen3_moe')}", "--set", "data.max_seq_len=64"]
    proc = run_cli("bench", "--strategies", "FULL_SHARD", "--nproc", "1", "--steps", "2", "--out", str(out),
                   *overrides, timeout=900)
    header = proc.stdout.splitlines()[proc.stdout.splitlines().index(next(
        line for line in proc.stdout.splitlines() if "active params (M)" in line))]
    assert header.split()[:6] == ["model", "params", "(M)", "active", "params", "(M)"]
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    config = next((out / "runs").iterdir()) / "train" / "config.yaml"  # (the run's, bench_probe enabled)
    plan = plan_json(str(config), "--nproc", "1", "--strategies", "FULL_SHARD")
    assert row["active_parameters_m"] == pytest.approx(plan["active_parameters"] / 1e6)
    assert row["parameters_m"] == pytest.approx(plan["parameters"] / 1e6) and row["active_parameters_m"] < row[
        "parameters_m"]
