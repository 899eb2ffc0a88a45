"""A user's error on N ranks, in hfsdp's words once: every rank finds a config error, the first of a node's ranks to
fail prints it and each writes it into its torchrun error file; through `hfsdp launch` the job then exits 2 with that
sentence alone. torchrun and `accelerate launch` themselves exit 1 with their own report of any failed worker (a
worker cannot change that), which shows hfsdp's sentence in place of a link.

`accelerate launch --cpu --num_processes 2` starts one process; 2 CPU processes are its multi-GPU launcher on a
machine without GPUs (`--multi_gpu --num_processes 2`: torchrun underneath, hfsdp runs gloo), as
tests/test_multinode.py launches it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import base_env, rank_errors, run_torchrun, tiny_config

SENTENCE = ("hfsdp: error: --set: 1 problem(s)\n  train.max_steps: Input should be a valid integer, unable to parse "
            "string as an integer (got 'abc')\n")


def no_traceback_of_hfsdp(proc) -> None:
    assert "/hfsdp/" not in "".join(line for line in proc.stderr.splitlines() if line.lstrip().startswith("File "))


def test_a_config_error_on_2_torchrun_ranks_is_said_once_and_named_in_torchruns_report(tmp_path):
    proc = run_torchrun(2, "train", str(tiny_config(tmp_path)), "--set", "train.max_steps=abc", check=False)
    assert proc.returncode == 1  # torchrun's, whatever its workers exit with
    assert len(rank_errors(proc)) == 1 and SENTENCE.splitlines()[1] in proc.stderr, proc.stderr[-3000:]
    no_traceback_of_hfsdp(proc)
    assert "  traceback : hfsdp: error: --set: 1 problem(s)" in proc.stderr  # the root cause's error file
    assert not (tmp_path / "run").exists()


def test_hfsdp_launch_ends_a_job_with_the_error_once_and_exit_2(tmp_path):
    config = str(tiny_config(tmp_path))
    launch = [sys.executable, "-m", "hfsdp", "launch", "--nproc-per-node", "2"]
    proc = subprocess.run([*launch, "train", config, "--set", "train.max_steps=abc"], env=base_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr in (f"[rank {rank}] {SENTENCE}" for rank in (0, 1)), proc.stderr[-3000:]  # that alone
    ok = subprocess.run([*launch, "validate", config, "--no-rows"], env=base_env(), capture_output=True, text=True,
                        timeout=300)  # the ranks run the command; the job's exit is theirs
    assert ok.returncode == 0 and ok.stdout.count("output_dir:") == 2, ok.stderr[-3000:]


def test_a_config_error_on_2_ranks_of_accelerate_launch_is_said_once(tmp_path):
    env = base_env(PATH=f"{Path(sys.executable).parent}:{base_env()['PATH']}")
    proc = subprocess.run(["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hfsdp", "train",
                           str(tiny_config(tmp_path)), "--set", "train.max_steps=abc"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # accelerate's, as torchrun's
    assert len(rank_errors(proc)) == 1 and SENTENCE.splitlines()[1] in proc.stderr, proc.stderr[-3000:]
    no_traceback_of_hfsdp(proc)
