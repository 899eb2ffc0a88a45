"""RLOO (plugin ``rloo``, format ``prompt``, issue 52): TRL 1.16's leave-one-out advantages on numbers worked by
hand; the loss and gradient norm of TRL's own ``RLOOTrainer`` on the same completions (benchmarks/trl_rloo.py's
comparison, on the shrunk SmolLM2: full fine-tuning over rounds of 2 steps, and LoRA with TRL's default KL penalty
in the reward, the rewards clamped and the advantages normalised); 2 and 4 gloo ranks sample, score and train what
one process does. Smoke, resume and pairs: tests/test_combinations.py (options ``rloo``, ``lora_rloo``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import (PRESET_DATA, REPO, base_env, read_completions, read_metrics, run_cli, run_torchrun,
                      tiny_config)

REWARDS = REPO / "tests" / "reward_plugin"
STEPS = 4
METRICS = ("reward", "reward_std", "rewards/letters/mean", "completion_length", "kl", "entropy", "clip_ratio")


def test_a_completions_advantage_is_its_reward_minus_the_mean_of_its_scorable_siblings():
    from hfsdp.builtin.rloo.loss import rloo_advantages

    nan = math.nan
    # two functions weighted 1 and 0.5; groups of 3; the last completion unscorable (every function None)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, nan], [0.2, 0.2], [0.8, nan], [nan, nan]])
    weights = torch.tensor([1.0, 0.5])
    totals = [1.0, 1.0, 0.5, 0.3, 0.8]  # the weighted sums (None: left out of the sum)
    want = [totals[0] - (totals[1] + totals[2]) / 2, totals[1] - (totals[0] + totals[2]) / 2,
            totals[2] - (totals[0] + totals[1]) / 2, totals[3] - totals[4], totals[4] - totals[3], 0.0]
    got = rloo_advantages(rewards, weights, 3)
    assert got.tolist() == pytest.approx(want, abs=1e-7)
    # clamped to [0.4, 0.9] first, then the KL penalty: reward - beta * kl
    kl = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 0.0])
    clamped = [0.9, 0.9 - 0.2, 0.5, 0.4 - 0.1, 0.8]
    got = rloo_advantages(rewards, weights, 3, clip_range=(0.4, 0.9), kl=kl, beta=0.1)
    assert got[:3].tolist() == pytest.approx([clamped[0] - (clamped[1] + clamped[2]) / 2,
                                              clamped[1] - (clamped[0] + clamped[2]) / 2,
                                              clamped[2] - (clamped[0] + clamped[1]) / 2], abs=1e-6)
    # normalised over the batch's scorable completions (std with Bessel's correction, plus 1e-4)
    raw = torch.tensor(want[:5], dtype=torch.float64)
    normalised = rloo_advantages(rewards, weights, 3, normalize=True)
    assert normalised[:5].tolist() == pytest.approx(((raw - raw.mean()) / (raw.std() + 1e-4)).tolist(), abs=1e-6)
    assert normalised[5] == 0
    # a completion without a scorable sibling has no baseline: 0
    assert rloo_advantages(torch.tensor([[1.0], [nan]]), torch.tensor([1.0]), 2).tolist() == [0.0, 0.0]


def test_the_default_beta_is_trls_where_lora_gives_a_reference_and_0_without(tmp_path):
    from hfsdp.builtin.rloo.schema import RlooSection, resolved_beta

    section = RlooSection(rewards=[{"name": "json_fields"}])
    assert resolved_beta(section, ["rloo", "lora"]) == 0.05 and resolved_beta(section, ["rloo"]) == 0.0
    config = tiny_config(tmp_path, plugins=["rloo"], data={"format": "prompt", "eval_path": None, "path": str(
        PRESET_DATA / "contacts_prompts_train.jsonl")}, rloo={"rewards": [{"name": "json_fields"}], "beta": 0.1})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2 and "rloo.beta" in proc.stderr and "add lora" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", ["full_iterations_2", "lora_kl_clip_normalized"])
def test_the_loss_and_gradient_norm_are_trls_rloo_trainers_on_the_same_completions(case, tmp_path, monkeypatch,
                                                                                     tiny_model_dir):
    """hfsdp trains, then TRL's RLOOTrainer trains the same model on hfsdp's completions, prompts in hfsdp's order
    (benchmarks/trl_rloo.py). Where the ratio is 1 and there is no KL (a round's first step, beta 0): within 1e-6
    (relative; the loss where over 1e-7 absolute: its advantages sum to 0 in each group, a cancellation). Where a
    kept log-prob enters (a round's later steps: the ratio of the completion's summed log-probs, about -100, to
    those when sampled; the KL penalty: its summed log-ratio to the base), the two sides compute each log-prob in
    float32 with other roundings (TRL through transformers' fused head): a sum of -100 is resolved to 8e-6, so
    within 1e-5 there."""
    pytest.importorskip("trl")
    for path in (REPO / "benchmarks", REWARDS):
        monkeypatch.syspath_prepend(str(path))
    for key, value in base_env(PYTHONPATH=str(REWARDS)).items():
        monkeypatch.setenv(key, value)
    import trl_grpo
    from hfsdp.rules.table import load_checked

    overrides = [f"model.name_or_path={tiny_model_dir}", f"train.max_steps={STEPS}", "train.eval_at_start=false",
                 "train.eval_every=null", "data.eval_path=null", "train.log_every=1", "train.export_final=false",
                 "train.learning_rate=1e-4", "rloo.max_new_tokens=10", "rloo.log_completions=100000",
                 'rloo.rewards=[{name: "grpo_test_rewards:letters"}]']
    if case == "full_iterations_2":
        overrides += ["rloo.num_iterations=2"]
    else:  # TRL's default beta with lora: 0.05
        overrides += ["plugins=[rloo, lora]", "rloo.reward_clip_range=[0.0, 0.9]", "rloo.normalize_advantages=true"]
    cfg, host = load_checked("rloo", overrides)
    section = trl_grpo.run_section(cfg)
    assert section.beta == (0.05 if "lora" in cfg.plugins else 0.0)
    ours, rounds, initial = trl_grpo.run_hfsdp("rloo", overrides, tmp_path / "run", cfg.plugins)
    theirs = trl_grpo.run_trl(cfg, host, STEPS, rounds, initial)
    assert len(ours) == len(theirs["losses"]) == len(theirs["float64_norms"]) == STEPS
    for step, (m, loss, norm) in enumerate(zip(ours, theirs["losses"], theirs["float64_norms"]), start=1):
        tolerance = 1e-5 if section.beta or (step - 1) % section.num_iterations else 1e-6
        assert m["loss"] == pytest.approx(loss, rel=tolerance, abs=1e-7), (step, m["loss"], loss)
        assert m["grad_norm"] == pytest.approx(norm, rel=tolerance), (step, m["grad_norm"], norm)
        assert m["grad_norm"] > 0
    if section.beta:  # TRL logs its KL at a round's first step: 0 at the first (the adapters' B is 0), then not
        kl = [(m["kl"], k) for m, k in zip(ours, theirs["kl"]) if k is not None]
        assert kl[0] == (0.0, 0.0) and len(kl) == STEPS and all(k != 0 for _, k in kl[1:])  # may be < 0
        assert all(a == pytest.approx(b, rel=1e-3, abs=1e-7) for a, b in kl), kl  # per-token means of 1e-5


def rloo_config(folder: Path, world: int) -> Path:
    """8 completions (4 prompts of 2) a step on 1, 2 or 4 ranks, LoRA with the KL penalty, rounds of 2 steps."""
    folder.mkdir(parents=True, exist_ok=True)
    return tiny_config(
        folder, plugins=["rloo", "lora", "grpo_test_rewards"],
        data={"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl"),
              "eval_path": str(PRESET_DATA / "contacts_prompts_eval.jsonl"), "max_eval_samples": 4},
        rloo={"num_generations": 2, "max_new_tokens": 6, "num_iterations": 2, "log_completions": 16,
              "normalize_advantages": True, "rewards": [{"name": "letters"}]},
        train={"max_steps": STEPS, "per_device_batch_size": 8 // max(world, 2),
               "gradient_accumulation_steps": max(2 // world, 1), "lr_scheduler": "constant",
               "collective_timeout_s": 120})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("rloo")
    env = base_env(PYTHONPATH=str(REWARDS))
    out = {}
    for world in (1, 2, 4):
        config = rloo_config(root / f"x{world}", world)
        _ = run_cli("train", str(config), env=env) if world == 1 else run_torchrun(world, "train", str(config),
                                                                                  env=env)
        out[world] = root / f"x{world}" / "run"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_two_and_four_ranks_sample_score_and_train_what_one_process_does(runs, world):
    """Each rank samples its own micro-batches' prompts (2 of the 4 a step on 2 ranks, 1 on 4), the KL's log-probs
    are gathered before the advantages: the same completions and rewards, the same advantages (within float32's
    rounding of the log-probs in the KL penalty: 4 ranks compute them in micro-batches of another width) and the
    same steps."""
    one, many = runs[1], runs[world]
    assert {c["step"] for c in read_completions(one)} == {1, 3}
    for a, b in zip(read_completions(one), read_completions(many), strict=True):
        assert {**a, "advantage": None} == {**b, "advantage": None}
        assert a["advantage"] == pytest.approx(b["advantage"], rel=1e-5, abs=1e-6)
    a = {m["step"]: m for m in read_metrics(one) if "loss" in m}
    b = {m["step"]: m for m in read_metrics(many) if "loss" in m}
    assert a[3]["kl"] != 0  # the second round's KL penalty (the first's is 0: the adapters' B is 0)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm") + METRICS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key, a[step], b[step])
    eval_reward = [json.loads((run / "summary.json").read_text())["eval_reward"] for run in (one, many)]
    assert eval_reward[0] == pytest.approx(eval_reward[1], rel=1e-6)
