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
from pathlib import Path

import pytest

from conftest import PRESET_DATA, REPO, base_env, read_metrics, run_cli, run_torchrun, tiny_config

pytestmark = pytest.mark.slow

STEPS = 3
REWARDS = REPO / "tests" / "reward_plugin"
METRICS = ("reward", "reward_std", "rewards/letters/mean", "rewards/json_fields/mean",
           "completion_length", "clip_ratio", "kl", "entropy")


def grpo_config(folder: Path, world: int, rewards: list[dict] | None = None, **fsdp) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return tiny_config(
        folder, plugins=["grpo", "lora", "grpo_test_rewards"],  # a plugin offering the reward "letters"
        data={"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl"),
              "eval_path": str(PRESET_DATA / "contacts_prompts_eval.jsonl"), "max_eval_samples": 4},
        grpo={"num_generations": 2, "max_new_tokens": 6, "beta": 0.04, "num_iterations": 2, "log_completions": 16,
              "rewards": rewards or [{"name": "letters"}, {"name": "json_fields", "weight": 0.5}]},
        train={"max_steps": STEPS, "per_device_batch_size": 4, "gradient_accumulation_steps": 2 // world,
               "lr_scheduler": "constant", "collective_timeout_s": 120}, fsdp=fsdp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (run folder, console); the global batch is 8 completions (4 prompts) a step in all. ``x2`` samples
    with the model gathered once per generate call (the default), ``x2_layers`` a layer at each decode step."""
    root = tmp_path_factory.mktemp("grpo")
    env = base_env(PYTHONPATH=str(REWARDS))
    out = {}
    for name, world, fsdp in (("x1", 1, {}), ("x2", 2, {}), ("x2_layers", 2, {"gather_for_generation": False})):
        config = grpo_config(root / name, world, **fsdp)
        proc = run_cli("train", str(config), env=env) if world == 1 else run_torchrun(2, "train", str(config), env=env)
        out[name] = (root / name / "run", proc.stdout + proc.stderr)
    return out


def steps(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run) if "loss" in m}


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def completions(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]


def test_two_ranks_sample_score_and_train_what_one_process_does(runs):
    one, two = runs["x1"][0], runs["x2"][0]
    assert completions(one) == completions(two)  # the same tokens, rewards and advantages, every completion
    assert len(completions(one)) == 16 and {c["step"] for c in completions(one)} == {1, 3}  # a round is 2 steps
    a, b = steps(one), steps(two)
    assert summary(one)["eval_reward"] == pytest.approx(summary(two)["eval_reward"], rel=1e-6)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm") + METRICS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key, a[step], b[step])


def test_two_ranks_train_the_same_steps_whether_sampling_gathers_the_model_once_or_a_layer_per_token(runs):
    """``fsdp.gather_for_generation`` changes which all-gathers run while sampling (tests/test_generation.py counts
    them), not what is computed: the same completions and the same steps, bit for bit."""
    once, per_layer = runs["x2"][0], runs["x2_layers"][0]
    assert completions(once) == completions(per_layer)
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
    first = completions(run)[0]
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
    errors = [line for line in proc.stderr.splitlines() if "hfsdp: error:" in line]
    assert len(errors) == 2, proc.stderr[-3000:]  # each rank stops with the same message (no rank waits)
    assert all("grpo reward 'grpo_test_rewards:fails_on_rank_1' (from grpo_test_rewards: fails_on_rank_1) raised "
               "ValueError: a reward server is down (scoring the completions of training rows" in e
               for e in errors), errors
    assert not (tmp_path / "run" / "checkpoints").exists()
