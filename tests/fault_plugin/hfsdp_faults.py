"""Test-only hfsdp plugin that injects faults at exact steps, driven by the HFSDP_TEST_FAULTS environment variable.

Enable it with ``plugins: [hfsdp_faults]`` and this folder on PYTHONPATH. Without the variable it does nothing, so
a reference run and an interrupted run can share one config (the plugin list is part of the resume fingerprint).

``HFSDP_TEST_FAULTS`` is a comma-separated list of ``KIND@STEP`` or ``KIND@STEP:RANK`` (default rank 0):

* ``sigterm`` / ``sigint``: the process signals itself at the end of optimizer step STEP;
* ``sigkill_in_save``: ``save_state`` for step STEP writes all its files, then the process SIGKILLs itself
  (before the completion record exists);
* ``enospc_in_save`` / ``raise_in_save``: ``save_state`` for step STEP writes its files, then raises
  ``OSError(ENOSPC)`` / ``RuntimeError``;
* ``nan``: the model's logits are NaN during the training forward passes of step STEP on rank RANK;
* ``sigkill`` / ``sigstop``: the process SIGKILLs / SIGSTOPs (freezes) itself at the end of optimizer step STEP.

Faults fire in a job's first attempt only: workers that ``torchrun --max-restarts`` started again
(``TORCHELASTIC_RESTART_COUNT`` > 0) run clean.
"""

import errno
import os
import signal

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
    accelerator = run.accelerator
    original = accelerator.save_state
    kills, enospc, raises = _faults("sigkill_in_save"), _faults("enospc_in_save"), _faults("raise_in_save")
    if not (kills or enospc or raises):
        return

    def save_state(output_dir=None, **kwargs):
        result = original(output_dir, **kwargs)  # the files are written; the completion record is not yet
        step = run.state.step
        if step in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        if step in enospc:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(output_dir))
        if step in raises:
            raise RuntimeError(f"injected writer failure at step {step}")
        return result

    accelerator.save_state = save_state


@hookimpl
def hfsdp_on_step_end(step):
    _state["step"] = step
    if step in _faults("sigterm"):
        os.kill(os.getpid(), signal.SIGTERM)
    if step in _faults("sigint"):
        os.kill(os.getpid(), signal.SIGINT)
    if step in _faults("sigkill"):
        os.kill(os.getpid(), signal.SIGKILL)
    if step in _faults("sigstop"):
        os.kill(os.getpid(), signal.SIGSTOP)
