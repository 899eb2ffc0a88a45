"""The workers engine (``grpo.generation.engine: workers``, hfsdp.builtin.online.engine) through the real CLI on the
shrunk SmolLM2 with LoRA, the KL to the base and 2 iterations a round (tests/conftest.py ``grpo_config``): generation
processes beside the trainer sample the rounds, each with the policy ``max_staleness`` rounds old, exactly. Claims:
``max_staleness: 0`` trains bit for bit what the inline engine trains; at ``max_staleness: 1`` the rounds are
token-identical with 1 and 2 generation processes and with 1 and 2 training ranks, across a kill -9 of a
generation process (restarted) and of the whole job (resumed with the rounds in flight from its checkpoint); a
generation process that hangs stops the run within the wait, naming it, the last checkpoint intact."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hfsdp.checkpoint import store

from conftest import (REPO, REWARDS, base_env, grpo_config, read_completions, read_metrics, run_cli,
                      run_torchrun)
from test_distill_online import online_config
from test_rloo import rloo_config

FAULTS = REPO / "tests" / "fault_plugin"
STEPS = 6  # three rounds of 2 steps
TIMING = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "tflops", "mem_rss_gib", "mem_peak_rss_gib",
          "generation_s")


def engine_config(folder: Path, world: int, generation: dict | None, train: dict | None = None,
                  plugins: tuple[str, ...] = ()) -> Path:
    return grpo_config(folder, world, plugins=plugins, grpo={"generation": generation or {}},
                       train={"max_steps": STEPS, **(train or {})})


def env(faults: str = "") -> dict[str, str]:
    return base_env(PYTHONPATH=os.pathsep.join([str(REWARDS), str(FAULTS)]),
                    **({"HFSDP_TEST_FAULTS": faults} if faults else {}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (run folder, console)."""
    root = tmp_path_factory.mktemp("engine")
    out = {}
    for name, world, generation in (("inline", 1, None),
                                    ("stale0", 1, {"engine": "workers"}),
                                    ("stale1", 1, {"engine": "workers", "max_staleness": 1}),
                                    ("stale1_p2", 1, {"engine": "workers", "max_staleness": 1, "processes": 2}),
                                    ("stale1_x2", 2, {"engine": "workers", "max_staleness": 1}),
                                    ("bf16", 1, {"engine": "workers", "dtype": "bfloat16"})):
        config = engine_config(root / name, world, generation)
        proc = run_cli("train", str(config), env=env()) if world == 1 else run_torchrun(2, "train", str(config),
                                                                                       env=env())
        out[name] = (root / name / "run", proc.stdout + proc.stderr)
    return out


def steps(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run) if "loss" in m}


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return {f"{file.name}:{key}": tensor for file in sorted((run / "final").glob("*.safetensors"))
            for key, tensor in load_file(file).items()}


def same_weights(a: Path, b: Path) -> bool:
    got, want = final_weights(a), final_weights(b)
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_staleness_0_trains_bit_for_bit_what_the_inline_engine_trains(runs):
    inline, stale0 = runs["inline"][0], runs["stale0"][0]
    assert read_completions(stale0) == read_completions(inline)
    a, b = steps(inline), steps(stale0)
    for step in range(1, STEPS + 1):
        for key, value in a[step].items():
            if key not in TIMING:
                assert b[step][key] == value, (step, key, a[step], b[step])
        assert b[step]["generation/staleness"] == 0
    assert same_weights(stale0, inline)
    # the sampler's log-probs are the trainer's, measured: no mismatch, every importance-sampling ratio 1
    assert {b[s]["sampling/sampling_logp_difference/max"] for s in b} == {0.0}
    assert {(b[s]["sampling/importance_sampling_ratio/min"], b[s]["sampling/importance_sampling_ratio/max"])
            for s in b} == {(1.0, 1.0)}


@pytest.mark.slow
def test_a_bfloat16_sampling_copy_brings_a_mismatch_the_metrics_show_and_the_ratio_corrects(runs):
    metrics = steps(runs["bf16"][0])
    assert all(metrics[s]["sampling/sampling_logp_difference/max"] > 1e-3 for s in metrics)
    assert all(metrics[s]["sampling/importance_sampling_ratio/max"] != 1.0 for s in metrics)
    assert metrics[1]["generation/sync_bytes"] < steps(runs["stale0"][0])[1]["generation/sync_bytes"] * 0.6


@pytest.mark.slow
def test_staleness_1_samples_each_round_but_the_first_with_the_policy_a_round_old(runs):
    inline, stale1 = runs["inline"][0], runs["stale1"][0]
    first = [c for c in read_completions(stale1) if c["step"] == 1]
    assert first == [c for c in read_completions(inline) if c["step"] == 1]  # round 0: version 0 either way
    # round 1 (step 3) was sampled by version 0, not 1: other tokens than inline's (the adapters moved)
    later = [c["completion_ids"] for c in read_completions(stale1) if c["step"] == 3]
    assert later and later != [c["completion_ids"] for c in read_completions(inline) if c["step"] == 3]
    metrics = steps(stale1)
    assert [metrics[s]["generation/staleness"] for s in (1, 3, 5)] == [0, 1, 1]
    # the first sync writes the frozen base too, the later ones the adapters only
    assert 0 < metrics[3]["generation/sync_bytes"] < metrics[1]["generation/sync_bytes"] / 100
    assert metrics[2]["generation/sync_bytes"] == 0  # no round sampled at step 2


@pytest.mark.slow
def test_two_generation_processes_sample_the_rounds_one_samples(runs):
    assert read_completions(runs["stale1_p2"][0]) == read_completions(runs["stale1"][0])
    assert same_weights(runs["stale1_p2"][0], runs["stale1"][0])


@pytest.mark.slow
def test_two_ranks_train_on_the_rounds_one_process_trains_on(runs):
    one, two = runs["stale1"][0], runs["stale1_x2"][0]
    assert read_completions(two) == read_completions(one)
    a, b = steps(one), steps(two)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "reward", "kl"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_a_killed_generation_process_is_restarted_and_the_run_ends_as_the_uninterrupted_one(runs, tmp_path):
    config = engine_config(tmp_path, 1, {"engine": "workers", "max_staleness": 1}, plugins=("hfsdp_faults",))
    proc = run_cli("train", str(config), env=env("sigkill_generation@1"))
    assert "grpo.generation: generation process 0 ended (exit code -9); restarted" in proc.stdout, proc.stdout[-3000:]
    run = tmp_path / "run"
    assert steps(run)[STEPS]["generation/restarts"] == 1
    assert read_completions(run) == read_completions(runs["stale1"][0])
    assert same_weights(run, runs["stale1"][0])


@pytest.mark.slow
def test_the_job_killed_with_a_round_in_flight_resumes_with_it_from_its_checkpoint(runs, tmp_path):
    """kill -9 at the end of step 2, before its checkpoint: the step-1 checkpoint (inside round 0; round 1, sampled by
    version 0, in flight) holds round 1, which the resume trains on as the uninterrupted run did."""
    config = engine_config(tmp_path, 1, {"engine": "workers", "max_staleness": 1}, train={"save_every": 1},
                           plugins=("hfsdp_faults",))
    killed = run_cli("train", str(config), env=env("sigkill@2"), check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_cli("train", str(config), "--resume", env=env())
    assert "step-1 at step 1" in resumed.stdout, resumed.stdout[-3000:]
    run, whole = tmp_path / "run", runs["stale1"][0]
    assert read_completions(run) == read_completions(whole)
    assert {s: (m["loss"], m["grad_norm"]) for s, m in steps(run).items()} == {
        s: (m["loss"], m["grad_norm"]) for s, m in steps(whole).items()}
    assert same_weights(run, whole)


@pytest.mark.slow
def test_a_hung_generation_process_stops_the_run_naming_it_and_the_checkpoint_stays(tmp_path):
    """The generation process is frozen (SIGSTOP) after step 2; round 1 (step 3) waits for it half of
    collective_timeout_s (15 s), then the run stops with the process named, step-2 complete for --resume."""
    config = engine_config(tmp_path, 1, {"engine": "workers"}, train={"save_every": 2, "collective_timeout_s": 30},
                           plugins=("hfsdp_faults",))
    started = time.monotonic()
    proc = run_cli("train", str(config), env=env("sigstop_generation@2"), check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - started < 120
    assert ("grpo.generation: generation process 0 (pid " in proc.stderr and "did not answer within 15 s (round 1)"
            in proc.stderr), proc.stderr[-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert store.latest(checkpoints) == checkpoints / "step-2" and sorted(steps(tmp_path / "run")) == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["rloo", "distill_online"])
def test_rloo_and_on_policy_distillation_train_through_the_engine_what_they_train_inline(objective, tmp_path,
                                                                                          tiny_teacher_dir):
    config = (rloo_config(tmp_path, 1) if objective == "rloo" else online_config(tmp_path, 1, tiny_teacher_dir))
    for name, engine in (("inline", "inline"), ("workers", "workers")):
        run_cli("train", str(config), "--set", f"{objective}.generation.engine={engine}", "--set",
                f"train.output_dir={tmp_path / name}", env=env())
    assert read_completions(tmp_path / "workers") == read_completions(tmp_path / "inline")
    a, b = steps(tmp_path / "inline"), steps(tmp_path / "workers")
    assert {s: (m["loss"], m["grad_norm"]) for s, m in a.items()} == {s: (m["loss"], m["grad_norm"])
                                                                      for s, m in b.items()}
    assert {m["sampling/sampling_logp_difference/max"] for m in b.values()} == {0.0}


def test_what_the_workers_engine_does_not_run_is_refused_naming_the_key(tmp_path):
    config = grpo_config(tmp_path, 1, grpo={"generation": {"engine": "workers"}, "tools": ["python"]})
    proc = run_cli("validate", str(config), check=False, env=env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("grpo.generation.engine: the workers engine samples single-turn completions: rollouts that call tools"
            in proc.stderr), proc.stderr


@pytest.mark.slow
def test_the_generation_processes_say_nothing_the_trainer_hides(runs):
    """A generation process builds LoRA's model with peft (which imports bitsandbytes, whose CPU backend logs a
    kernel it cannot fetch offline) and hides the libraries' warnings as the CLI does."""
    for name in ("stale1", "stale1_x2"):
        console = runs[name][1]
        assert "kernels-community" not in console and "Warning" not in console, console[-3000:]
