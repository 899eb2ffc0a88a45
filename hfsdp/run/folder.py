"""The run folder (``train.output_dir``) before anything loads: writable, not another live run's (its lock), an
earlier run refused, or replaced (``--overwrite``) or continued (``--resume``) as the CLI says, and kept whole until
the new run's first step (:mod:`hfsdp.disk.aside`); the model's local path resolved."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hfsdp.disk.aside import set_aside
from hfsdp.disk.lock import RunLock, put_back_abandoned
from hfsdp.errors import UserError
from hfsdp.export.staging import check_export_target
from hfsdp.model import loading
from hfsdp.setup.decide import RunSetup
from hfsdp.run.state import Options


OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "tensorboard", "config.yaml", "summary.json", "loss.png",
           "completions.jsonl")
STARTUP_REPORTS = "startup_rank*.json"
# What a resumed run rewrites before its first step (metrics.jsonl and tensorboard/ lose the steps it trains again):
# copied aside until that step, the checkpoints left in place
REWRITTEN_BY_RESUME = ("metrics.jsonl", "tensorboard", "config.yaml", "completions.jsonl")


def prepare_output_dir(output_dir: Path, opts: Options, resuming: bool, is_main: bool) -> RunLock | None:
    """Check and prepare ``train.output_dir`` (writable; not another live run's: the main process takes its
    :class:`hfsdp.disk.lock.RunLock` first); the lock, held by the main process, holding what ``--overwrite`` replaces
    and ``--resume`` rewrites of an earlier run, set aside until this run's first step (:mod:`hfsdp.disk.aside`)."""
    blocking = next((p for p in (output_dir, *output_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"train.output_dir {output_dir}: {blocking} is a file, not a folder; "
                        "set train.output_dir to a folder (it is created if missing)")
    if is_main:  # a start-up killed before its first step (kill -9) left the earlier run set aside
        put_back_abandoned(output_dir)
    check_export_target(output_dir / "final", overwrite=True)  # replaced only if it is an earlier hfsdp export
    existing = [name for name in OUTPUTS if (output_dir / name).exists()]
    if existing and not resuming and not opts.overwrite:
        raise UserError(
            f"train.output_dir {output_dir} already holds a run ({', '.join(existing)}). Pass --resume to continue "
            "it, --overwrite to replace it, or set another train.output_dir"
        )
    _check_writable(output_dir, "train.output_dir", "choose a folder you can write to")
    lock = RunLock.take(output_dir) if is_main else None
    if existing and is_main:  # only once the folder is this run's
        reports = sorted(p.name for p in output_dir.glob(STARTUP_REPORTS))
        try:
            lock.earlier = set_aside(output_dir, move=[*existing, *reports] if opts.overwrite else [],
                                     copy=[*REWRITTEN_BY_RESUME, *reports] if resuming else [],
                                     outputs=[*OUTPUTS, STARTUP_REPORTS])
        except BaseException:
            lock.release()
            raise
    return lock


def _check_writable(folder: Path, what: str, fix: str) -> None:
    """``folder`` exists (created if missing) and this process can create a file in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".hfsdp-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"{what} {folder}: cannot write there ({err.strerror}); {fix}") from None


def prepare_run(setup: RunSetup, opts: Options) -> tuple[str, Path, RunLock | None, RunLock | None]:
    """The model's local path (built-in models are converted once into the cache; concurrent ranks wait on its file
    lock), the prepared output folder and its lock (main process), and a shared hold on another run's folder whose
    checkpoint ``--resume`` names (main process; :meth:`RunLock.borrow`, to release once it is loaded), for a run
    whose checks :func:`hfsdp.setup.decide.decide` made. The cache folder and the output folder are checked
    writable first."""
    config = setup.config
    _check_writable(opts.cache_dir, "the hfsdp cache folder", "set HFSDP_CACHE_DIR to a folder you can write to")
    output_dir = Path(config.train.output_dir)
    lock = prepare_output_dir(output_dir, opts, resuming=setup.resume_asked, is_main=setup.world.rank == 0)
    borrowed = None
    try:
        if setup.resume is not None and setup.world.rank == 0 and not _inside(setup.resume.path, output_dir):
            borrowed = RunLock.borrow(setup.resume.path)
        model_path = loading.resolve_model_path(config.model.name_or_path, opts.cache_dir)
    except BaseException:
        for held in (lock, borrowed):
            if held is not None:
                held.release()
        raise
    if config.train.deterministic:
        torch.use_deterministic_algorithms(True)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if setup.world.rank != 0:  # one "Loading weights" bar, beside rank 0's other bars (not one per rank)
        hf_logging.disable_progress_bar()
    return model_path, output_dir, lock, borrowed


def _inside(path: Path, folder: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
