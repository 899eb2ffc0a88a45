"""``hfsdp export`` (and every other export: LoRA adapters, ``train.output_dir/final``) never removes what it did not
write: OUT must be new, empty, or an earlier hfsdp export replaced with ``--overwrite``; an OUT that is or holds a
run or the checkpoint itself is refused; a failed export leaves no temporary folder and OUT as it was.

Checkpoints here are the tiny model's weights in a FULL (torch.save) checkpoint, so no training is needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import fake_checkpoint, run_cli, tiny_config
from hfsdp.disk.durable import EXPORT_RECORD
from hfsdp.errors import UserError
from hfsdp.export.pipeline import export_checkpoint, export_source


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for folders): what 'untouched' means."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def run(tmp_path, tiny_model_dir) -> Path:
    """A run folder as training leaves it: metrics, config and a complete FULL checkpoint at step 2."""
    run = tmp_path / "runs" / "x"
    ckpt = fake_checkpoint(run / "checkpoints" / "step-2", tiny_model_dir)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    torch.save(weights, ckpt / "pytorch_model_fsdp.bin")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "config.yaml").write_text("train: {}\n")
    return run


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_export_into_the_run_folder_is_refused_and_the_run_survives(run):
    """The reported bug: `hfsdp export runs/x/checkpoints/step-2 runs/x` deleted the whole run and exited 0."""
    before = snapshot(run)
    proc = run_cli("export", str(run / "checkpoints" / "step-2"), str(run), "--overwrite", check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hfsdp: error:")]
    assert errors == [f"hfsdp: error: export: OUT {run} contains the checkpoint being exported "
                      f"({run / 'checkpoints' / 'step-2'}); export never writes over its source: choose a new or "
                      "empty folder"], proc.stderr
    assert snapshot(run) == before
    assert leftovers(run.parent) == []


@pytest.mark.parametrize("target, message", [
    (lambda run: run / "checkpoints", "contains the checkpoint being exported"),
    (lambda run: run / "checkpoints" / "step-2", "contains the checkpoint being exported"),
    (lambda run: run.parent.parent, "contains the checkpoint being exported"),
    (lambda run: run / "checkpoints" / "step-2" / "model", "is inside the checkpoint"),
    (lambda run: run / "checkpoints" / "step-2" / "exported", "is inside the checkpoint"),
])
def test_out_that_contains_or_lies_inside_the_checkpoint_is_refused(run, target, message):
    before = snapshot(run.parent.parent)
    with pytest.raises(UserError, match=message):
        export_checkpoint(export_source(run / "checkpoints" / "step-2"), target(run), [], overwrite=True)
    assert snapshot(run.parent.parent) == before


def test_out_that_is_or_holds_another_run_is_refused(run, tmp_path, tiny_model_dir):
    other = tmp_path / "elsewhere" / "other"
    fake_checkpoint(other / "checkpoints" / "step-1", tiny_model_dir)
    (other / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path)
    ckpt = run / "checkpoints" / "step-2"
    with pytest.raises(UserError, match="is a training run or checkpoint folder"):
        export_checkpoint(export_source(ckpt), other, [], overwrite=True)
    with pytest.raises(UserError, match=f"holds a training run \\({other}\\)"):
        export_checkpoint(export_source(ckpt), other.parent, [], overwrite=True)
    with pytest.raises(UserError, match="is a training run or checkpoint folder"):
        export_checkpoint(export_source(ckpt), other / "checkpoints" / "step-1", [], overwrite=True)
    assert snapshot(tmp_path) == before


def test_a_folder_that_is_not_an_export_is_never_replaced(run, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    ckpt = run / "checkpoints" / "step-2"
    for overwrite in (False, True):
        with pytest.raises(UserError, match="is not empty and is not an earlier hfsdp export"):
            export_checkpoint(export_source(ckpt), mine, [], overwrite=overwrite)
    assert snapshot(mine) == {"notes.txt": b"my notes"}
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="exists and is not a folder"):
        export_checkpoint(export_source(ckpt), a_file, [], overwrite=True)
    assert a_file.read_text() == "x"
    assert leftovers(tmp_path) == []


def test_new_empty_and_earlier_exports(run, tmp_path):
    ckpt = run / "checkpoints" / "step-2"
    out = tmp_path / "exports" / "step-2"
    export_checkpoint(export_source(ckpt), out, [])  # a new folder (and its parent) is created
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert set(record["files"]) == {p.name for p in out.iterdir()} - {EXPORT_RECORD}
    assert "model.safetensors" in record["files"] and "config.json" in record["files"]
    assert record["source"] == str(ckpt)
    first = snapshot(out)

    with pytest.raises(UserError, match="holds an earlier hfsdp export; pass --overwrite"):
        export_checkpoint(export_source(ckpt), out, [])
    assert snapshot(out) == first
    export_checkpoint(export_source(ckpt), out, [], max_shard_bytes=200_000, overwrite=True)  # replaced: now sharded
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    assert leftovers(out.parent) == []

    card = (out / "README.md").read_text()
    assert "## Training" in card and "| optimizer steps |" in card  # the export's model card
    (out / "README.md").write_text(card + "\nmy notes")  # edited after the export wrote it
    before = snapshot(out)
    with pytest.raises(UserError, match=r"README.md in OUT .* changed since hfsdp wrote it"):
        export_checkpoint(export_source(ckpt), out, [], overwrite=True)
    assert snapshot(out) == before
    (out / "README.md").write_text(card)
    (out / "notes.md").write_text("mine")  # something the export did not write
    before = snapshot(out)
    with pytest.raises(UserError, match=r"holds 1 file\(s\) the earlier export did not write \(notes.md\)"):
        export_checkpoint(export_source(ckpt), out, [], overwrite=True)
    assert snapshot(out) == before

    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(export_source(ckpt), empty, [])
    assert (empty / "model.safetensors").is_file()


def test_an_export_killed_midway_leaves_a_folder_the_next_export_into_its_out_removes(run, tmp_path, capsys):
    """``hfsdp export`` killed (kill -9) leaves ``.OUT.tmp-HOST-PID-*``; the next export into OUT removes the ones
    whose process on this host is gone, says so, and leaves another host's and a live process's alone."""
    import socket

    ckpt, out = run / "checkpoints" / "step-2", tmp_path / "out"
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()  # a pid no process has now
    host = socket.gethostname()
    dead, other_host, live = (tmp_path / f".out.tmp-{host}-{gone.pid}-0a1b2c3d",
                              tmp_path / f".out.tmp-{host}x-{gone.pid}-0a1b2c3d",
                              tmp_path / f".out.tmp-{host}-{os.getppid()}-4e5f6a7b")
    for folder in (dead, other_host, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half written")
    export_checkpoint(export_source(ckpt), out, [])
    assert f"removed {dead}, the temporary folder of an export into {out} that was stopped midway" in \
        capsys.readouterr().out
    assert not dead.exists() and other_host.is_dir() and live.is_dir() and (out / "model.safetensors").is_file()


def test_a_failed_export_leaves_nothing_and_keeps_the_earlier_export(run, tmp_path):
    ckpt = run / "checkpoints" / "step-2"
    out = tmp_path / "out"
    export_checkpoint(export_source(ckpt), out, [])
    before = snapshot(out)
    weights = torch.load(ckpt / "pytorch_model_fsdp.bin")
    name = "model.layers.0.mlp.up_proj.weight"
    torch.save(dict(weights, **{name: weights[name].t().contiguous()}), ckpt / "pytorch_model_fsdp.bin")
    with pytest.raises(UserError, match=f"'{name}' has shape"):
        export_checkpoint(export_source(ckpt), out, [], overwrite=True)
    assert snapshot(out) == before
    with pytest.raises(UserError, match=f"'{name}' has shape"):
        export_checkpoint(export_source(ckpt), tmp_path / "new", [])
    assert not (tmp_path / "new").exists()
    assert leftovers(tmp_path) == []


def test_train_never_replaces_a_final_folder_it_did_not_write(tmp_path):
    """`hfsdp train --overwrite` replaces an earlier run, but `final/` only if it is an hfsdp export."""
    config = tiny_config(tmp_path, train={"max_steps": 1})
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"someone else's model")
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path / "run")
    proc = run_cli("train", str(config), "--overwrite", check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"export: OUT {final} exists, is not empty and is not an earlier hfsdp export" in proc.stderr
    assert snapshot(tmp_path / "run") == before


@pytest.fixture
def sharded_checkpoint(tmp_path, tiny_model_dir) -> Path:
    """A SHARDED (DCP) checkpoint of the tiny model written by DCP in one process, with the shapes record hfsdp
    writes at save time."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig

    from hfsdp.model.metadata import ModelFiles

    ckpt = fake_checkpoint(tmp_path / "sharded" / "step-1", tiny_model_dir)
    ModelFiles.of(AutoConfig.from_pretrained(str(tiny_model_dir)), None).record(ckpt / "model")
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # a state dict holds the tied head too
    dcp.save({f"model.{k}": v for k, v in weights.items()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"),
             no_dist=True)
    return ckpt


def test_export_reads_the_metadata_once_and_imports_no_transformers(sharded_checkpoint, tmp_path, tiny_model_dir,
                                                                    monkeypatch):
    from hfsdp.checkpoint import safe_load

    calls = []
    real = safe_load.read_dcp_metadata
    monkeypatch.setattr(safe_load, "read_dcp_metadata", lambda folder: calls.append(folder) or real(folder))
    out = export_checkpoint(export_source(sharded_checkpoint), tmp_path / "out", [])
    assert len(calls) == 1  # not once per tensor
    exported, original = load_file(str(out / "model.safetensors")), load_file(str(tiny_model_dir / "model.safetensors"))
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)
    assert (out / "tokenizer.json").read_bytes() == (sharded_checkpoint / "model" / "tokenizer.json").read_bytes()

    probe = ("import sys; from pathlib import Path; from hfsdp.export.pipeline import export_checkpoint, export_source; "
             f"export_checkpoint(export_source(Path({str(sharded_checkpoint)!r})), Path({str(tmp_path / 'out2')!r}), []); "
             "print(sorted(m for m in ('transformers', 'peft', 'accelerate') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_streamed_safetensors_files_read_back_exactly(tmp_path, monkeypatch, kernel_copy):
    """The writer streams one tensor at a time (header written last, bytes copied in the kernel, or by a plain copy
    where copy_file_range is missing): every dtype, 0-d and sharded outputs read back identical."""
    import errno
    import os

    from hfsdp.export.hf_folder import write_hf_weights

    if not kernel_copy:
        monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "x")))
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "f16": torch.randn(2, 2).half(),
               "i64": torch.arange(9), "scalar": torch.tensor(3.5), "mask": torch.tensor([True, False, True])}
    for name, limit in (("one", None), ("many", 40)):
        write_hf_weights(tensors.items(), tmp_path / name, expected=None, max_shard_bytes=limit)
        back = {}
        for f in sorted((tmp_path / name).glob("*.safetensors")):
            back.update(load_file(str(f)))
        assert back.keys() == tensors.keys()
        assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
        assert not list((tmp_path / name).glob("*.data")) and not list((tmp_path / name).glob("*.tmp"))
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
