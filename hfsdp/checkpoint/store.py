"""Atomic checkpoints: written into a temporary folder, completed with a record, then renamed into place.

Layout: ``<output_dir>/checkpoints/step-<N>/`` holds Accelerate's ``save_state`` files (model, optimizer, RNG,
registered objects such as the LR scheduler and the trainer state), ``model/`` (config and tokenizer, so that
``hfsdp export`` needs nothing else), and ``hfsdp_checkpoint.json``, the completion record, written last.
A folder without the record is never resumed from or exported, and older checkpoints are pruned only after a
newer one is complete (Accelerate's ``total_limit`` deletes first). Every file and folder is fsynced before the
record is written, and a re-save of an existing step swaps the new folder in atomically before deleting the old one.
With ``train.async_save`` (:class:`Saver`) the model and optimizer shards are written in the background; the record
still comes last, once every rank's background write has finished and been fsynced.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hfsdp.disk import space
from hfsdp.disk.lock import RunLock
from hfsdp.disk.durable import RECORD, fsync_dir, fsync_tree, replace_folder, write_atomic
from hfsdp.errors import UserError
from hfsdp.model.metadata import ModelFiles
from hfsdp.disk.checkpoints import CONFIG_NAME, PREFIX, complete_checkpoints, latest, step_dir


class CheckpointError(UserError):
    """A checkpoint could not be written (disk full, failing writer). The previous complete checkpoint is intact."""

    exit_code = 1


class NoRoom(OSError):
    """The file system holds less than a checkpoint needs, found before writing it."""

    def __init__(self, path: Path):
        super().__init__(errno.ENOSPC, "found before writing it", str(path))


def _attempt(action) -> BaseException | None:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: DCP's failed save

    try:
        action()
    except (Exception, CheckpointException) as err:  # reported below, on every rank, after the tmp folder is removed
        return err
    return None


def save(accelerator, checkpoints: Path, step: int, record: dict[str, Any], model_files: ModelFiles,
         run_config_yaml: str) -> Path:
    """Write a checkpoint for ``step`` on all ranks; returns its final path once it is complete.

    A failure on any rank (e.g. ENOSPC) removes the temporary folder and raises :class:`CheckpointError` on every
    rank, so that no rank waits forever for another; the previous complete checkpoint is left as it was.
    """
    return Pending(accelerator, checkpoints, step, record, model_files, run_config_yaml).write_now()


@dataclass
class Pending:
    """A checkpoint being written, in phases that every rank runs and agrees on (:meth:`_phase`): :meth:`begin`
    checks where it goes (:meth:`_check_place`), creates the temporary folder and runs each rank's writer,
    :meth:`complete` waits for the writes the writer left running in the background (``background``), fsyncs each
    rank's files, then writes the completion record and renames the folder into place (main process). A save not
    complete ``timeout_s`` after it began stops the process (:meth:`_timed_out`) instead of waiting for the storage
    forever."""

    accelerator: Any
    checkpoints: Path
    step: int
    record: dict[str, Any]
    model_files: ModelFiles
    run_config_yaml: str
    background: list[Future] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    stall_s: float = 0.0  # how long the training loop was blocked by this save
    write_s: float = 0.0  # from the start of the save until the checkpoint was complete
    estimate: int = 0  # bytes a checkpoint of this run takes at least (hfsdp.disk.space.estimate), before one exists
    needed: int = 0  # bytes this checkpoint is expected to take: the last complete one's, else ``estimate``
    lock: RunLock | None = None  # the run's lock of train.output_dir (main process)
    previous: "Pending | None" = None  # the last checkpoint this process completed
    timeout_s: float | None = None
    _watchdog: threading.Timer | None = None

    @property
    def tmp(self) -> Path:
        return self.checkpoints / f".tmp-{PREFIX}{self.step}"

    @property
    def final(self) -> Path:
        return step_dir(self.checkpoints, self.step)

    @property
    def record_text(self) -> str:
        return json.dumps(self.record, indent=2, sort_keys=True)

    def begin(self, write: Callable[[], None]) -> None:
        def start() -> None:
            self._check_place()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir(parents=True)

        last = latest(self.checkpoints)
        self.needed = space.folder_bytes(last) if last is not None else self.estimate
        if self.timeout_s:
            self._watchdog = threading.Timer(self.timeout_s, self._timed_out)
            self._watchdog.daemon = True
            self._watchdog.start()
        self._phase("start", start, main_only=True)
        self._phase("save_state", write)

    def _check_place(self) -> None:
        """The run's folder is still the one it started in, its last checkpoint still the one it wrote, and there is
        room for this one: otherwise nothing is written (main process)."""
        run_dir = self.checkpoints.parent
        if self.lock is not None and not self.lock.still_ours():
            raise UserError(f"train.output_dir {run_dir} was deleted or replaced while this run trained (the lock "
                            f"file {self.lock.path.name} this run holds there is gone or another's); nothing was "
                            "written into it. Find what else writes there, then resume from a copy of the run's "
                            "checkpoints")
        prev = self.previous
        if prev is not None:
            try:
                found = (prev.final / RECORD).read_text()
            except OSError:
                found = None
            if found != prev.record_text:
                raise UserError(f"{prev.final}, the checkpoint this run completed at step {prev.step}, was "
                                f"{'deleted' if found is None else 'replaced'} while the run trained (its {RECORD} "
                                "is not the one this run wrote); another job may be writing into train.output_dir "
                                f"{run_dir}, so nothing was written over it. Find what else writes there, then "
                                "resume from a checkpoint you trust")
        if self.needed and space.space_of(self.checkpoints).free < self.needed:
            raise NoRoom(self.checkpoints)

    def _timed_out(self) -> None:
        """The watchdog: this save has not completed in ``timeout_s``; say so and end the process (every rank has a
        watchdog of its own, so every rank stops; the lock goes with the process)."""
        acc = self.accelerator
        where = f"[rank {acc.process_index}] " if acc.num_processes > 1 else ""
        print(f"\n{where}hfsdp: error: checkpoint for step {self.step} ({self.tmp}) was not complete after "
              f"{time.perf_counter() - self.started:.0f} s, more than train.save_timeout_s ({self.timeout_s:g} s): "
              f"the storage is too slow or hung, so the run stopped; {_kept(self.checkpoints, self.step)}. "
              "Raise train.save_timeout_s for slower storage", file=sys.stderr, flush=True)
        os._exit(1)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    def write_now(self) -> Path:
        """Synchronously: Accelerate's ``save_state`` on every rank, then :meth:`complete`."""
        self.begin(lambda: self.accelerator.save_state(str(self.tmp), safe_serialization=True))
        return self.complete()

    def written(self) -> bool:
        """Whether this rank's background writes have finished (or failed)."""
        return all(future.done() for future in self.background)

    def wait_here(self) -> None:
        """Wait for this rank's background writes, whatever they end with (an exit path: no collective)."""
        futures.wait(self.background)

    def complete(self) -> Path:
        def settle() -> None:
            for future in self.background:
                future.result()  # a background write's own error (DCP's CheckpointException, an OSError)
            fsync_tree(self.tmp)  # on every rank: its own files are on disk before the record can call them complete

        def finish() -> None:
            (self.tmp / "model").mkdir()
            self.model_files.save(self.tmp / "model")
            self.model_files.record(self.tmp / "model")  # so that `hfsdp export` needs no transformers
            (self.tmp / CONFIG_NAME).write_text(self.run_config_yaml)
            fsync_tree(self.tmp)  # every file and folder of the checkpoint, before the record
            write_atomic(self.tmp / RECORD, self.record_text)
            fsync_dir(self.tmp)
            if self.final.exists():  # a re-save of the same step: swapped in, the old copy deleted only afterwards
                replace_folder(self.tmp, self.final)
            else:
                os.replace(self.tmp, self.final)
                fsync_dir(self.checkpoints)

        self._phase("settle", settle)
        self._phase("finish", finish, main_only=True)
        self._stop_watchdog()
        self.write_s = time.perf_counter() - self.started
        return self.final

    def _phase(self, name: str, action: Callable[[], None], main_only: bool = False) -> None:
        from hfsdp.parallel.world import any_rank, gather_objects

        main = self.accelerator.is_main_process
        error = _attempt(action) if main or not main_only else None
        said = _describe(error, self) if error is not None else None  # before the failed write's files go
        if any_rank(self.accelerator, error is not None):  # also the barrier between the phases
            said = next((s for s in gather_objects(self.accelerator, said) if s), None)  # the first failed rank's
            self._stop_watchdog()
            if main:
                shutil.rmtree(self.tmp, ignore_errors=True)
            err = CheckpointError(f"checkpoint for step {self.step} could not be written: "
                                  f"{said or 'another rank failed to write its part'}; "
                                  f"{_kept(self.checkpoints, self.step)}" + (_ROOM if "no space left" in (said or "") else ""))
            err.__cause__ = error
            raise err


class Saver:
    """The run's checkpoints, one save at a time (:meth:`save`); each complete one goes to ``on_complete``.

    Synchronous: Accelerate's ``save_state`` while the training loop waits. ``train.async_save``: SHARDED
    checkpoints whose model and optimizer shards are staged into a host-memory copy (DCP's default stager: new
    storage, never a view of the live tensors) and written by DCP's ``async_save`` in a background thread, each of
    the two on a gloo group of its own (created here: collective), in the folders and format ``save_state`` writes
    (``pytorch_model_fsdp_0/``, ``optimizer_0/``), so that ``load_state`` and ``hfsdp export`` read them unchanged;
    the rest of ``save_state`` (LR scheduler, RNG, registered objects) is small and written before training
    continues. At most one save is in flight: the next :meth:`save` and :meth:`wait` complete it first. A checkpoint
    is complete, as a synchronous one, only once every rank's write has finished and been fsynced (:meth:`poll`,
    :meth:`wait`); a failed background write raises :class:`CheckpointError` there, on every rank."""

    def __init__(self, accelerator, model, optimizer, asynchronous: bool, timeout_s: int,
                 on_complete: Callable[[Pending], None], estimate: int = 0, lock: RunLock | None = None,
                 save_timeout_s: float | None = None):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.asynchronous, self.on_complete = asynchronous, on_complete
        self.estimate, self.lock, self.save_timeout_s = estimate, lock, save_timeout_s
        self.pending: Pending | None = None
        self.completed: list[Pending] = []  # in this process
        self.groups = []
        if asynchronous:
            from datetime import timedelta

            import torch.distributed as dist

            self.groups = [dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) for _ in range(2)]

    def save(self, pending: Pending) -> None:
        """Start ``pending`` (synchronous: write and complete it), once the save in flight is complete."""
        t0 = time.perf_counter()
        self.wait()
        pending.started = time.perf_counter()
        pending.estimate, pending.lock, pending.timeout_s = self.estimate, self.lock, self.save_timeout_s
        pending.previous = self.completed[-1] if self.completed else None
        if self.asynchronous:
            pending.begin(lambda: self._write_in_background(pending))
            self.pending = pending
            pending.stall_s = time.perf_counter() - t0
        else:
            pending.write_now()
            pending.stall_s = time.perf_counter() - t0
            self._completed(pending)

    def _write_in_background(self, pending: Pending) -> None:
        import torch.distributed.checkpoint as dcp
        from accelerate.checkpointing import save_accelerator_state, save_custom_state
        from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        acc, tmp = self.accelerator, pending.tmp
        each_node = acc.project_configuration.save_on_each_node
        # What save_state writes besides the model and optimizer (which go to DCP below), for the same objects.
        save_accelerator_state(str(tmp), [], [], acc._schedulers, acc._dataloaders, acc.process_index, acc.step,
                               acc.scaler, save_on_each_node=each_node, safe_serialization=True)
        for i, obj in enumerate(acc._custom_objects):
            save_custom_state(obj, str(tmp), i, save_on_each_node=each_node)
        model_state, optimizer_state = get_state_dict(self.model, getattr(self.optimizer, "optimizer", self.optimizer),
                                                      options=StateDictOptions(full_state_dict=False))
        for folder, key, state, group in ((f"{FSDP_MODEL_NAME}_0", "model", model_state, self.groups[0]),
                                          (f"{OPTIMIZER_NAME}_0", "optimizer", optimizer_state, self.groups[1])):
            # staged (copied into host memory) before it returns, then written by a thread of its own
            pending.background.append(dcp.async_save({key: state}, checkpoint_id=str(tmp / folder),
                                                     process_group=group))

    def poll(self, flags: list[bool] = ()) -> list[bool]:
        """Complete the save in flight if every rank's background write has finished; ``flags`` (this rank's),
        each true on every rank if it is on any, found in the same all-reduce (one collective a step). Collective:
        every rank calls it at the same point of every step."""
        from hfsdp.parallel.world import any_ranks

        unwritten, *flags = any_ranks(self.accelerator, [self.pending is not None and not self.pending.written(),
                                                         *flags])
        if self.pending is not None and not unwritten:
            self.wait()
        return flags

    def wait(self) -> Path | None:
        """Wait for the save in flight and complete it (collective); the newest complete checkpoint this process
        saved (None: none)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait_here()
            pending.complete()
            self._completed(pending)
        return self.completed[-1].final if self.completed else None

    def _completed(self, pending: Pending) -> None:
        self.completed.append(pending)
        self.on_complete(pending)

    def summary(self) -> dict[str, Any]:
        """How this process's saves went: their mode, count and median stall and write times (seconds)."""
        import statistics

        def median(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        return {"mode": "asynchronously" if self.asynchronous else "synchronously", "count": len(self.completed),
                "stall_s_median": median([p.stall_s for p in self.completed]),
                "write_s_median": median([p.write_s for p in self.completed])}

    def abandon(self) -> None:
        """An exit path (an error, perhaps another rank's): wait for this rank's background writes, without a
        collective, and leave their checkpoint incomplete (the next ``--resume`` removes it)."""
        if self.pending is not None:
            self.pending.wait_here()
            self.pending._stop_watchdog()
            self.pending = None


def _root_causes(error: BaseException) -> list[tuple[str, BaseException]]:
    """The errors behind ``error``: DCP's CheckpointException carries each failed rank's own exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        return [(f"rank {rank}: ", failure[0] if isinstance(failure, tuple) else failure)
                for rank, failure in sorted(error.failures.items())]
    return [("", error)]


_ROOM = ": free space there, or copy the run folder to a disk with room and `--resume` there"


def _describe(error: BaseException, pending: Pending) -> str:
    """What went wrong, in the words of the rank it went wrong on: a full disk as such (the file system, its free
    bytes and what the checkpoint needs), our own findings as they are, anything else as the writer's error."""
    if isinstance(error, UserError):
        return str(error)
    cause = "; ".join(f"{where}{type(e).__name__}: {e}" for where, e in _root_causes(error))
    written = space.folder_bytes(pending.tmp) if pending.tmp.is_dir() else 0
    full = space.disk_full(error, pending.checkpoints, pending.needed - written)
    if full is None:
        return cause
    need = (f"the checkpoint needs about {space.size_text(pending.needed)}" if pending.needed > written else
            f"the checkpoint needs more than the {space.size_text(written)} written before the disk filled")
    return (f"no space left on device: {full.text()}, and {need}"
            + ("" if isinstance(error, NoRoom) else f" ({cause})"))


def _kept(checkpoints: Path, step: int) -> str:
    previous = [path for found, path in complete_checkpoints(checkpoints) if found != step]
    return (f"the last complete checkpoint, {previous[-1]}, is intact and `--resume` continues from it"
            if previous else "no earlier complete checkpoint exists")


def prune(checkpoints: Path, keep_last: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``keep_last`` and any leftover temporary folders."""
    removed = remove_incomplete(checkpoints)
    if keep_last is not None:
        for _, path in complete_checkpoints(checkpoints)[:-keep_last]:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def remove_incomplete(checkpoints: Path) -> list[Path]:
    """Delete temporary folders of saves that never completed (a process killed mid-save leaves one).
    Call only while no save is in progress."""
    removed = []
    if checkpoints.is_dir():
        for path in [*checkpoints.glob(f".tmp-{PREFIX}*"), *checkpoints.glob(f".{PREFIX}*.old-*")]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
