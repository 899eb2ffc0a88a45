"""The benchmarks docs/benchmarks.md cites keep running (issue 33 §5, issue 40 §5): a peer benchmark that cannot run
fails the build, instead of rotting until someone needs its figures.

* Every script in ``benchmarks/`` answers ``--help`` (a plugin module that a script enables is no script).
* A benchmark stopped by SIGTERM stops the training it started the way hfsdp documents (a checkpoint, exit 143)
  instead of leaving it running (``benchmarks/subprocesses.py``, which every script starts its runs through).
* ``benchmarks/peers.py`` runs for real, shrunk: one round of 2 steps of hfsdp, the bare Accelerate loop, TRL's
  SFTTrainer, hfsdp's LoRA and TRL + peft's, and the machine's floor (``benchmarks/floor.py``) on the tiny model
  (one process), and of hfsdp, the bare FSDP loop and the floor on 2 gloo ranks. Its figures are
  not checked (a shared machine), only that each tool trained the same rows and the table was written.
* ``benchmarks/sampling.py`` runs one round on the tiny model: the inline sampler and ``generate`` sample the same
  completions (its figures not checked either).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from hfsdp.checkpoint import store

from conftest import REPO, base_env, tiny_config

# The scripts (a benchmark's plugin module, such as soak_rss.py, is imported by its script, not run)
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_benchmark_answers_help(script):
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=base_env(),
                          timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


# the scripts that start a process themselves, not through benchmarks/subprocesses.py: data_scale.py (itself, to
# measure one tokenization; no training), goals.py (inside the wrapper that measures a command's peak memory, which
# passes the signals on itself), chaos_campaign.py (tests/chaos.py kills and restarts the jobs it starts, and kills
# the one in flight when it is stopped itself)
OWN_CHILDREN = {"data_scale.py", "goals.py", "chaos_campaign.py", "subprocesses.py"}


def test_benchmarks_start_their_runs_through_the_helper_that_passes_signals_on():
    raw = sorted(p.name for p in (REPO / "benchmarks").glob("*.py")
                 if re.search(r"subprocess\.(run|Popen|call|check_call|check_output)\(", p.read_text()))
    assert set(raw) <= OWN_CHILDREN, raw


@pytest.mark.slow
def test_a_benchmark_stopped_by_sigterm_stops_its_training_with_a_checkpoint(tmp_path):
    """A script that runs ``hfsdp train`` through ``subprocesses.run`` (as benchmarks/trl_grpo.py does) gets
    SIGTERM at step 2 or later: the run saves the step it is at and exits 143, the script exits 143 after it, and no
    process of the run is left (a plain ``subprocess.run`` left the training running, orphaned)."""
    import psutil

    config = tiny_config(tmp_path, train={"max_steps": 500, "save_every": None, "eval_at_start": False,
                                          "per_device_batch_size": 1, "log_every": 1})
    script = tmp_path / "bench.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'benchmarks')!r})\nimport subprocesses\n"
                      f"subprocesses.run([sys.executable, '-m', 'hfsdp', 'train', {str(config)!r}], check=True)\n")
    bench = subprocess.Popen([sys.executable, str(script)], env=base_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= 2):
        assert bench.poll() is None and time.monotonic() < deadline, bench.stderr.read()[-3000:]
        time.sleep(0.1)
    bench.send_signal(signal.SIGTERM)
    err = bench.communicate(timeout=120)[1]
    assert bench.returncode == 143, err[-3000:]
    assert "stopped by signal 15" in err and "exited 143" in err, err[-3000:]
    assert "hfsdp: stopped by SIGTERM" in err or "SIGTERM" in err
    checkpoint = store.latest(tmp_path / "run" / "checkpoints")
    assert checkpoint is not None and int(checkpoint.name[5:]) >= 2, err[-3000:]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(config) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,tools", [(1, "hfsdp,bare,trl,floor,hfsdp-lora,trl-lora"),
                                         pytest.param(2, "hfsdp,bare,floor", marks=pytest.mark.full_matrix)],
                         ids=["x1", "x2"])
def test_peer_benchmark_runs_every_tool_on_the_same_rows(tmp_path, tiny_model_dir, nproc, tools):
    out = tmp_path / "peers"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "peers.py"), "--nproc", str(nproc), "--rounds", "1", "--steps",
         "2", "--warmup", "1", "--tools", tools, "--out", str(out), "--set", "model.name_or_path=smollm2-tiny",
         "--set", f"train.output_dir={tmp_path / 'runs'}"],
        capture_output=True, text=True, env=base_env(), timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "peers.json").read_text())
    rounds = result["rounds"]
    assert len(rounds) == 1 and sorted(rounds[0]) == sorted(tools.split(","))
    tokens = {tool: r["tokens"] for tool, r in rounds[0].items()}
    assert all(t == tokens["hfsdp"] and len(t) == 2 and min(t) > 0 for t in tokens.values()), tokens
    table = (out / "peers.md").read_text()
    assert table.count("|") > 10
    if "floor" in tools:  # the floor's parts, each timed, and hfsdp against it
        parts = json.loads((out / "round1" / "floor" / "floor.json").read_text())["parts_s"]
        expected = ["attention", "head_gemms", "layer_gemms", "optimizer"] + (["collectives"] if nproc > 1 else [])
        assert sorted(parts) == sorted(expected) and min(parts.values()) > 0, parts
        assert "hfsdp ÷ floor: tokens/s" in table
    if "trl-lora" in tools:  # TRL + peft trained the adapters only, and hfsdp's LoRA is compared with it
        trainable = {t: json.loads((out / "round1" / t / f"{t}.json").read_text())["trainable_parameters"]
                     for t in ("trl", "trl-lora")}
        assert 0 < trainable["trl-lora"] < trainable["trl"] / 10, trainable
        assert "hfsdp-lora ÷ trl-lora: tokens/s" in table


@pytest.mark.slow
def test_sampling_benchmark_compares_the_inline_sampler_with_generate(tmp_path, tiny_model_dir):
    """benchmarks/sampling.py on the tiny model, one round: both paths sample the same completions, and it says
    how fast each was."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "sampling.py"), "--rounds", "1", "--repeats", "1", "--set",
         "model.name_or_path=smollm2-tiny"], capture_output=True, text=True, env=base_env(), timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("same completions") == 2 and "DIFFERENT" not in proc.stdout, proc.stdout
    assert re.search(r"generate [\d.]+, inline [\d.]+: [\d.]+x", proc.stdout), proc.stdout
