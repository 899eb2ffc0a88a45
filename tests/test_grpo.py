"""GRPO (plugin ``grpo``, format ``prompt``, hook ``hfsdp_reward_functions``) through the real CLI on the shrunk
SmolLM2: 2 gloo ranks sample, score and train what one process does (the same completions, rewards, losses and
gradient norms), with LoRA, the KL to the base (adapters disabled) and old log-probs kept over 2 iterations; the
metrics, completions.jsonl and the progress bar show it; a reward function that raises on one rank stops both,
naming the function and the rows. The loss math against TRL is tests/test_grpo_loss.py; driving TRL's GRPOTrainer
with the same completions is benchmarks/trl_grpo.py (not in CI). Resume and the FSDP1/FSDP2 matrix:
tests/test_combinations.py (option ``grpo``)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hfsdp.checkpoint import store

from conftest import (GRPO_STEPS as STEPS, PRESET_DATA, REPO, REWARDS, base_env, grpo_config, rank_errors,
                      read_completions, read_metrics, run_cli, run_torchrun)

pytestmark = pytest.mark.slow

FAULTS = REPO / "tests" / "fault_plugin"
METRICS = ("reward", "reward_std", "rewards/letters/mean", "rewards/json_fields/mean",
           "completion_length", "clip_ratio", "kl", "entropy")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (run folder, console); the global batch is 8 completions (4 prompts) a step in all. ``x2`` samples
    with the model gathered once per generate call (the default), ``x2_layers`` a layer at each decode step."""
    root = tmp_path_factory.mktemp("grpo")
    env = base_env(PYTHONPATH=str(REWARDS))
    out = {}
    for name, world, fsdp in (("x1", 1, {}), ("x2", 2, {}), ("x2_layers", 2, {"gather_for_generation": False}),
                              ("x4", 4, {})):
        config = grpo_config(root / name, world, **fsdp)
        proc = (run_cli("train", str(config), env=env) if world == 1
                else run_torchrun(world, "train", str(config), env=env))
        out[name] = (root / name / "run", proc.stdout + proc.stderr)
    return out


def steps(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run) if "loss" in m}


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_two_ranks_sample_score_and_train_what_one_process_does(runs):
    one, two = runs["x1"][0], runs["x2"][0]
    assert read_completions(one) == read_completions(two)  # the same tokens, rewards and advantages, every completion
    # a round is 2 steps
    assert len(read_completions(one)) == 16 and {c["step"] for c in read_completions(one)} == {1, 3}
    a, b = steps(one), steps(two)
    assert summary(one)["eval_reward"] == pytest.approx(summary(two)["eval_reward"], rel=1e-6)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm") + METRICS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key, a[step], b[step])


def test_four_ranks_each_sampling_a_quarter_sample_and_train_what_one_process_does(runs):
    """Each rank samples the prompts of its own micro-batches (1 of the 4 a step here, against 4 on one process and 2
    on each of 2 ranks): the completions are token-identical however the round is split, and the steps the same."""
    one, four = runs["x1"][0], runs["x4"][0]
    assert read_completions(four) == read_completions(one) == read_completions(runs["x2"][0])
    a, b = steps(one), steps(four)
    assert summary(one)["eval_reward"] == pytest.approx(summary(four)["eval_reward"], rel=1e-6)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm") + METRICS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key, a[step], b[step])


def test_two_ranks_killed_inside_a_round_resume_with_the_same_completions_and_steps(runs, tmp_path):
    """Rank 1 is killed (kill -9) at the end of step 2, before its checkpoint: the resume continues from step 1's,
    inside the first round (2 steps a round): step 2 trains on the restored completions, step 3 samples what one
    process sampled."""
    config = grpo_config(tmp_path, 2, plugins=("hfsdp_faults",), train={"save_every": 1})
    env = base_env(PYTHONPATH=os.pathsep.join([str(REWARDS), str(FAULTS)]), HFSDP_TEST_FAULTS="sigkill@2:1")
    killed = run_torchrun(2, "train", str(config), env=env, check=False)
    assert killed.returncode != 0 and "exitcode  : -9" in killed.stderr, killed.stderr[-3000:]
    run = tmp_path / "run"
    assert [c["step"] for c in read_completions(run)] == [1] * 8  # the first round only
    resumed = run_torchrun(2, "train", str(config), "--resume", env=base_env(
        PYTHONPATH=os.pathsep.join([str(REWARDS), str(FAULTS)])))
    assert "resumed from" in resumed.stdout and "step-1 at step 1" in resumed.stdout, resumed.stdout[-3000:]
    one = runs["x1"][0]
    assert read_completions(run) == read_completions(one)
    a, b = steps(one), steps(run)
    for step in (2, 3):
        for key in ("loss", "grad_norm") + METRICS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key, a[step], b[step])
    # and what the uninterrupted 2-rank run trained and exported, bit for bit
    two = runs["x2"][0]
    assert {k: (v["loss"], v["grad_norm"]) for k, v in steps(run).items()} == {
        k: (v["loss"], v["grad_norm"]) for k, v in steps(two).items()}
    got, want = final_weights(run), final_weights(two)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_two_ranks_train_the_same_steps_whether_sampling_gathers_the_model_once_or_a_layer_per_token(runs):
    """``fsdp.gather_for_generation`` changes which all-gathers run while sampling (tests/test_generation.py counts
    them), not what is computed: the same completions and the same steps, bit for bit."""
    once, per_layer = runs["x2"][0], runs["x2_layers"][0]
    assert read_completions(once) == read_completions(per_layer)
    a, b = steps(once), steps(per_layer)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm") + METRICS:
            assert a[step][key] == b[step][key], (step, key, a[step], b[step])
    assert summary(once)["eval_reward"] == summary(per_layer)["eval_reward"]


def test_the_metrics_completions_and_progress_bar_show_the_run(runs):
    run, console = runs["x1"]
    metrics = steps(run)
    for m in metrics.values():
        assert all(math.isfinite(m[key]) for key in METRICS), m
        assert 0 <= m["reward"] <= 1.5 and 1 <= m["completion_length"] <= 6 and m["entropy"] > 0
        assert m["reward_std"] > 0 and m["grad_norm"] > 0  # the rewards differ within groups: a gradient
    assert metrics[1]["kl"] == 0  # the LoRA adapters start as the identity: the policy is the reference
    assert metrics[2]["kl"] > 0
    assert metrics[1]["clip_ratio"] == 0  # the first step of a round is on its own samples (ratio 1)
    assert metrics[1]["generation_s"] > 0 and metrics[3]["generation_s"] > 0  # each round's first step samples,
    assert metrics[2]["generation_s"] == 0  # its second reuses the completions
    first = read_completions(run)[0]
    assert set(first) == {"step", "row", "prompt", "completion", "completion_ids", "advantage", "rewards"}
    assert first["prompt"][0]["role"] == "user" and set(first["rewards"]) == {"letters", "json_fields"}
    assert "reward=" in console
    evals = [m for m in read_metrics(run) if "eval_reward" in m]  # 2 sampled completions of each of 4 eval prompts
    assert [m["step"] for m in evals] == [0, STEPS] and {"eval_rewards/letters/mean"} <= evals[0].keys()
    reward = summary(run)["eval_reward"]
    assert reward == {"before": evals[0]["eval_reward"], "after": evals[1]["eval_reward"]}
    assert f"eval reward {reward['before']:.4f} -> {reward['after']:.4f}" in console


def test_a_reward_that_raises_on_one_rank_stops_both(tmp_path):
    config = grpo_config(tmp_path, 2, rewards=[{"name": "grpo_test_rewards:fails_on_rank_1"}])
    proc = run_torchrun(2, "train", str(config), env=base_env(PYTHONPATH=str(REWARDS)), check=False, timeout=300)
    assert proc.returncode != 0
    errors = rank_errors(proc)  # each rank stops with the same message (no rank waits), said once
    assert len(errors) == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert all("grpo reward 'grpo_test_rewards:fails_on_rank_1' (from grpo_test_rewards: fails_on_rank_1) raised "
               "ValueError: a reward server is down (scoring the completions of eval rows" in e  # the eval before training
               for e in errors), errors
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_reward_that_hangs_on_one_rank_stops_both_naming_it_and_the_checkpoint_stays(tmp_path):
    """grpo_test_rewards:hangs_on_rank_1 sleeps (catching what interrupts it) at the second round on rank 1, after
    the step-2 checkpoint: it is stopped after reward_timeout_s, rank 0 (waiting in the gather) stops with the same
    message, and step-2 is complete for --resume."""
    config = grpo_config(tmp_path, 2, rewards=[{"name": "grpo_test_rewards:hangs_on_rank_1"}],
                         data={"eval_path": None}, grpo={"reward_timeout_s": 5}, train={"save_every": 2})
    started = time.monotonic()
    proc = run_torchrun(2, "train", str(config), env=base_env(PYTHONPATH=str(REWARDS)), check=False, timeout=300)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # each rank: a user error
    assert time.monotonic() - started < 100  # not the collective timeout (120 s), nor the hour
    errors = rank_errors(proc)  # the same message on each rank, said once
    assert len(errors) == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert all("grpo reward 'grpo_test_rewards:hangs_on_rank_1' (from grpo_test_rewards: hangs_on_rank_1) did not "
               "return within 5 s (grpo.reward_timeout_s), scoring the completions of training rows" in e
               and "on rank 1: it was stopped there" in e for e in errors), errors
    checkpoints = tmp_path / "run" / "checkpoints"
    assert store.latest(checkpoints) == checkpoints / "step-2" and not list(checkpoints.glob(".tmp-*"))
    assert sorted(steps(tmp_path / "run")) == [1, 2]


def test_a_reward_that_reads_the_rank_is_found_unless_the_check_is_off(tmp_path):
    """Rank 1's copy of the round's first completion scores another value than rank 0 gave it: both ranks stop
    before the first step, naming the function; with check_reward_determinism off the run trains."""
    env = base_env(PYTHONPATH=str(REWARDS))
    config = grpo_config(tmp_path, 2, rewards=[{"name": "grpo_test_rewards:rank_dependent"}], data={"eval_path": None})
    proc = run_torchrun(2, "train", str(config), env=env, check=False, timeout=300)
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    errors = rank_errors(proc)  # the same message on each rank, said once
    assert len(errors) == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert all("grpo reward 'grpo_test_rewards:rank_dependent' (from grpo_test_rewards: rank_dependent) is not a "
               "function of its inputs: the first completion of training row" in e
               and "scored again alone on rank 1" in e for e in errors), errors
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not steps(tmp_path / "run")
    config = grpo_config(tmp_path / "off", 2, rewards=[{"name": "grpo_test_rewards:rank_dependent"}],
                         data={"eval_path": None}, grpo={"check_reward_determinism": False})
    run_torchrun(2, "train", str(config), env=env, timeout=300)
    assert sorted(steps(tmp_path / "off" / "run")) == [1, 2, 3]


def test_a_reward_that_returns_nan_stops_the_run_naming_it_and_the_row(tmp_path):
    config = grpo_config(tmp_path, 1, rewards=[{"name": "grpo_test_rewards:nan_for_the_last"}],
                         data={"eval_path": None})
    proc = run_cli("train", str(config), env=base_env(PYTHONPATH=str(REWARDS)), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("hfsdp: error: grpo reward 'grpo_test_rewards:nan_for_the_last' (from grpo_test_rewards: "
            "nan_for_the_last) returned nan for completion 1 of training row") in proc.stderr, proc.stderr[-3000:]
    assert "a reward is a finite number; return None where a function gives no reward" in proc.stderr


# ---- micro-steps without signal: skipped on every rank alike (grpo_test_rewards:letters_where_signal)


@pytest.fixture(scope="module")
def signal_runs(tmp_path_factory) -> dict[str, Path]:
    """name -> run folder. Two prompts, the global batch both of them (a prompt a micro-batch: 2 micro-steps on one
    process, one on each of 2 ranks), with a reward that is flat (advantages 0) for a prompt without ``signal``:
    ``mixed`` one prompt with signal and one without; ``flat`` neither (beta 0: skipped), ``flat_kl`` neither with
    the KL term (beta > 0: never skipped; the adapters start as the identity, so its gradients are 0 too)."""
    root = tmp_path_factory.mktemp("grpo_signal")
    source = [json.loads(line) for line in (PRESET_DATA / "contacts_prompts_train.jsonl").read_text().splitlines()]
    out = {}
    for name, world, signal, beta in (("mixed_x1", 1, (True, False), 0.0), ("mixed_x2", 2, (True, False), 0.0),
                                      ("flat_x2", 2, (False, False), 0.0), ("flat_kl_x2", 2, (False, False), 0.04)):
        folder = root / name
        folder.mkdir()
        rows = folder / "prompts.jsonl"
        rows.write_text("".join(json.dumps({**row, "signal": has}) + "\n" for row, has in zip(source, signal)))
        config = grpo_config(folder, world, rewards=[{"name": "grpo_test_rewards:letters_where_signal"}],
                             data={"path": str(rows), "eval_path": None}, grpo={"beta": beta},
                             train={"per_device_batch_size": 2, "gradient_accumulation_steps": 2 // world})
        env = base_env(PYTHONPATH=str(REWARDS))
        (run_cli("train", str(config), env=env) if world == 1 else run_torchrun(2, "train", str(config), env=env))
        out[name] = folder / "run"
    return out


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return {f"{file.name}:{key}": tensor for file in sorted((run / "final").glob("*.safetensors"))
            for key, tensor in load_file(file).items()}


def test_a_micro_step_with_signal_on_one_rank_only_is_trained_on_every_rank(signal_runs):
    """On 2 ranks the one micro-step has signal on rank 0 and none on rank 1: nothing is skipped. One process has
    the prompt without signal as a micro-step of its own and skips it, and trains the same steps."""
    two, one = steps(signal_runs["mixed_x2"]), steps(signal_runs["mixed_x1"])
    for step in range(1, STEPS + 1):
        assert two[step]["skipped_zero_advantage"] == 0 and one[step]["skipped_zero_advantage"] == 1
        assert two[step]["grad_norm"] > 0 and two[step]["entropy"] > 0
        for key in ("loss", "grad_norm", "reward"):
            assert one[step][key] == pytest.approx(two[step][key], rel=1e-5, abs=1e-7), (step, key)
    flat = [c for c in read_completions(signal_runs["mixed_x2"]) if c["advantage"] == 0]
    assert len(flat) == 4  # the prompt without signal: both its completions, in each of the 2 rounds


def test_a_micro_step_without_signal_on_any_rank_is_skipped_on_all_and_leaves_the_weights_computed_zeros_leave(
        signal_runs):
    """No rank runs a forward (no entropy is measured), every step still ends on both ranks (loss and gradient
    norm 0), and the optimizer steps as it does on the computed zero gradients of the same run with the KL term
    (which never skips): the same final weights, bit for bit."""
    skipped, computed = steps(signal_runs["flat_x2"]), steps(signal_runs["flat_kl_x2"])
    for step in range(1, STEPS + 1):
        assert skipped[step]["skipped_zero_advantage"] == 1 and "entropy" not in skipped[step], skipped[step]
        assert skipped[step]["loss"] == 0 and skipped[step]["grad_norm"] == 0
        assert computed[step]["skipped_zero_advantage"] == 0 and computed[step]["entropy"] > 0
        assert computed[step]["grad_norm"] == 0 and computed[step]["kl"] == 0
    assert summary(signal_runs["flat_x2"])["steps"] == STEPS
    a, b = final_weights(signal_runs["flat_x2"]), final_weights(signal_runs["flat_kl_x2"])
    assert a and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_rank_without_eval_prompts_samples_in_lock_step_and_the_eval_is_one_process_s(tmp_path):
    """One eval prompt on 2 ranks: rank 1 has none to sample, and still steps with rank 0 (a row it drops)."""
    reward = {}
    for world in (1, 2):
        config = grpo_config(tmp_path / f"x{world}", world, data={"max_eval_samples": 1}, train={"max_steps": 1})
        env = base_env(PYTHONPATH=str(REWARDS))
        (run_cli("train", str(config), env=env) if world == 1 else run_torchrun(2, "train", str(config), env=env))
        reward[world] = summary(tmp_path / f"x{world}" / "run")["eval_reward"]
    assert reward[2] == reward[1] and set(reward[1]) == {"before", "after"}
