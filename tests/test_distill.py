"""Plugin ``distill``: the loss against TRL 1.16's ``generalized_jsd_loss``, 1 process = 2 ranks (FSDP2), and a
teacher that cannot teach this student refused before any weight loads. Its smoke and resume cells are in
tests/test_combinations.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import read_metrics, run_cli, run_torchrun, tiny_config


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_divergence_is_trls_generalized_jsd_loss(loss, temperature):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    from hfsdp.builtin.distill.loss import BETA_OF, divergence_sum

    generator = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, 50, generator=generator, dtype=torch.float64).float() * 3
    teacher = torch.randn(3, 7, 50, generator=generator, dtype=torch.float64).float() * 3
    labels = torch.randint(0, 50, (3, 7), generator=generator)
    labels[0, :3] = -100
    labels[2, 5:] = -100
    beta = BETA_OF.get(loss, 0.3)
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    ours = divergence_sum(student, teacher, labels, beta, temperature) / (labels != -100).sum()
    assert float(ours) == pytest.approx(float(trl), abs=1e-6)
    assert float(ours) > 1e-3  # the two distributions differ: a divergence that is not trivially 0
    if loss == "forward_kl":  # TRL's beta 0 is KL(teacher || student)
        p = torch.softmax(teacher / temperature, -1)
        kl = (p * (p.log() - torch.log_softmax(student / temperature, -1))).sum(-1)[labels != -100].mean()
        assert float(ours) == pytest.approx(float(kl), abs=1e-6)


def distill_config(tmp_path, teacher, name="run", **distill):
    return tiny_config(tmp_path, plugins=["distill"], distill={"teacher": str(teacher), "loss": "jsd", "beta": 0.5,
                                                               "alpha": 0.5, "temperature": 2.0, **distill},
                       train={"output_dir": str(tmp_path / name), "max_steps": 3, "per_device_batch_size": 4,
                              "eval_every": 3})


def test_two_ranks_compute_what_one_process_computes(tmp_path, tiny_teacher_dir):
    one = tmp_path / "one"
    one.mkdir()
    run_cli("train", str(distill_config(one, tiny_teacher_dir)))
    two = tmp_path / "two"
    two.mkdir()
    config = tiny_config(two, plugins=["distill"],
                         distill={"teacher": str(tiny_teacher_dir), "loss": "jsd", "beta": 0.5, "alpha": 0.5,
                                  "temperature": 2.0},
                         train={"output_dir": str(two / "run"), "max_steps": 3, "per_device_batch_size": 2,
                                "eval_every": 3})
    proc = run_torchrun(2, "train", str(config))
    said = proc.stdout + proc.stderr
    assert "loaded frozen, sharded over 2 ranks (FSDP2)" in said, said[-3000:]
    mine, total = (int(n.replace(",", "")) for n in said.split("FSDP2): ")[1].split(" parameters")[0].split(" of its "))
    assert mine < 0.6 * total  # each rank holds about half of the teacher
    a, b = read_metrics(one / "run"), read_metrics(two / "run")
    compared = 0
    for x, y in zip(a, b):
        for key in ("loss", "distill/ce", "distill/divergence", "eval_loss", "eval_distill/ce",
                    "eval_distill/divergence"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (key, x, y)
                compared += 1
    assert compared >= 12
    steps = [m for m in a if "loss" in m]
    assert all(m["distill/divergence"] > 1e-3 for m in steps)  # the teacher differs from the student
    # alpha mixes the two per-token terms: the logged loss is their mix
    assert steps[0]["loss"] == pytest.approx(0.5 * steps[0]["distill/ce"] + 0.5 * steps[0]["distill/divergence"],
                                             rel=1e-5)


def other_vocabulary(teacher, folder):
    """The teacher with 64 more vocabulary entries in its config."""
    config = json.loads((teacher / "config.json").read_text())
    config["vocab_size"] += 64
    (folder / "config.json").write_text(json.dumps(config))


def other_tokens(teacher, folder):
    """The teacher's tokenizer with the ids of two tokens swapped: the same tokens, other ids."""
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["the"], vocab["and"] = vocab["and"], vocab["the"]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


@pytest.mark.parametrize("change, reason", [
    (other_vocabulary, "distill.teacher: its vocabulary has 49216 entries, the student's 49152"),
    (other_tokens, "distill.teacher: its tokenizer differs from the student's"),
])
def test_a_teacher_without_the_students_tokenizer_is_refused_before_any_weight_loads(tmp_path, tiny_teacher_dir,
                                                                                   change, reason):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher_dir, teacher)
    change(tiny_teacher_dir, teacher)
    proc = run_cli("train", str(distill_config(tmp_path, teacher)), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert reason in proc.stderr, proc.stderr[-3000:]
    assert "Loading weights" not in proc.stderr


@pytest.mark.parametrize("sections, reason", [
    ({"plugins": ["distill", "lora"]}, "distill is not combined with lora yet"),
    ({"distill": {"loss": "forward_kl", "beta": 0.3}}, "distill.beta: applies to loss jsd only, not forward_kl"),
    ({"data": {"format": "preference"}}, "distill trains on labelled tokens: use one of text, instruction, chat"),
])
def test_what_distill_cannot_combine_is_refused_by_validate(tmp_path, tiny_teacher_dir, sections, reason):
    base = {"teacher": str(tiny_teacher_dir), "loss": "jsd"}
    config = tiny_config(tmp_path, plugins=sections.get("plugins", ["distill"]),
                         distill={**base, **sections.get("distill", {})}, **{k: v for k, v in sections.items()
                                                                           if k not in ("plugins", "distill")})
    proc = run_cli("validate", str(config), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert reason in proc.stderr, proc.stderr[-3000:]
