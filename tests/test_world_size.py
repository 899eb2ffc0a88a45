"""Resume on another world size (FSDP2): a checkpoint keeps its global batch, and the resumed steps are the steps
the uninterrupted run took.

One chain of real jobs on the shrunk SmolLM2, global batch 4, constant LR, a SHARDED checkpoint after every step:
an uninterrupted 4-rank run (steps 1-4), then step 2 resumed on 2 ranks from its step-1 checkpoint (4 -> 2:
accumulation 1 -> 2), step 3 on 1 rank from that run's step-2 checkpoint (2 -> 1: accumulation 4), step 4 on 2
ranks from that one's step-3 checkpoint (1 -> 2). Each resumed loss equals the uninterrupted one within 1e-5
relative. FULL_STATE_DICT: a 2-rank checkpoint resumes on 1 rank. LoRA: a SHARDED checkpoint of 2 ranks, loaded
again on 2 ranks, exports exactly the adapter the run had in memory when it saved.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli, run_torchrun, step_losses, tiny_config

pytestmark = pytest.mark.slow

LOSS_REL = 1e-5
TRAIN = {"per_device_batch_size": 1, "lr_scheduler": "constant", "save_every": 1, "keep_last": None,
         "eval_at_start": False, "max_eval_batches": 1, "export_final": False}


def train(nproc: int, folder: Path, *args: str, **sections) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(folder, **sections)
    proc = run_cli("train", str(config), *args) if nproc == 1 else run_torchrun(nproc, "train", str(config), *args)
    return proc.stdout + proc.stderr


def resume_from(checkpoint: Path, nproc: int, folder: Path, max_steps: int, **sections) -> str:
    """A new run folder holding only ``checkpoint``, resumed on ``nproc`` ranks up to ``max_steps``."""
    shutil.copytree(checkpoint, folder / "run" / "checkpoints" / checkpoint.name)
    return train(nproc, folder, "--resume", "--set", f"train.max_steps={max_steps}", **sections)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("world_size")
    fsdp = {"version": 2, "sharding_strategy": "FULL_SHARD", "state_dict_type": "SHARDED_STATE_DICT"}
    out = {}
    train(4, root / "x4", train={**TRAIN, "max_steps": 4}, fsdp=fsdp)
    out["reference"] = step_losses(root / "x4" / "run")
    # per-device batch 1 everywhere: the accumulation is what hfsdp adapts
    out["4->2"] = resume_from(root / "x4" / "run" / "checkpoints" / "step-1", 2, root / "x2", 2,
                              train={**TRAIN, "max_steps": 2}, fsdp=fsdp)
    out["2->1"] = resume_from(root / "x2" / "run" / "checkpoints" / "step-2", 1, root / "x1", 3,
                              train={**TRAIN, "max_steps": 3}, fsdp=fsdp)
    out["1->2"] = resume_from(root / "x1" / "run" / "checkpoints" / "step-3", 2, root / "x2b", 4,
                              train={**TRAIN, "max_steps": 4}, fsdp=fsdp)
    out["losses"] = {"4->2": step_losses(root / "x2" / "run"), "2->1": step_losses(root / "x1" / "run"),
                     "1->2": step_losses(root / "x2b" / "run")}
    return out


def test_sharded_checkpoints_resume_on_other_world_sizes(chain):
    reference = chain["reference"]
    assert sorted(reference) == [1, 2, 3, 4]
    expected_notes = {"4->2": "resuming a run of 4 rank(s) on 2: train.gradient_accumulation_steps 1 -> 2",
                      "2->1": "resuming a run of 2 rank(s) on 1: train.gradient_accumulation_steps 1 -> 4",
                      "1->2": "resuming a run of 1 rank(s) on 2: train.gradient_accumulation_steps 1 -> 2"}
    rows = []
    for (name, note), step in zip(expected_notes.items(), (2, 3, 4)):
        assert note in chain[name], chain[name][-3000:]
        losses = chain["losses"][name]
        assert step in losses and max(losses) == step, (name, losses)  # the step the resumed run trained
        rows.append(f"| {name} | {step} | {reference[step]:.10f} | {losses[step]:.10f} | "
                    f"{abs(losses[step] - reference[step]) / reference[step]:.1e} |")
    print("\n| resume | step | uninterrupted (4 ranks) | resumed | rel. diff |\n|---|---|---|---|---|\n"
          + "\n".join(rows))
    for name, step in zip(expected_notes, (2, 3, 4)):
        assert chain["losses"][name][step] == pytest.approx(reference[step], rel=LOSS_REL), name


def test_full_state_dict_checkpoint_resumes_on_one_rank(chain, tmp_path):
    """2 ranks x per-device 2 = global batch 4, FULL_STATE_DICT; step 2 resumed on 1 rank (accumulation 2)."""
    fsdp = {"version": 2, "sharding_strategy": "FULL_SHARD", "state_dict_type": "FULL_STATE_DICT"}
    sections = {"train": {**TRAIN, "per_device_batch_size": 2, "max_steps": 1}, "fsdp": fsdp}
    train(2, tmp_path / "full", **sections)
    checkpoint = tmp_path / "full" / "run" / "checkpoints" / "step-1"
    assert (checkpoint / "pytorch_model_fsdp.bin").is_file()
    out = resume_from(checkpoint, 1, tmp_path / "one", 2, **sections)
    assert "train.gradient_accumulation_steps 1 -> 2 keeps its global batch of 4" in out
    losses = step_losses(tmp_path / "one" / "run")
    print(f"\nFULL_STATE_DICT 2 -> 1: step 2 loss {losses[2]:.10f}, uninterrupted {chain['reference'][2]:.10f}")
    assert losses[2] == pytest.approx(chain["reference"][2], rel=LOSS_REL)


def test_lora_sharded_checkpoint_restores_every_adapter_value(tmp_path):
    """The adapter exported after loading a 2-rank SHARDED checkpoint equals the one exported at save time."""
    sections = {"plugins": ["lora"], "lora": {"r": 4, "alpha": 8},
                "train": {**TRAIN, "per_device_batch_size": 2, "max_steps": 2, "save_every": 2, "export_final": True,
                          "learning_rate": 1e-2},
                "fsdp": {"version": 2, "sharding_strategy": "FULL_SHARD", "state_dict_type": "SHARDED_STATE_DICT"}}
    train(2, tmp_path / "saved", **sections)
    out = resume_from(tmp_path / "saved" / "run" / "checkpoints" / "step-2", 2, tmp_path / "loaded", 2, **sections)
    assert "at step 2" in out
    saved = load_file(str(tmp_path / "saved" / "run" / "final" / "adapter_model.safetensors"))
    loaded = load_file(str(tmp_path / "loaded" / "run" / "final" / "adapter_model.safetensors"))
    assert saved.keys() == loaded.keys() and len(saved) == 2 * 7 * 2
    trained_b = [k for k in saved if "lora_B" in k]
    assert all(saved[k].abs().sum() > 0 for k in trained_b)  # lora_B starts at zero: these were trained
    different = [k for k in saved if not torch.equal(saved[k], loaded[k])]
    assert not different, different
    print(f"\nLoRA 2-rank SHARDED checkpoint: {len(saved)} adapter tensors torch.equal after load")
