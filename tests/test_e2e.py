"""End to end through the real CLI on the tiny model: the loss goes down, the run folder holds what it should, and
``final/`` and ``hfsdp export`` of checkpoints are the trained model (the same tensors, the same logits)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import read_metrics, run_cli, tiny_config

pytestmark = pytest.mark.slow

# A constant learning rate makes the first two steps of a 4-step run the same as a whole 2-step run (a decaying
# schedule depends on max_steps); the data order is a pure function of seed and step.
COMMON = {"lr_scheduler": "constant", "deterministic": True, "save_every": 2, "seed": 11}


def _train(tmp_path: Path, max_steps: int) -> Path:
    config = tiny_config(tmp_path, train={"max_steps": max_steps, **COMMON})
    proc = run_cli("train", str(config))
    (tmp_path / "console.txt").write_text(proc.stdout)
    return tmp_path / "run"


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("four"), 4)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("two"), 2)


def _export(checkpoint: Path, out: Path) -> Path:
    proc = run_cli("export", str(checkpoint), str(out), timeout=300)
    assert f"-> {out}" in proc.stdout
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = tokenizer("Extract the person as JSON. Meet Ada, 36, a pilot from Oslo.", return_tensors="pt")
    with torch.no_grad():
        return model(**ids).logits


def test_loss_goes_down_and_run_folder_is_complete(four):
    metrics = read_metrics(four)
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]  # log_every 1
    assert all(set(m) >= {"loss", "lr", "grad_norm", "tokens", "tokens_per_s"} for m in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3, [m["loss"] for m in steps]
    summary = json.loads((four / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["skipped_steps"] == 0
    assert summary["after"]["eval_loss"] < summary["before"]["eval_loss"] - 0.3, summary
    evals = [m["step"] for m in metrics if "eval_loss" in m]
    assert evals == [0, 4]
    written = yaml.safe_load((four / "config.yaml").read_text())
    assert written["train"]["max_steps"] == 4 and written["fsdp"]["version"] == 2
    assert sorted(p.name for p in (four / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert summary["last_checkpoint"] == str(four / "checkpoints" / "step-4")
    assert f"latest checkpoint: {four / 'checkpoints' / 'step-4'} (`hfsdp export` consolidates it)" in \
        (four.parent / "console.txt").read_text()


def test_final_is_the_last_checkpoint(four, tmp_path):
    exported = _export(four / "checkpoints" / "step-4", tmp_path / "export-4")
    final, ckpt = _weights(four / "final"), _weights(exported)
    assert final.keys() == ckpt.keys() and len(final) > 10
    assert all(torch.equal(final[k], ckpt[k]) for k in final)
    torch.testing.assert_close(_logits(four / "final"), _logits(exported), rtol=0, atol=1e-5)
    # and the model really trained: the weights moved away from the initial ones
    from hfsdp.model.loading import resolve_model_path
    from conftest import CACHE_DIR

    initial = load_file(str(Path(resolve_model_path("smollm2-tiny", CACHE_DIR)) / "model.safetensors"))
    assert any(not torch.equal(final[k], initial[k]) for k in final)


def test_mid_run_checkpoint_exports_the_model_at_that_step(four, two, tmp_path):
    exported = _export(four / "checkpoints" / "step-2", tmp_path / "export-2")
    at_two, ckpt = _weights(two / "final"), _weights(exported)
    assert at_two.keys() == ckpt.keys()
    assert all(torch.equal(at_two[k], ckpt[k]) for k in at_two)
    torch.testing.assert_close(_logits(two / "final"), _logits(exported), rtol=0, atol=1e-5)
    assert not all(torch.equal(at_two[k], v) for k, v in _weights(four / "final").items())
