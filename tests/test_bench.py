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
    proc = run_cli("bench", "--strategies", "FULL_SHARD,NO_SHARD", "--nproc", "1,2", "--steps", "2",
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


def test_bench_one_process_runs_each_strategy_as_fsdp_when_asked(tmp_path, tiny_model_dir):
    """With fsdp.single_process: fsdp one process is a one-rank FSDP, a real strategy per row; FSDP2 NO_SHARD
    (DDP, nothing at one process) still runs without a wrapper."""
    out = tmp_path / "bench"
    run_cli("bench", "--strategies", "FULL_SHARD,NO_SHARD", "--nproc", "1", "--steps", "2", "--out", str(out),
            "--set", "model.name_or_path=smollm2-tiny", "--set", "data.max_seq_len=64",
            "--set", "fsdp.single_process=fsdp", timeout=900)
    rows = json.loads((out / "bench.json").read_text())["rows"]
    assert [(r["strategy"], r["runs_as"]) for r in rows] == [("FULL_SHARD", "FSDP"), ("none (1 process)", "NO")]


def test_bench_table_is_narrow_unless_wide():
    from hfsdp.tools.bench import COLUMNS, NARROW, markdown_table, text_table

    row = {key: 1.0 for key, _, _ in COLUMNS} | {"model": "m", "strategy": "FULL_SHARD"}
    narrow, wide = markdown_table([row]).splitlines()[0], markdown_table([row], wide=True).splitlines()[0]
    assert narrow.count("|") == len(NARROW) + 1 and wide.count("|") == len(COLUMNS) + 1
    assert "mem before load MiB" in wide and "mem before load MiB" not in narrow
    assert text_table([row]).splitlines()[0].split()[:2] == ["model", "ranks"]


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
