"""Test-only hfsdp plugin that injects faults at exact steps, driven by the HFSDP_TEST_FAULTS environment variable.

Enable it with ``plugins: [hfsdp_faults]`` and this folder on PYTHONPATH. Without the variable it does nothing, so
a reference run and an interrupted run can share one config (the plugin list is part of the resume fingerprint).

``HFSDP_TEST_FAULTS`` is a comma-separated list of ``KIND@STEP`` or ``KIND@STEP:RANK`` (default rank 0):

* ``sigterm`` / ``sigint``: the process signals itself at the end of optimizer step STEP (STEP 0: at the train
  start, ``hfsdp_on_train_start``: everything is loaded and written before the first step);
* ``sigkill_mid_write``: while ``save_state`` for step STEP writes the model's DCP shard file
  (``pytorch_model_fsdp_0/__<rank>_0.distcp``, in ``.tmp-step-STEP/``, whichever thread writes it), after its first
  tensor, half of the next tensor's bytes are written
  and synced, then the process SIGKILLs itself: a partially written shard file is left on disk;
* ``enospc_mid_write``: the same inside the optimizer's shard file (``optimizer_0/``), then the write raises
  ``OSError(ENOSPC)``, as a full disk would;
* ``slow_write``: the writes of the checkpoint of step STEP wait (up to 120 s) until the training loop has
  finished step STEP + 1, so that a background save (``train.async_save``) is still writing while the next step
  changes the parameters and optimizer state it saves (async only: a synchronous save would wait the 120 s);
* ``nan``: the model's logits are NaN during the training forward passes of step STEP on rank RANK;
* ``sigkill`` / ``sigstop``: the process SIGKILLs / SIGSTOPs (freezes) itself at the end of optimizer step STEP
  (``sigkill`` at STEP 0: at the train start, as ``sigterm``);
* ``replace_record``: at the end of step STEP, before its save, the newest complete checkpoint's
  ``hfsdp_checkpoint.json`` is rewritten with another record, as another job saving into the folder would;
* ``sigkill_export`` (STEP 0): the process SIGKILLs itself inside an export, its files written into the temporary
  folder, before the rename into place (``hfsdp_on_export``);
* ``delete_output``: at the end of step STEP, before its save, ``train.output_dir`` is deleted, as a cleanup job
  (or a user) would;
* ``sigkill_generation`` / ``sigstop_generation``: at the end of step STEP, the rank's generation processes
  (``generation.engine: workers``) are SIGKILLed / SIGSTOPped (frozen).

``HFSDP_TEST_PROGRESS`` (a file path): the first rank appends each optimizer step it ends to it, one line each, flushed
(the chaos harness, tests/chaos.py, counts an attempt's steps there).

Faults fire in a job's first attempt only: workers that ``torchrun --max-restarts`` started again
(``TORCHELASTIC_RESTART_COUNT`` > 0) run clean.
"""

import errno
import io
import os
import re
import signal
import time

import torch

from hfsdp import hookimpl

__version__ = "0.0.1"

_state = {"step": 0}  # completed optimizer steps in this process


def _faults(kind):
    """Steps at which fault ``kind`` fires on this rank."""
    rank = int(os.environ.get("RANK", "0"))
    steps = set()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return steps
    for item in filter(None, os.environ.get("HFSDP_TEST_FAULTS", "").split(",")):
        name, _, where = item.strip().partition("@")
        step, _, on_rank = where.partition(":")
        if name == kind and int(on_rank or 0) == rank:
            steps.add(int(step))
    return steps


@hookimpl
def hfsdp_modify_model(model):
    nan_steps = _faults("nan")
    if nan_steps:
        def poison(module, args, output):
            if module.training and _state["step"] + 1 in nan_steps:
                output.logits = output.logits * float("nan")
            return output

        model.register_forward_hook(poison)


@hookimpl
def hfsdp_on_train_start(run):
    _state["step"] = run.state.step
    for kind, sig in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT), ("sigkill", signal.SIGKILL)):
        if 0 in _faults(kind):
            os.kill(os.getpid(), sig)
    kills, enospc, slow = _faults("sigkill_mid_write"), _faults("enospc_mid_write"), _faults("slow_write")
    if not (kills or enospc or slow):
        return
    import torch.distributed.checkpoint.filesystem as dcp_files

    original = dcp_files._write_item  # DCP's writer looks it up at call time, once per item

    def write_item(transforms, stream, data, item, storage_key, serialization_format):
        saving = re.search(r"/\.tmp-step-(\d+)/", str(stream.name))  # the step of the checkpoint being written
        step = int(saving.group(1)) if saving else None
        deadline = time.monotonic() + 120
        while step in slow and _state["step"] <= step and time.monotonic() < deadline:
            time.sleep(0.05)
        folder = "pytorch_model_fsdp_0" if step in kills else "optimizer_0" if step in enospc else None
        if folder and f"/{folder}/" in str(stream.name) and stream.tell() > 0 and isinstance(data, torch.Tensor):
            encoded = io.BytesIO()
            torch.save(data, encoded)
            stream.write(encoded.getbuffer()[: encoded.tell() // 2])
            stream.flush()
            os.fsync(stream.fileno())
            if step in kills:
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(stream.name))
        return original(transforms, stream, data, item, storage_key, serialization_format)

    dcp_files._write_item = write_item


@hookimpl
def hfsdp_on_step_end(run, step):
    _state["step"] = step
    progress = os.environ.get("HFSDP_TEST_PROGRESS")
    if progress and run.accelerator.process_index == 0:
        with open(progress, "a") as out:
            out.write(f"{step}\n")
    if step in _faults("replace_record"):
        import json

        newest = max((p for p in (run.output_dir / "checkpoints").glob("step-*")), key=lambda p: int(p.name[5:]))
        record = newest / "hfsdp_checkpoint.json"
        record.write_text(json.dumps({**json.loads(record.read_text()), "written_by": "another job"}))
    if step in _faults("delete_output"):
        import shutil

        shutil.rmtree(run.output_dir)
    if step in _faults("sigterm"):
        os.kill(os.getpid(), signal.SIGTERM)
    if step in _faults("sigint"):
        os.kill(os.getpid(), signal.SIGINT)
    if step in _faults("sigkill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if step in _faults("sigstop"):
        os.kill(os.getpid(), signal.SIGSTOP)
    for kind, sig in (("sigkill_generation", signal.SIGKILL), ("sigstop_generation", signal.SIGSTOP)):
        if step in _faults(kind):
            for pid in _generation_processes():
                os.kill(pid, sig)


def _generation_processes():
    """The process ids of this process's generation processes: its children started by multiprocessing's spawn."""
    me = os.getpid()
    children = open(f"/proc/{me}/task/{me}/children").read().split()
    return [int(pid) for pid in children if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]


@hookimpl
def hfsdp_on_export(out_dir):
    if 0 in _faults("sigkill_export"):
        os.kill(os.getpid(), signal.SIGKILL)
