"""The tests' launcher (tests/fork_server.py) against the real thing: a process forked from the server is the
``python -m`` process, and its forked ranks the torchrun workers, that the tests would otherwise start.

* The same start: environment (every variable torchrun gives a worker, with the same values but the job's own port
  and error-file folder), argv, ``sys.path[0]``, working directory, ``__main__``, stdio buffering.
* The same run: a 2-rank FSDP2 run with checkpoints trains the same losses and grad norms bit for bit, prints the
  same lines and exports the same weights whether torchrun or the fork server started its ranks; one process the
  same against ``python -m hfsdp``.
* The same failure: a rank that exits 3 ends the job with exit 1 and torchrun's report of it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import REPO, _launch, base_env, read_metrics, tiny_config

TESTS = REPO / "tests"
# Values that are the job's own: its rendezvous port and the folder of its ranks' error files
PER_JOB = ("MASTER_PORT", "TORCHELASTIC_ERROR_FILE")


def probe(tmp_path: Path, name: str, nproc: int, launcher: str, **env: str):
    out = tmp_path / name
    out.mkdir()
    proc = _launch(nproc, [str(out)], TESTS, base_env(**env), timeout=120, module="launch_probe", launcher=launcher)
    return proc, {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def comparable(facts: dict) -> dict:
    env = {k: ("<job's own>" if k in PER_JOB else v) for k, v in facts["env"].items() if k != "PYTEST_CURRENT_TEST"}
    return {**facts, "env": env, "argv": [facts["argv"][0], "<out>"], "threads": None}


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_forked_process_starts_as_a_fresh_one_or_a_torchrun_worker(tmp_path, nproc):
    real, want = probe(tmp_path, "real", nproc, "fresh")
    forked, got = probe(tmp_path, "forked", nproc, "fork")
    assert real.returncode == forked.returncode == 0, (real.stderr[-3000:], forked.stderr[-3000:])
    assert sorted(got) == sorted(want) == [str(r) for r in range(nproc)]
    for rank in want:
        assert comparable(got[rank]) == comparable(want[rank])
        assert got[rank]["threads"] == 1  # nothing runs beside the main thread at the start (forking is safe)
    if nproc == 2:
        env = got["0"]["env"]
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["WORLD_SIZE"] == "2"  # joined the agent's store
    # the ranks' lines, whatever their order (two ranks' writes may interleave within a line of the shared stdout)
    assert sorted(re.findall(r"probe \d+ done", forked.stdout)) == sorted(re.findall(r"probe \d+ done", real.stdout))
    assert len(re.findall(r"probe \d+ done", real.stdout)) == nproc


def test_without_omp_num_threads_both_set_it_to_1_and_say_so(tmp_path):
    env = base_env()
    env.pop("OMP_NUM_THREADS")
    outs = {}
    for launcher in ("fresh", "fork"):
        out = tmp_path / launcher
        out.mkdir()
        proc = _launch(2, [str(out)], TESTS, env, timeout=120, module="launch_probe", launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default" in proc.stderr
        outs[launcher] = json.loads((out / "1.json").read_text())["env"]["OMP_NUM_THREADS"]
    assert outs == {"fresh": "1", "fork": "1"}


def test_a_failing_rank_ends_both_jobs_with_torchruns_report(tmp_path):
    for launcher in ("fresh", "fork"):
        out = tmp_path / launcher
        out.mkdir()
        proc = _launch(2, [str(out)], TESTS, base_env(HFSDP_TEST_PROBE_EXIT_RANK="1"), timeout=120,
                       module="launch_probe", launcher=launcher)
        assert proc.returncode == 1, (launcher, proc.stderr[-3000:])
        assert "probe failing on purpose" in proc.stderr
        assert "ChildFailedError" in proc.stderr and "launch_probe FAILED" in proc.stderr, proc.stderr[-3000:]
        assert re.search(r"rank      : 1 \(local_rank: 1\)\n  exitcode  : 3 \(pid: \d+\)", proc.stderr), proc.stderr
        assert "failed (exitcode: 3) local_rank: 1" in proc.stderr


def _console(text: str) -> list[str]:
    """The lines a run prints that do not depend on the clock (progress bars, timings and paths of the job aside)."""
    keep = []
    for line in text.splitlines():
        if "\r" in line or "/s" in line or "s/it" in line or re.search(r"\d+(\.\d+)? ?s\b", line):
            continue
        keep.append(line)
    return keep


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_forked_launcher_and_the_real_one_give_the_same_run(tmp_path, nproc):
    """The same config (FSDP2, checkpoints at steps 2 and 4, export) trained by torchrun (or ``python -m hfsdp``)
    and by the fork server: every metric bit for bit, the same exported tensors, the same console."""
    import torch
    from safetensors.torch import load_file

    runs = {}
    for launcher in ("fresh", "fork"):
        folder = tmp_path / launcher
        folder.mkdir()
        config = tiny_config(folder, train={"max_steps": 4, "save_every": 2}, fsdp={"single_process": "fsdp"})
        proc = _launch(nproc, ["train", str(config)], folder, base_env(), timeout=600, launcher=launcher)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[launcher] = (folder / "run", proc)
    (real, real_proc), (forked, forked_proc) = runs["fresh"], runs["fork"]
    timing = ("_s", "tokens_per_s", "tok_s", "time", "mem", "tflops")  # the clock's
    strip = [{k: v for k, v in m.items() if not any(t in k for t in timing)} for m in read_metrics(real)]
    assert [{k: v for k, v in m.items() if not any(t in k for t in timing)} for m in read_metrics(forked)] == strip
    assert any("loss" in m for m in strip)
    a, b = load_file(str(real / "final" / "model.safetensors")), load_file(str(forked / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (forked / "checkpoints").iterdir()) == ["step-2", "step-4"]
    paths = (str(real.parent), str(forked.parent))
    assert _console(forked_proc.stdout.replace(*reversed(paths))) == _console(real_proc.stdout), forked_proc.stdout
