"""The benchmarks docs/benchmarks.md cites keep running (issue 33 §5, issue 40 §5): a peer benchmark that cannot run
fails the build, instead of rotting until someone needs its figures.

* Every script in ``benchmarks/`` answers ``--help`` (a plugin module that a script enables is no script).
* ``benchmarks/peers.py`` runs for real, shrunk: one round of 2 steps of hfsdp, the bare Accelerate loop, TRL's
  SFTTrainer, hfsdp's LoRA and TRL + peft's, and the machine's floor (``benchmarks/floor.py``) on the tiny model
  (one process), and of hfsdp, the bare FSDP loop and the floor on 2 gloo ranks. Its figures are
  not checked (a shared machine), only that each tool trained the same rows and the table was written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, base_env

# The scripts (a benchmark's plugin module, such as soak_rss.py, is imported by its script, not run)
SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_benchmark_answers_help(script):
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=base_env(),
                          timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,tools", [(1, "hfsdp,bare,trl,floor,hfsdp-lora,trl-lora"), (2, "hfsdp,bare,floor")],
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
