"""On-policy distillation (plugin ``distill_online``, format ``prompt``, issue 52): the loss and gradient norm of TRL's
own ``DistillationTrainer`` on the same completions (benchmarks/trl_distill_online.py's comparison, on the shrunk
SmolLM2 taught by another seed of it) for the forward KL, the JSD and the reverse KL; 2 and 4 gloo ranks (the teacher
sharded over them) sample and train what one process does; what cannot run is refused naming its key. Smoke, resume
and pairs: tests/test_combinations.py (option ``distill_online``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import (PRESET_DATA, REPO, base_env, read_completions, read_metrics, run_cli, run_torchrun,
                      tiny_config)

STEPS = 4
METRICS = ("distill/divergence", "entropy", "completion_length", "reward", "rewards/json_fields/mean")


def online_config(folder: Path, world: int, teacher: Path, plugins: tuple[str, ...] = ()) -> Path:
    """8 completions (8 prompts of 1) a step on 1, 2 or 4 ranks, JSD of beta 0.5, json_fields measured."""
    folder.mkdir(parents=True, exist_ok=True)
    return tiny_config(
        folder, plugins=["distill_online", *plugins],
        data={"format": "prompt", "path": str(PRESET_DATA / "contacts_prompts_train.jsonl"),
              "eval_path": str(PRESET_DATA / "contacts_prompts_eval.jsonl"), "max_eval_samples": 4},
        distill_online={"teacher": str(teacher), "beta": 0.5, "max_new_tokens": 6, "log_completions": 16,
                        "rewards": [{"name": "json_fields"}]},
        train={"max_steps": STEPS, "per_device_batch_size": 8 // max(world, 2),
               "gradient_accumulation_steps": max(2 // world, 1), "lr_scheduler": "constant",
               "collective_timeout_s": 120})


def test_what_cannot_run_is_refused_naming_its_key(tmp_path, tiny_teacher_dir):
    config = online_config(tmp_path / "lora", 1, tmp_path / "no-teacher", plugins=("lora",))
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2 and "distill_online is not combined with lora yet" in proc.stderr, proc.stderr
    config = online_config(tmp_path / "missing", 1, tmp_path / "no-teacher")
    proc = run_cli("train", str(config), check=False)
    assert proc.returncode == 2 and "distill_online.teacher:" in proc.stderr and "does not exist" in proc.stderr
    assert "Loading weights" not in proc.stderr, proc.stderr[-2000:]
    # lmbda < 1 trains some rounds on the rows' own completions: a column they lack is named before weights load
    config = online_config(tmp_path / "column", 1, tiny_teacher_dir)
    proc = run_cli("train", str(config), "--set", "distill_online.lmbda=0.5", check=False)
    assert proc.returncode == 2 and "has no text in column 'completion'" in proc.stderr, proc.stderr[-2000:]
    assert "distill_online.completion_column" in proc.stderr and "Loading weights" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_loss_and_gradient_norm_are_trls_distillation_trainers_on_the_same_completions(
        beta, tmp_path, monkeypatch, tiny_model_dir, tiny_teacher_dir):
    """hfsdp trains, then TRL's DistillationTrainer trains the same student with the same teacher on hfsdp's
    completions, prompts in hfsdp's order: the loss within 1e-6 relative or 1e-6 absolute (a divergence is a float32
    sum over 49,152 tokens of each position: TRL computes it with its chunked kernel from the hidden states, hfsdp
    from the logits, both within 4e-7 relative of a float64 computation on the real teacher, whose divergences are
    about 4; this random teacher's JSD is about 0.02), the gradient norm within 1e-5."""
    pytest.importorskip("trl")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    for key, value in base_env().items():
        monkeypatch.setenv(key, value)
    import trl_distill_online
    from hfsdp.rules.table import load_checked

    overrides = [f"model.name_or_path={tiny_model_dir}", f"distill_online.teacher={tiny_teacher_dir}",
                 f"distill_online.beta={beta}", "distill_online.max_new_tokens=10",
                 "distill_online.log_completions=100000", f"train.max_steps={STEPS}", "train.eval_at_start=false",
                 "train.eval_every=null", "data.eval_path=null", "train.log_every=1", "train.export_final=false"]
    cfg, host = load_checked("distill-online", overrides)
    ours, rounds, _ = trl_distill_online.run_hfsdp("distill-online", overrides, tmp_path / "run", cfg.plugins)
    theirs = trl_distill_online.run_trl(cfg, host, STEPS, rounds)
    assert len(ours) == len(theirs["losses"]) == len(theirs["float64_norms"]) == STEPS
    for step, (m, loss, norm) in enumerate(zip(ours, theirs["losses"], theirs["float64_norms"]), start=1):
        assert m["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-6), (step, m["loss"], loss)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-5), (step, m["grad_norm"], norm)
        assert m["loss"] > 0 and m["grad_norm"] > 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_teacher_dir) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("distill_online")
    out = {}
    for world in (1, 2, 4):
        config = online_config(root / f"x{world}", world, tiny_teacher_dir)
        _ = run_cli("train", str(config)) if world == 1 else run_torchrun(world, "train", str(config))
        out[world] = root / f"x{world}" / "run"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_two_and_four_ranks_sample_and_train_what_one_process_does_the_teacher_sharded(runs, world):
    one, many = runs[1], runs[world]
    assert read_completions(one) == read_completions(many) and len(read_completions(one)) == 8 * STEPS  # a round a step
    a = {m["step"]: m for m in read_metrics(one) if "loss" in m}
    b = {m["step"]: m for m in read_metrics(many) if "loss" in m}
    for step in range(1, STEPS + 1):
        assert a[step]["loss"] == a[step]["distill/divergence"] > 0
        for key in ("loss", "grad_norm") + METRICS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key, a[step], b[step])
    summaries = [json.loads((run / "summary.json").read_text()) for run in (one, many)]
    evals = [[m for m in read_metrics(run) if "eval_loss" in m][-1] for run in (one, many)]
    assert evals[0]["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-5)
    assert evals[0]["eval_tokens"] == evals[1]["eval_tokens"] > 0
    assert summaries[0]["eval_reward"] == summaries[1]["eval_reward"]
