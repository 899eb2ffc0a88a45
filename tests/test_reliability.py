"""Checkpoints you can trust: preemption exits, bit-exact resume on 1 and 2 ranks across injected faults (SIGTERM,
SIGINT, kill -9 mid-save, ENOSPC mid-save; synchronous and asynchronous saves), NaN on one rank (stop and skip),
safe loading, tensor checks.

Faults come from the test-only plugin ``tests/fault_plugin/hfsdp_faults.py``, driven by HFSDP_TEST_FAULTS, so they
fire at exact steps. The plugin is in every run's config (the plugin list is part of the resume fingerprint) and
does nothing without the variable.

Every fault test stands alone (``pytest -k NAME`` runs it): it trains in a run folder of its own. One
uninterrupted reference run per world size (the module fixtures ``solo_reference``, ``duo_reference``) keeps a
checkpoint of every step. A test whose fault strikes after a resume starts its run folder with copies of the
reference's checkpoints (:func:`seed`: what an earlier interrupted run would have left there; ``output_dir``,
``save_every`` and ``keep_last`` may change on resume), and a test that resumes after its fault compares every step
its run folder logged, and the final weights, with the reference bit for bit (:func:`assert_same_training`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import Payload, base_env, fake_checkpoint, read_metrics, run_cli, run_torchrun, tiny_config
from hfsdp.checkpoint import store as checkpoint
from hfsdp.export.hf_folder import verify_hf_weights, write_hf_weights
from hfsdp.errors import UserError
from hfsdp.checkpoint.safe_load import CheckpointWeights
from hfsdp.setup.record import read_record

FAULT_PLUGIN_DIR = Path(__file__).resolve().parent / "fault_plugin"
MAX_STEPS = 6
REFERENCE_SAVES = {"save_every": 1, "keep_last": None}  # a checkpoint of every step, all kept: the seeds


def fault_env(faults: str = "") -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(FAULT_PLUGIN_DIR), os.environ.get("PYTHONPATH", "")]))
    return base_env(PYTHONPATH=path, HFSDP_TEST_FAULTS=faults)


def fault_config(tmp_path: Path, **train) -> Path:
    """``tmp_path/config.yaml``, training into ``tmp_path/run``, a checkpoint every 2 steps."""
    # FSDP on one process too (not the unwrapped default): the faults are injected into DCP shard files.
    return tiny_config(tmp_path, plugins=["hfsdp_faults"], fsdp={"single_process": "fsdp"},
                       train={"max_steps": MAX_STEPS, "save_every": 2, "deterministic": True, **train})


def async_config(tmp_path: Path, **train) -> Path:
    return fault_config(tmp_path, async_save=True, **train)  # async_save may change on resume: same fingerprint


def train(config: Path, faults: str, *extra: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """One run of ``hfsdp train CONFIG EXTRA`` with the faults ``faults``, on ``nproc`` processes (torchrun for 2)."""
    if nproc == 1:
        return run_cli("train", str(config), *extra, env=fault_env(faults), check=False, timeout=300)
    return run_torchrun(nproc, "train", str(config), *extra, env=fault_env(faults), check=False, timeout=400)


@dataclass(frozen=True)
class Reference:
    """An uninterrupted run: its folder (a checkpoint of every step) and its console."""

    run: Path
    proc: subprocess.CompletedProcess


def reference_run(tmp: Path, nproc: int, faults: str = "", **train_keys) -> Reference:
    proc = train(fault_config(tmp, **REFERENCE_SAVES, **train_keys), faults, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Reference(tmp / "run", proc)


def seed(run: Path, reference: Reference, steps: Iterable[int]) -> None:
    """Start the run folder ``run`` with copies of the reference's checkpoints of ``steps``: the folder an earlier
    interrupted run of the same training would have left."""
    for step in steps:
        shutil.copytree(checkpoint.step_dir(reference.run / "checkpoints", step),
                        checkpoint.step_dir(run / "checkpoints", step))


def listing(run: Path) -> list[str]:
    folder = run / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def complete_steps(run: Path) -> list[int]:
    return [step for step, _ in checkpoint.complete_checkpoints(run / "checkpoints")]


def losses_by_step(run: Path) -> dict[int, list]:
    out: dict[int, list] = {}
    for m in read_metrics(run):
        if "loss" in m:
            out.setdefault(m["step"], []).append(m["loss"])
    return out


def save_records(run: Path) -> list[dict]:
    return [m for m in read_metrics(run) if "save_stall_s" in m]


def assert_same_weights(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def assert_checkpoint_as_reference(run: Path, reference: Reference, step: int) -> None:
    """The model weights of ``run``'s checkpoint of ``step`` are the reference's at that step, tensor for tensor."""
    assert_same_weights(CheckpointWeights(checkpoint.step_dir(reference.run / "checkpoints", step)),
                        CheckpointWeights(checkpoint.step_dir(run / "checkpoints", step)))


def assert_same_training(reference: Reference, resumed: Path, first_step: int = 1) -> None:
    """Every step the interrupted run folder logged (``first_step`` to the end, each once: a run seeded with the
    checkpoint of step ``first_step - 1`` logged none before) has the uninterrupted run's loss, bit for bit, and the
    final weights are identical tensors."""
    ref, got = losses_by_step(reference.run), losses_by_step(resumed)
    assert sorted(ref) == list(range(1, MAX_STEPS + 1))
    assert got == {step: ref[step] for step in range(first_step, MAX_STEPS + 1)}, (got, ref)
    assert_same_weights(load_file(str(reference.run / "final" / "model.safetensors")),
                        load_file(str(resumed / "final" / "model.safetensors")))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def still_in(folder: Path, before: dict[str, bytes]) -> bool:
    """Every file of the snapshot ``before`` is in ``folder`` now, byte for byte."""
    return {k: v for k, v in snapshot(folder).items() if k in before} == before


def partial_shard(checkpoints: Path, step: int, folder: str, rank: int) -> tuple[int, int]:
    """Size of the shard file a killed save left in ``.tmp-step-N`` and of the same file in the previous complete
    checkpoint: the fault struck while the file was being written."""
    name = f"{folder}/__{rank}_0.distcp"
    previous = checkpoint.complete_checkpoints(checkpoints)[-1][1]
    return (checkpoints / f".tmp-step-{step}" / name).stat().st_size, (previous / name).stat().st_size


def no_traceback(proc) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def assert_finished(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def assert_disk_full_reported(proc, step: int, intact: str) -> None:
    """One process whose disk filled inside its optimizer shard: exit 1, the cause, the checkpoint kept."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    no_traceback(proc)
    assert f"checkpoint for step {step} could not be written" in proc.stderr
    assert f"checkpoint for step {step} could not be written: no space left on device: " in proc.stderr
    assert "free, and the checkpoint needs about " in proc.stderr and "[Errno 28] No space left on device" in proc.stderr
    assert "optimizer_0/__0_0.distcp" in proc.stderr  # it struck inside the optimizer's shard file
    assert f"{intact}, is intact" in proc.stderr


def assert_rank_1_disk_full_reported(proc, step: int, intact: str) -> None:
    """Rank 1's disk filled: both ranks learn of it and say what it was; neither waits for the other."""
    assert proc.returncode != 0 and proc.stderr.count("exitcode  : 1") >= 1, proc.stderr[-4000:]
    for rank in (0, 1):  # a rank's line may follow rank 0's progress bar on the shared stderr (no newline between)
        said = f"[rank {rank}] hfsdp: error: checkpoint for step {step}"
        line = next((ln[ln.index(said):] for ln in proc.stderr.splitlines() if said in ln), "")
        assert "could not be written: no space left on device: " in line, proc.stderr[-4000:]
        assert "rank 1: OSError: [Errno 28] No space left on device" in line, proc.stderr[-4000:]
        assert "optimizer_0/__1_0.distcp" in line and f"{intact}, is intact" in line, line


def assert_resumed_from(proc, step: int, removed: str | None = None) -> None:
    """The --resume ``proc`` took the checkpoint of ``step`` (after removing the leftover ``removed``)."""
    assert "resumed from" in proc.stdout and f"step-{step} at step {step}" in proc.stdout, proc.stdout[-3000:]
    if removed:
        assert f"removed {removed}" in proc.stdout, proc.stdout[-3000:]


# ---- one rank: SIGTERM, SIGINT, kill -9 inside a save, ENOSPC inside a save; each resumed bit-exact


@pytest.fixture(scope="module")
def solo_reference(tmp_path_factory) -> Reference:
    return reference_run(tmp_path_factory.mktemp("solo_reference"), nproc=1)


@pytest.mark.slow
def test_sigterm_exits_143_then_the_resume_is_bit_exact_on_one_rank(tmp_path, solo_reference):
    config, run = fault_config(tmp_path), tmp_path / "run"
    proc = train(config, "sigterm@2")
    assert proc.returncode == 143, proc.stderr[-3000:]
    no_traceback(proc)
    assert "stopped by SIGTERM after step 2" in proc.stderr and "--resume" in proc.stderr
    assert listing(run) == ["step-2"]
    record = read_record(run / "checkpoints" / "step-2")
    assert record["step"] == 2 and record["world_size"] == 1

    finish = train(config, "", "--resume")
    assert_finished(finish)
    assert_resumed_from(finish, 2)
    assert_same_training(solo_reference, run)  # steps 1-2 before the signal, 3-6 after it
    ref_summary = json.loads((solo_reference.run / "summary.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["after"]["eval_loss"] == ref_summary["after"]["eval_loss"]
    assert summary["steps"] == MAX_STEPS and summary["tokens_seen"] == ref_summary["tokens_seen"]


@pytest.mark.slow
def test_sigint_exits_130_after_a_complete_checkpoint(tmp_path, solo_reference):
    run = tmp_path / "run"
    seed(run, solo_reference, [2])
    proc = train(fault_config(tmp_path), "sigint@3", "--resume")
    assert proc.returncode == 130, proc.stderr[-3000:]
    no_traceback(proc)
    assert_resumed_from(proc, 2)
    assert "stopped by SIGINT after step 3" in proc.stderr
    assert listing(run) == ["step-2", "step-3"]
    assert_checkpoint_as_reference(run, solo_reference, 3)


@pytest.mark.slow
def test_kill_9_mid_save_keeps_the_previous_checkpoint(tmp_path, solo_reference):
    config, run = fault_config(tmp_path), tmp_path / "run"
    seed(run, solo_reference, [2, 3])
    intact = snapshot(run / "checkpoints")
    proc = train(config, "sigkill_mid_write@4", "--resume", "--set", "train.save_every=1")
    assert proc.returncode == -9
    # the killed save left its temporary folder with a half-written model shard; the complete checkpoints are untouched
    assert listing(run) == [".tmp-step-4", "step-2", "step-3"]
    partial, whole = partial_shard(run / "checkpoints", 4, "pytorch_model_fsdp_0", rank=0)
    assert 0 < partial < whole, (partial, whole)
    assert complete_steps(run) == [2, 3]
    assert still_in(run / "checkpoints", intact)

    # the next --resume removes the leftover, continues from the last complete checkpoint, and trains as the reference
    finish = train(config, "", "--resume")
    assert_finished(finish)
    assert_resumed_from(finish, 3, removed=".tmp-step-4")
    assert_same_training(solo_reference, run, first_step=4)


@pytest.mark.slow
def test_disk_full_mid_save_keeps_the_previous_checkpoint(tmp_path, solo_reference):
    config, run = fault_config(tmp_path), tmp_path / "run"
    seed(run, solo_reference, [2, 3])
    proc = train(config, "enospc_mid_write@5", "--resume", "--set", "train.save_every=1")
    assert_disk_full_reported(proc, 5, "step-4")
    assert listing(run) == ["step-2", "step-3", "step-4"]  # no .tmp-step-5 left behind

    finish = train(config, "", "--resume")
    assert_finished(finish)
    assert_resumed_from(finish, 4)  # the checkpoint the failed run wrote before the failed save
    assert_same_training(solo_reference, run, first_step=4)
    assert listing(run) == ["step-3", "step-4", "step-6"]  # keep_last 3, pruned after completion


# ---- two ranks: a NaN on rank 1 (skipped), ENOSPC and kill -9 on rank 1, SIGTERM on rank 0 only


@pytest.fixture(scope="module")
def duo_reference(tmp_path_factory) -> Reference:
    return reference_run(tmp_path_factory.mktemp("duo_reference"), nproc=2, faults="nan@2:1", on_nonfinite="skip")


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_on_all_ranks(duo_reference):
    summary = json.loads((duo_reference.run / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS and summary["skipped_steps"] == 1
    losses = losses_by_step(duo_reference.run)
    assert losses[2] == ["nan"] and all(isinstance(losses[s][0], float) for s in (1, 3, 4, 5, 6))
    console = duo_reference.proc.stdout + duo_reference.proc.stderr
    assert "non-finite loss/grad norm at step 2" in console and "step skipped" in console


@pytest.mark.slow
def test_disk_full_on_rank_1_mid_write_stops_both_ranks(tmp_path):
    t0 = time.monotonic()
    proc = train(fault_config(tmp_path, on_nonfinite="skip"), "nan@2:1,enospc_mid_write@4:1", nproc=2)
    elapsed = time.monotonic() - t0
    assert_rank_1_disk_full_reported(proc, 4, "step-2")
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    assert listing(tmp_path / "run") == ["step-2"]  # the half-written step-4 folder was removed
    assert elapsed < 240, f"took {elapsed:.0f}s"


@pytest.mark.slow
def test_kill_9_of_rank_1_mid_write_ends_the_job_then_the_resume_is_bit_exact_on_two_ranks(tmp_path, duo_reference):
    config, run = fault_config(tmp_path, on_nonfinite="skip"), tmp_path / "run"
    seed(run, duo_reference, [2])  # step 2, the NaN step the reference skipped, is not trained again
    intact = snapshot(run / "checkpoints")
    t0 = time.monotonic()
    proc = train(config, "sigkill_mid_write@4:1", "--resume", nproc=2)  # rank 1 dies mid-write
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[-4000:]
    assert listing(run) == [".tmp-step-4", "step-2"]
    partial, whole = partial_shard(run / "checkpoints", 4, "pytorch_model_fsdp_0", rank=1)
    assert 0 < partial < whole, (partial, whole)  # rank 1's model shard was cut in the middle
    assert still_in(run / "checkpoints", intact)
    assert elapsed < 240, f"took {elapsed:.0f}s: rank 0 waited too long for the dead rank"

    # the next --resume removes the half-written folder and continues from step 2, as the reference trained
    finish = train(config, "", "--resume", nproc=2)
    assert_finished(finish)
    assert_resumed_from(finish, 2, removed=".tmp-step-4")
    assert_same_training(duo_reference, run, first_step=3)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_steps"] == 1  # the skip before the interruption travelled in the checkpoint


@pytest.mark.slow
def test_sigterm_on_one_rank_checkpoints_all_ranks(tmp_path, duo_reference):
    run = tmp_path / "run"
    seed(run, duo_reference, [2])
    proc = train(fault_config(tmp_path, on_nonfinite="skip"), "sigterm@4:0", "--resume", nproc=2)
    assert proc.returncode != 0  # torchrun reports its workers' exit 143 as a failure of its own
    assert "exitcode  : 143" in proc.stderr
    assert "stopped by SIGTERM after step 4" in proc.stderr
    assert listing(run) == ["step-2", "step-4"]
    record = read_record(run / "checkpoints" / "step-4")
    assert record["world_size"] == 2 and record["step"] == 4
    assert_checkpoint_as_reference(run, duo_reference, 4)


@pytest.mark.slow
def test_nan_on_one_rank_stops_both_ranks_with_the_step(tmp_path):
    config = fault_config(tmp_path, max_steps=4, save_every=1, eval_at_start=False)
    t0 = time.monotonic()
    proc = run_torchrun(2, "train", str(config), env=fault_env("nan@2:1"), check=False, timeout=300)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] hfsdp: error: non-finite loss/grad norm at step 2" in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("exitcode  : 3") >= 1
    assert listing(tmp_path / "run") == ["step-1"]  # nothing saved at or after the bad step
    assert elapsed < 240, f"took {elapsed:.0f}s: a rank waited on the other"


# ---- train.async_save: the same faults, struck inside the background write; resume bit-exact to the references


@pytest.mark.slow
def test_async_kill_9_mid_background_write_then_the_resume_is_bit_exact_on_one_rank(tmp_path, solo_reference):
    config, run = async_config(tmp_path), tmp_path / "run"
    # step 2's checkpoint is still being written when step 3 changes the weights and the optimizer state it saves
    # (pytorch #144657: a staging "copy" that was a view saved the later values); step 4's write is killed midway
    proc = train(config, "slow_write@2,sigkill_mid_write@4")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert "checkpoints: asynchronous" in proc.stdout
    assert listing(run) == [".tmp-step-4", "step-2"]
    partial, whole = partial_shard(run / "checkpoints", 4, "pytorch_model_fsdp_0", rank=0)
    assert 0 < partial < whole, (partial, whole)
    (saved,) = save_records(run)  # step 2's: complete only after step 3 (slow_write), not before
    assert saved["checkpoint_step"] == 2 and saved["step"] >= 3, saved
    assert 0 < saved["save_stall_s"] < saved["save_write_s"], saved

    # resumed from the checkpoint written while step 3 ran, it trains as the (synchronous) reference
    finish = train(config, "", "--resume")
    assert_finished(finish)
    assert_resumed_from(finish, 2, removed=".tmp-step-4")
    assert "checkpoints saved asynchronously: 2" in finish.stdout  # steps 4 and 6
    assert_same_training(solo_reference, run)
    # the resume dropped the records of the steps it trained again (step 2's save completed at step 3)
    assert [m["checkpoint_step"] for m in save_records(run)] == [4, 6]


@pytest.mark.slow
def test_async_disk_full_mid_background_write_fails_the_run(tmp_path, solo_reference):
    run = tmp_path / "run"
    seed(run, solo_reference, [2])
    proc = train(async_config(tmp_path), "enospc_mid_write@4", "--resume")  # the disk fills in step 4's write
    assert_disk_full_reported(proc, 4, "step-2")
    assert listing(run) == ["step-2"]
    assert not (run / "final").exists()  # the run failed before its final export


@pytest.mark.slow
def test_async_sigterm_waits_for_the_save_in_flight(tmp_path, solo_reference):
    run = tmp_path / "run"
    seed(run, solo_reference, [2])
    proc = train(async_config(tmp_path), "sigterm@5", "--resume")  # preempted while step 4's checkpoint is in flight
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "stopped by SIGTERM after step 5" in proc.stderr and "step-5 is complete" in proc.stderr
    assert listing(run) == ["step-2", "step-4", "step-5"]
    saves = save_records(run)
    assert [m["checkpoint_step"] for m in saves] == [4, 5], saves
    # step 4's save started with none in flight: the loop waited only for its staging; step 5's save first waited
    # for step 4's to complete (a stall longer than its own write when step 4's was slow), then staged its own
    first, second = saves
    assert 0 < first["save_stall_s"] <= first["save_write_s"], saves
    assert 0 < second["save_stall_s"] <= first["save_write_s"] + second["save_write_s"], saves
    for step in (4, 5):
        assert_checkpoint_as_reference(run, solo_reference, step)


@pytest.mark.slow
def test_async_disk_full_on_rank_1_fails_both_ranks(tmp_path):
    proc = train(async_config(tmp_path, on_nonfinite="skip"), "nan@2:1,enospc_mid_write@4:1", nproc=2)
    assert_rank_1_disk_full_reported(proc, 4, "step-2")
    assert listing(tmp_path / "run") == ["step-2"]


@pytest.mark.slow
def test_async_kill_9_of_rank_1_mid_background_write_then_the_resume_is_bit_exact_on_two_ranks(tmp_path, duo_reference):
    config, run = async_config(tmp_path, on_nonfinite="skip"), tmp_path / "run"
    # both ranks' writes of step 2 are held until step 3 has run; rank 1 dies inside its write of step 4
    proc = train(config, "nan@2:1,slow_write@2:0,slow_write@2:1,sigkill_mid_write@4:1", nproc=2)
    assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[-4000:]
    assert listing(run) == [".tmp-step-4", "step-2"]
    partial, whole = partial_shard(run / "checkpoints", 4, "pytorch_model_fsdp_0", rank=1)
    assert 0 < partial < whole, (partial, whole)

    finish = train(config, "", "--resume", nproc=2)
    assert_finished(finish)
    assert_resumed_from(finish, 2, removed=".tmp-step-4")
    assert_same_training(duo_reference, run)


# ---- safe loading and tensor checks (no training)


def _fake_checkpoint(tmp_path: Path, tiny_model_dir: Path, name: str) -> Path:
    return fake_checkpoint(tmp_path / name, tiny_model_dir)


def test_export_refuses_a_pickle_that_runs_code(tmp_path, tiny_model_dir):
    proof, marker = tmp_path / "proof-created", tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": Payload(proof)}, tmp_path / "proof.bin")
    torch.load(tmp_path / "proof.bin", weights_only=False)  # the payload is live: an unsafe load runs it
    assert proof.exists()

    ckpt = _fake_checkpoint(tmp_path, tiny_model_dir, "evil")
    torch.save({"model.embed_tokens.weight": Payload(marker)}, ckpt / "pytorch_model_fsdp.bin")
    proc = run_cli("export", str(ckpt), str(tmp_path / "out"), check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    no_traceback(proc)
    assert "refusing to load it" in proc.stderr and "weights_only=True" in proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_checkpoint_weights_refuse_non_tensor_files(tmp_path, tiny_model_dir):
    ckpt = _fake_checkpoint(tmp_path, tiny_model_dir, "plain")
    with open(ckpt / "pytorch_model_fsdp.bin", "wb") as f:  # an old-style plain pickle, not torch.save's zip
        pickle.dump({"w": Payload(tmp_path / "pwned")}, f)
    with pytest.raises(UserError, match="refusing to load it"):
        CheckpointWeights(ckpt)
    torch.save({"w": torch.zeros(2), "n": 3}, ckpt / "pytorch_model_fsdp.bin")  # loads safely, but not all tensors
    with pytest.raises(UserError, match=r"not tensors: \['n'\]"):
        CheckpointWeights(ckpt)
    assert not (tmp_path / "pwned").exists()


def test_export_of_a_full_state_dict_checks_shapes(tmp_path, tiny_model_dir):
    from hfsdp.export.pipeline import export_checkpoint, export_source

    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # a state dict holds tied weights too
    ckpt = _fake_checkpoint(tmp_path, tiny_model_dir, "full")
    torch.save(weights, ckpt / "pytorch_model_fsdp.bin")
    out = export_checkpoint(export_source(ckpt), tmp_path / "good", [])  # positive control: the intact file exports
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], weights[k]) for k in exported)

    name = "model.layers.0.mlp.up_proj.weight"
    broken = dict(weights, **{name: weights[name].t().contiguous()})
    torch.save(broken, ckpt / "pytorch_model_fsdp.bin")
    with pytest.raises(UserError, match=f"'{name}' has shape"):
        export_checkpoint(export_source(ckpt), tmp_path / "bad", [])
    assert not (tmp_path / "bad").exists()


def test_empty_and_misshaped_tensors_are_rejected_at_write_and_read(tmp_path):
    with pytest.raises(UserError, match=r"tensor 'a' is empty \(shape \[0, 4\]\)"):
        write_hf_weights([("ok", torch.ones(2)), ("a", torch.zeros(0, 4))], tmp_path / "w1", expected=None)
    with pytest.raises(UserError, match=r"tensor 'a' has shape \[2, 3\], expected \[3, 2\]"):
        write_hf_weights([("a", torch.zeros(2, 3))], tmp_path / "w2", expected={"a": (3, 2)})
    with pytest.raises(UserError, match="1 tensor\\(s\\) missing"):
        write_hf_weights([("a", torch.zeros(3, 2))], tmp_path / "w3", expected={"a": (3, 2), "b": (1,)})
    for folder in ("w1", "w2", "w3"):
        assert not (tmp_path / folder / "model.safetensors").exists()  # nothing renamed into place

    (tmp_path / "r1").mkdir()
    save_file({"a": torch.zeros(0)}, str(tmp_path / "r1" / "model.safetensors"))
    with pytest.raises(UserError, match="is empty"):
        verify_hf_weights(tmp_path / "r1", None)
    (tmp_path / "r2").mkdir()
    save_file({"a": torch.zeros(2, 3)}, str(tmp_path / "r2" / "model.safetensors"))
    with pytest.raises(UserError, match="has shape"):
        verify_hf_weights(tmp_path / "r2", {"a": (3, 2)})
    verify_hf_weights(tmp_path / "r2", {"a": (2, 3)})  # and a correct one passes


class _FailingAccelerator:
    """Just enough of an Accelerator for checkpoint.save: one process whose writer fails halfway."""

    is_main_process = True
    num_processes = 1

    def __init__(self, fail: bool):
        self.fail = fail

    def save_state(self, output_dir, **kwargs):
        Path(output_dir, "model.safetensors").write_bytes(b"partial")
        if self.fail:
            raise RuntimeError("writer exploded")


def test_failing_writer_leaves_the_previous_checkpoint(tmp_path, tiny_model_dir):
    args = _save_args(tiny_model_dir)
    ckpts = tmp_path / "checkpoints"
    good = checkpoint.save(_FailingAccelerator(False), ckpts, 1, {"step": 1}, *args)
    assert read_record(good)["step"] == 1
    with pytest.raises(checkpoint.CheckpointError, match="step 2 could not be written: RuntimeError: writer exploded") as info:
        checkpoint.save(_FailingAccelerator(True), ckpts, 2, {"step": 2}, *args)
    assert "step-1, is intact" in str(info.value) and info.value.exit_code == 1
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]
    assert checkpoint.complete_checkpoints(ckpts) == [(1, good)]
    assert (good / "model.safetensors").read_bytes() == b"partial"  # untouched, not replaced


class _WritingAccelerator(_FailingAccelerator):
    """One process whose save_state writes a small DCP-like layout (a nested shard file and a state file)."""

    def __init__(self, content: bytes):
        super().__init__(False)
        self.content = content

    def save_state(self, output_dir, **kwargs):
        Path(output_dir, "pytorch_model_fsdp_0").mkdir()
        Path(output_dir, "pytorch_model_fsdp_0", "__0_0.distcp").write_bytes(self.content)
        Path(output_dir, "custom_checkpoint_0.pkl").write_bytes(self.content)


def _save_args(tiny_model_dir: Path):
    from transformers import AutoConfig, AutoTokenizer

    from hfsdp.model.metadata import ModelFiles

    files = ModelFiles.of(AutoConfig.from_pretrained(str(tiny_model_dir)), AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    return files, "train: {}\n"


def test_every_checkpoint_file_is_on_disk_before_the_record(tmp_path, tiny_model_dir, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ckpts = tmp_path / "checkpoints"
    final = checkpoint.save(_WritingAccelerator(b"weights"), ckpts, 1, {"step": 1}, *_save_args(tiny_model_dir))
    tmp = str(ckpts / ".tmp-step-1")
    record_at = next(i for i, path in enumerate(synced) if path.endswith(checkpoint.RECORD + ".tmp"))
    before_record = set(synced[:record_at])
    paths = [p for p in final.rglob("*") if p.name != checkpoint.RECORD]
    assert len(paths) > 5
    for path in paths + [final]:  # every file and every folder, synced while still in the temporary folder
        assert str(path).replace(str(final), tmp) in before_record, path
    assert str(ckpts) in synced[record_at:]  # and the rename into place


def test_a_resave_of_the_same_step_always_leaves_a_complete_copy(tmp_path, tiny_model_dir, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    args = _save_args(tiny_model_dir)
    checkpoint.save(_WritingAccelerator(b"old"), ckpts, 1, {"step": 1}, *args)
    shard = ckpts / "step-1" / "pytorch_model_fsdp_0" / "__0_0.distcp"
    seen: list[bytes] = []

    def complete_after(fn):
        def wrapped(*a, **k):
            result = fn(*a, **k)
            assert checkpoint.complete_checkpoints(ckpts) == [(1, ckpts / "step-1")], f"no complete step-1 after {fn}"
            seen.append(shard.read_bytes())
            return result
        return wrapped

    for name in ("replace", "rename"):
        monkeypatch.setattr(os, name, complete_after(getattr(os, name)))
    monkeypatch.setattr(shutil, "rmtree", complete_after(shutil.rmtree))
    checkpoint.save(_WritingAccelerator(b"new"), ckpts, 1, {"step": 1}, *args)
    assert shard.read_bytes() == b"new" and seen[0] == b"old" and seen[-1] == b"new"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]


def test_resave_without_an_atomic_swap_still_replaces_the_step(tmp_path, tiny_model_dir, monkeypatch):
    """Where renameat2(RENAME_EXCHANGE) is unavailable, the old copy is renamed aside first, then deleted."""
    from hfsdp.disk import durable

    monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
    ckpts = tmp_path / "checkpoints"
    args = _save_args(tiny_model_dir)
    checkpoint.save(_WritingAccelerator(b"old"), ckpts, 1, {"step": 1}, *args)
    checkpoint.save(_WritingAccelerator(b"new"), ckpts, 1, {"step": 1}, *args)
    assert (ckpts / "step-1" / "custom_checkpoint_0.pkl").read_bytes() == b"new"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]


# ---- the host fails the run: a second run into the folder, a full disk, a read-only or vanishing folder, a slow
# disk. A real small tmpfs is mounted for a full or read-only disk (root only; skipped with the reason otherwise).


def test_a_short_write_is_a_full_disk_when_less_is_free_than_the_write_still_needed(tmpfs):
    """torch's zip writer reports a short write without its errno ("unexpected pos"). On a disk other jobs share,
    a few MiB may be free again by the time the error is read (the CI rehearsal of 2026-12-02 read "unexpected pos
    704 vs 598" with 16 MiB free and no word of the disk): less free than the checkpoint still needed is a full disk."""
    from hfsdp.disk import space

    disk = tmpfs("shared", 8)
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    full = space.disk_full(short, disk, still_needed=40 * 2**20)
    assert full is not None and 7 * 2**20 < full.free <= 8 * 2**20 and "tmpfs at" in full.filesystem
    assert space.disk_full(short, disk, still_needed=2**20) is None  # room enough: some other failure


def error_line(proc) -> str:
    return next((ln for ln in proc.stderr.splitlines() if "hfsdp: error:" in ln), "")


def stopped(proc, exit_code: int = 1) -> str:
    """The one error line of a run that stopped with ``exit_code`` and no traceback."""
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    no_traceback(proc)
    return error_line(proc)


def test_one_process_at_a_time_builds_a_cache_entry_and_a_killed_holders_lock_is_free(tmp_path):
    """The built-in models' cache and the preprocessing cache build each entry under
    :func:`hfsdp.disk.lock.one_at_a_time`: another process waits while the holder lives, and goes on once it is
    killed (-9: the kernel drops the lock; its file stays)."""
    import sys
    import threading

    from hfsdp.disk.lock import one_at_a_time

    lock = tmp_path / "cache" / ".entry.lock"
    script = ("import sys, time\nfrom pathlib import Path\nfrom hfsdp.disk.lock import one_at_a_time\n"
              "with one_at_a_time(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(300)\n")
    holder = subprocess.Popen([sys.executable, "-c", script, str(lock)], env=base_env(), stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        entered = threading.Event()

        def build():
            with one_at_a_time(lock):
                entered.set()

        builder = threading.Thread(target=build)
        builder.start()
        assert not entered.wait(1.0), "entered while another process held the lock"
    finally:
        holder.kill()
        holder.wait()
    assert entered.wait(60), "the killed holder's lock was not freed"
    builder.join()
    assert lock.is_file()


def wait_until_stopped(pid: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.2)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


@pytest.mark.slow
def test_a_second_run_into_a_live_runs_folder_is_refused_even_with_overwrite_and_a_killed_runs_lock_is_free(
        tmp_path, solo_reference):
    import socket
    import sys

    config, run = fault_config(tmp_path, save_every=1), tmp_path / "run"
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen([sys.executable, "-m", "hfsdp", "train", str(config)], env=fault_env("sigstop@2"),
                             stdout=log, stderr=subprocess.STDOUT)  # frozen at the end of step 2: a live run
    try:
        wait_until_stopped(first.pid)
        before = snapshot(run)
        second = train(config, "", "--overwrite")  # a requeued job started into the same folder
        assert second.returncode == 2, second.stderr[-3000:]
        no_traceback(second)
        line = error_line(second)
        assert line.startswith(f"hfsdp: error: train.output_dir {run} is in use by another run (pid {first.pid} on "
                               f"host {socket.gethostname()}, started "), line
        assert line.endswith(f"UTC), which holds {run}/.hfsdp-run.lock; nothing of it was changed. Wait for that "
                             "run to end (or stop it), or set another train.output_dir"), line
        assert "Loading weights" not in second.stderr
        assert snapshot(run) == before  # the first run's metrics, config and checkpoint, byte for byte
        assert listing(run) == ["step-1"]
        # a run into another folder that resumes from the live run's checkpoint (which keep_last may prune): refused
        elsewhere = tmp_path / "elsewhere"
        borrower = train(config, "", f"--resume={run}/checkpoints/step-1", "--set", f"train.output_dir={elsewhere}")
        assert borrower.returncode == 2, borrower.stderr[-3000:]
        assert error_line(borrower).startswith(
            f"hfsdp: error: --resume {run}/checkpoints/step-1: that checkpoint is in the folder of a run that is "
            f"still training (pid {first.pid} on host {socket.gethostname()}, started "), error_line(borrower)
        assert "Loading weights" not in borrower.stderr
    finally:
        first.kill()  # kill -9: the lock goes with the process, its file stays
        first.wait()
        log.close()
    assert (run / ".hfsdp-run.lock").is_file()
    # that run ended: its checkpoint resumes into the other folder (the hold on it released once loaded) ...
    borrower = train(config, "", f"--resume={run}/checkpoints/step-1", "--set", f"train.output_dir={elsewhere}")
    assert_finished(borrower)
    assert_resumed_from(borrower, 1)
    assert_same_training(solo_reference, elsewhere, first_step=2)
    finish = train(config, "", "--resume")  # ... and the lock of the killed run is free: the requeued job continues
    assert_finished(finish)
    assert_resumed_from(finish, 1)
    assert_same_training(solo_reference, run)


@pytest.mark.slow
def test_a_full_disk_stops_at_the_save_that_does_not_fit_saying_so_then_the_run_resumes_elsewhere_bit_exact(
        tmp_path, tmpfs, solo_reference):
    from hfsdp.disk.space import folder_bytes, size_text

    disk = tmpfs("disk", 140)  # two checkpoints of the tiny model (53 MiB each) fit, a third does not
    run = disk / "run"
    config = fault_config(tmp_path, save_every=1, output_dir=str(run))
    proc = train(config, "")
    assert proc.returncode == 1, proc.stderr[-3000:]
    no_traceback(proc)
    assert ("warning: tmpfs at " + str(disk)) in proc.stdout and "this run holds at once (4 checkpoints: " \
        "train.keep_last 3 + the one being written, and the final export); it stops at the save that does not " \
        "fit, the last complete checkpoint kept" in proc.stdout, proc.stdout[-3000:]
    needed = folder_bytes(run / "checkpoints" / "step-2")
    line = error_line(proc)
    head = f"hfsdp: error: checkpoint for step 3 could not be written: no space left on device: tmpfs at {disk} has "
    assert line.startswith(head), line
    free = int(line[len(head):].split("(", 1)[1].split(" bytes) free", 1)[0])
    assert free < needed
    assert line.endswith(f" bytes) free, and the checkpoint needs about {size_text(needed)}; the last complete "
                         f"checkpoint, {run}/checkpoints/step-2, is intact and `--resume` continues from it: free "
                         "space there, or copy the run folder to a disk with room and `--resume` there"), line
    assert listing(run) == ["step-1", "step-2"]  # nothing partial; the complete checkpoints as they were

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run, elsewhere)
    finish = train(config, "", "--resume", "--set", f"train.output_dir={elsewhere}")
    assert_finished(finish)
    assert_resumed_from(finish, 2)
    assert_same_training(solo_reference, elsewhere)

    # a disk smaller than one checkpoint: refused at start-up, before any weight loads
    small = tmpfs("small", 32)  # an export (16 MiB) fits once
    start = train(config, "", "--set", f"train.output_dir={small / 'run'}")
    assert start.returncode == 2 and "Loading weights" not in start.stderr, start.stderr[-3000:]
    line = error_line(start)
    assert line.startswith(f"hfsdp: error: no space left on device for this run: tmpfs at {small} has 32.0 MiB ("), line
    assert line.endswith(" bytes) free and one checkpoint of this model needs about 49.4 MiB (51810048 bytes); free "
                         "space there or set train.output_dir to a folder with more room"), line

    # `hfsdp export` onto the small disk: the first export fits; a second, with --overwrite, does not, and neither
    # the first export nor the checkpoint is touched
    out, source = small / "out", elsewhere / "checkpoints" / "step-6"
    run_cli("export", str(source), str(out), env=fault_env(), timeout=300)
    exported, kept = snapshot(out), snapshot(source)
    again = run_cli("export", str(source), str(out), "--overwrite", env=fault_env(), check=False, timeout=300)
    assert again.returncode == 1, again.stderr[-3000:]
    no_traceback(again)
    line = error_line(again)
    assert line.startswith(f"hfsdp: error: export: no space left on device: tmpfs at {small} has "), line
    assert line.endswith(f"; nothing was changed: {out} and {source} are as they were. Free space there or export "
                         "to a folder with more room"), line
    assert snapshot(out) == exported and snapshot(source) == kept
    assert [p.name for p in small.iterdir() if p.name.startswith(".out")] == []  # the temporary folder removed


def test_a_full_disk_inside_torchs_own_writer_is_reported_as_a_full_disk(tmp_path, tmpfs, tiny_model_dir):
    """torch's zip writer (torch.save) reports a short write as 'unexpected pos N vs M', without the errno."""
    disk = tmpfs("disk", 8)  # the model files (3.5 MiB of tokenizer) fit once; an 8 MiB tensor does not

    class TensorWriter(_FailingAccelerator):
        def save_state(self, output_dir, **kwargs):
            torch.save({"w": torch.zeros(2**21)}, Path(output_dir, "optimizer.bin"))

    args = _save_args(tiny_model_dir)
    ckpts = disk / "checkpoints"
    good = checkpoint.save(_WritingAccelerator(b"weights"), ckpts, 1, {"step": 1}, *args)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.save(TensorWriter(False), ckpts, 2, {"step": 2}, *args)
    message = str(info.value)
    assert message.startswith(f"checkpoint for step 2 could not be written: no space left on device: tmpfs at {disk} "
                              "has 0 bytes (0 bytes) free, and the checkpoint needs more than the "), message
    assert "written before the disk filled (RuntimeError: [enforce fail at inline_container.cc:" in message
    assert "unexpected pos" in message
    assert message.endswith(f"; the last complete checkpoint, {good}, is intact and `--resume` continues from it: "
                            "free space there, or copy the run folder to a disk with room and `--resume` there")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]


def test_a_read_only_output_or_cache_folder_is_refused_before_any_weight_loads(tmp_path, tmpfs):
    frozen = tmpfs("frozen", 1, read_only=True)
    proc = train(fault_config(tmp_path, output_dir=str(frozen / "run")), "")
    assert proc.returncode == 2 and "Loading weights" not in proc.stderr, proc.stderr[-3000:]
    assert error_line(proc) == (f"hfsdp: error: train.output_dir {frozen / 'run'}: cannot write there (Read-only file "
                                "system); choose a folder you can write to")
    proc = run_cli("train", str(fault_config(tmp_path)), env={**fault_env(), "HFSDP_CACHE_DIR": str(frozen)},
                   check=False, timeout=300)
    assert proc.returncode == 2 and "Loading weights" not in proc.stderr, proc.stderr[-3000:]
    assert error_line(proc) == (f"hfsdp: error: the hfsdp cache folder {frozen}: cannot write there (Read-only file "
                                "system); set HFSDP_CACHE_DIR to a folder you can write to")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_checkpoint_replaced_or_a_run_folder_deleted_under_the_run_is_found_at_the_next_save(tmp_path):
    config, run = fault_config(tmp_path, save_every=1, max_steps=3), tmp_path / "run"
    proc = train(config, "replace_record@2")  # another job rewrote step-1's record during step 2
    assert stopped(proc) == (
        f"hfsdp: error: checkpoint for step 2 could not be written: {run}/checkpoints/step-1, the checkpoint this run "
        "completed at step 1, was replaced while the run trained (its hfsdp_checkpoint.json is not the one this run "
        f"wrote); another job may be writing into train.output_dir {run}, so nothing was written over it. Find what "
        "else writes there, then resume from a checkpoint you trust; the last complete checkpoint, "
        f"{run}/checkpoints/step-1, is intact and `--resume` continues from it")
    assert listing(run) == ["step-1"]
    assert json.loads((run / "checkpoints" / "step-1" / checkpoint.RECORD).read_text())["written_by"] == "another job"

    proc = train(config, "delete_output@2", "--overwrite")
    assert stopped(proc).startswith(
        f"hfsdp: error: checkpoint for step 2 could not be written: train.output_dir {run} was deleted or replaced "
        "while this run trained (the lock file .hfsdp-run.lock this run holds there is gone or another's); nothing "
        "was written into it."), error_line(proc)
    assert not run.exists()  # not created again


@pytest.mark.slow
def test_a_save_slower_than_save_timeout_stops_the_run_with_the_step_path_and_time_then_resumes_bit_exact(
        tmp_path, solo_reference):
    config, run = fault_config(tmp_path, save_every=1, save_timeout_s=4), tmp_path / "run"
    t0 = time.monotonic()
    proc = train(config, "slow_write@2")  # step 2's write hangs (up to 120 s)
    elapsed = time.monotonic() - t0
    assert stopped(proc) == (
        f"hfsdp: error: checkpoint for step 2 ({run}/checkpoints/.tmp-step-2) was not complete after 4 s, more than "
        "train.save_timeout_s (4 s): the storage is too slow or hung, so the run stopped; the last complete "
        f"checkpoint, {run}/checkpoints/step-1, is intact and `--resume` continues from it. Raise "
        "train.save_timeout_s for slower storage")
    assert elapsed < 100, f"took {elapsed:.0f}s"
    assert listing(run) == [".tmp-step-2", "step-1"]
    finish = train(config, "", "--resume")
    assert_finished(finish)
    assert_resumed_from(finish, 1, removed=".tmp-step-2")
    assert_same_training(solo_reference, run)


@pytest.mark.slow
def test_a_save_hung_on_one_of_two_ranks_stops_both_within_the_save_timeout_then_resumes(tmp_path):
    """Rank 1's write of step 2 hangs (rank 0's completes): every rank stops after train.save_timeout_s with the
    step, the folder and the intact checkpoint named (exit 1 each, no traceback), none waits for a collective's
    timeout; --resume removes the incomplete folder and finishes from step 1."""
    config, run = fault_config(tmp_path, save_every=1, save_timeout_s=4, max_steps=3), tmp_path / "run"
    t0 = time.monotonic()
    proc = train(config, "slow_write@2:1", nproc=2)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0 and "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "hfsdp: error:" in line]
    assert len(errors) == 2, proc.stderr[-4000:]
    assert all(f"checkpoint for step 2 ({run}/checkpoints/.tmp-step-2) was not complete after 4 s, more than "
               "train.save_timeout_s (4 s)" in e and f"the last complete checkpoint, {run}/checkpoints/step-1, is "
               "intact" in e for e in errors), errors
    assert elapsed < 100, f"took {elapsed:.0f}s"
    assert complete_steps(run) == [1]
    finish = train(config, "", "--resume", nproc=2)
    assert_finished(finish)
    assert_resumed_from(finish, 1, removed=".tmp-step-2")


@pytest.mark.slow
def test_a_resume_removes_what_an_export_killed_midway_left_and_writes_final(tmp_path):
    """A job killed inside its final export leaves ``.final.tmp-*`` (the export's temporary folder; the chaos tests
    found one left for good) or, while replacing an earlier ``final/``, ``.final.old-*``; the ``--resume`` from the
    last checkpoint (at the last step: no step to train) removes them, says so, and writes ``final/``."""
    config, run = fault_config(tmp_path, save_every=2, max_steps=2), tmp_path / "run"
    assert_finished(train(config, ""))
    shutil.rmtree(run / "final")
    for name in (".final.tmp-4242-0a1b2c3d", ".final.old-4242-4e5f6a7b"):
        (run / name).mkdir()
        (run / name / "model.safetensors").write_bytes(b"half written")
    finish = train(config, "", "--resume")
    assert_finished(finish)
    assert_resumed_from(finish, 2)
    for name in (".final.tmp-4242-0a1b2c3d", ".final.old-4242-4e5f6a7b"):
        assert f"removed {name}, an export a stopped run left unfinished" in finish.stdout, finish.stdout[-2000:]
    assert sorted(p.name for p in run.glob(".final*")) == [] and (run / "final" / "model.safetensors").is_file()


def test_memory_soak_benchmark_answers_help():
    """The soak itself (1,500 steps on 2 ranks) is a benchmark, not CI: docs/benchmarks.md has its figures."""
    import sys

    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" /
                                              "memory_soak.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--check-step" in proc.stdout and "RSS" in proc.stdout, proc.stderr


def test_a_preprocessing_killed_midway_leaves_a_folder_the_next_builder_removes(tmp_path):
    """A builder killed while it wrote its entry leaves ``KEY.tmp-*`` (the size of the tokenized data) beside the
    entry; the next builder of that key, under the entry's lock, removes it (and builds); other keys' are left."""
    import datasets

    from hfsdp.data import cache as data_cache

    entries = tmp_path / "datasets"
    for leftover in ("entry.tmp-killed1", "other.tmp-killed2"):
        (entries / leftover / "data").mkdir(parents=True)
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    data, meta, hit = data_cache.load_or_build(tmp_path, "entry", lambda: (rows, {"n": 1}),
                                               data_cache.Preprocessing(builder=True, run="r"))
    assert (data["input_ids"], meta, hit) == ([[1, 2, 3]], {"n": 1}, False)
    assert sorted(p.name for p in entries.iterdir()) == ["entry", "entry.lock", "other.tmp-killed2"]


def test_a_full_disk_under_the_preprocessing_cache_is_reported_as_a_full_disk(tmp_path, tmpfs):
    import datasets

    from hfsdp.data import cache as data_cache

    disk = tmpfs("cache", 1)
    rows = datasets.Dataset.from_dict({"input_ids": [list(range(512))] * 1024})  # 4 MiB of int64 tokens
    with pytest.raises(UserError) as info:
        data_cache.load_or_build(disk, "entry", lambda: (rows, {}), data_cache.Preprocessing(builder=True, run="r"))
    message = str(info.value)
    assert message.startswith(f"preprocessing cache: no space left on device: tmpfs at {disk} has "), message
    assert message.endswith("; nothing was cached. Free space there or set HFSDP_CACHE_DIR to a folder with more "
                            "room"), message
    assert info.value.exit_code == 1
    entries = disk / "datasets"
    assert sorted(p.name for p in entries.iterdir()) == ["entry.failed-r", "entry.lock"]  # no partial entry
    assert json.loads((entries / "entry.failed-r").read_text()) == {"user_error": True, "message": message}
