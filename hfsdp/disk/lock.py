"""Locks on files, one mechanism (:func:`flock`, the kernel's: released when its file is closed or its process ends,
however it ends, kill -9 included, so no lock outlives its holder): one run per output folder (:class:`RunLock`,
held by the main process for the life of the run) and one process at a time building a cache entry
(:func:`one_at_a_time`: the built-in models, the preprocessing cache). A lock file stays where it is: deleting it
could let two processes lock two different files."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from hfsdp.disk import aside
from hfsdp.errors import UserError

LOCK_NAME = ".hfsdp-run.lock"  # in train.output_dir, held (flock) by rank 0 for the life of the run
# What flock fails with on a file system that has no locks (some network and FUSE file systems).
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class NoLocks(OSError):
    """The file system of a lock file has no locks."""


def flock(fd: int, *, shared: bool = False, wait: bool = False) -> None:
    """Lock the open file ``fd``, exclusive or ``shared`` (with other shared holders), waiting while another process
    holds it or not (``wait``); BlockingIOError when another process holds it and ``wait`` is False, :class:`NoLocks`
    where its file system has no locks."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except OSError as err:
        if err.errno in NO_LOCKS:
            raise NoLocks(err.errno, err.strerror) from None
        raise


@contextlib.contextmanager
def one_at_a_time(path: Path) -> Iterator[None]:
    """The lock file ``path`` (made, with its folder) held while the block runs, waiting while another process holds
    it: one process at a time, of this host or of any that shares the file system, runs the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            flock(fd, wait=True)
        except NoLocks as err:
            raise UserError(f"{path}: its file system does not support locks ({err.strerror}), which hfsdp's cache "
                            "needs so that one process builds each entry; set HFSDP_CACHE_DIR to a folder on a local "
                            "disk") from None
        yield
    finally:
        os.close(fd)


@dataclass
class RunLock:
    """``<output_dir>/.hfsdp-run.lock``, locked (``flock``) for the life of the run by one process: a second run into
    the folder is refused while the first lives. The kernel releases the lock when its process ends, however it
    ends (kill -9 included), so a killed run's lock is free again; the file says who holds it. A folder deleted or
    replaced under the run loses the file (:meth:`still_ours`). ``earlier``: the earlier run this run set aside
    (``--overwrite``, ``--resume``; :mod:`hfsdp.disk.aside`), put back when the lock is released before
    :meth:`first_step_done` (a kill -9 leaves it to the next process that takes the lock or reads the folder)."""

    path: Path
    fd: int
    inode: int
    earlier: aside.Earlier | None = None

    @classmethod
    def take(cls, output_dir: Path) -> "RunLock":
        path = Path(output_dir) / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flock(fd)
        except NoLocks as err:
            print(f"hfsdp: warning: {path}: the file system of train.output_dir does not support locks "
                  f"({err.strerror}), so a second run into the folder is not refused", file=sys.stderr)
            return cls(path, fd, os.fstat(fd).st_ino)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if not isinstance(err, BlockingIOError):
                raise
            raise UserError(f"train.output_dir {output_dir} is in use by another run ({holder}), which holds "
                            f"{path}; nothing of it was changed. Wait for that run to end (or stop it), or set "
                            "another train.output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}).encode())
        os.fsync(fd)
        return cls(path, fd, os.fstat(fd).st_ino)

    @classmethod
    def borrow(cls, checkpoint: Path) -> "RunLock | None":
        """A shared hold on the run folder that holds ``checkpoint`` (``<run>/checkpoints/step-N``), for a run that
        resumes from another run's checkpoint, until it has loaded it: refused while a live run holds that folder
        (it may prune or replace the checkpoint meanwhile, ``train.keep_last``), and a run started into that folder
        meanwhile is refused until :meth:`release`. None where the folder has no lock file (no hfsdp run wrote it)
        or its file system has no locks."""
        checkpoint = Path(checkpoint)
        path = checkpoint.parent.parent / LOCK_NAME
        if checkpoint.parent.name != "checkpoints" or not path.is_file():
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            flock(fd, shared=True)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if isinstance(err, NoLocks):
                return None
            if not isinstance(err, BlockingIOError):
                raise
            raise UserError(f"--resume {checkpoint}: that checkpoint is in the folder of a run that is still training "
                            f"({holder}, which holds {path}); it may prune or replace the checkpoint while this run "
                            "loads it (train.keep_last). Wait for that run to end, or copy the checkpoint folder "
                            "elsewhere and resume from the copy") from None
        return cls(path, fd, os.fstat(fd).st_ino)

    def still_ours(self) -> bool:
        """The lock file this run holds is still at its path (the folder was neither deleted nor replaced)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def first_step_done(self) -> None:
        """The run did its first step: the earlier run it set aside is not needed any more."""
        if self.earlier is not None:
            self.earlier.drop()

    def release(self) -> None:
        if self.earlier is not None and (said := self.earlier.put_back()):
            print(f"hfsdp: {said}", file=sys.stderr, flush=True)
        if self.fd >= 0:
            os.close(self.fd)  # the file stays: deleting it could let two runs lock two different files
            self.fd = -1


def put_back_abandoned(run_dir: Path) -> None:
    """The earlier run of ``run_dir`` back in place where a run killed before its first step (kill -9) left it set
    aside (:func:`hfsdp.disk.aside.finish_abandoned`), said on stderr; nothing while a live run holds the folder
    (a run starting there: its earlier run is its own to put back or drop). For every command that trains into a
    run folder or reads one."""
    run_dir = Path(run_dir)
    if not aside.left_behind(run_dir):
        return
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    try:
        if said := aside.finish_abandoned(run_dir):
            print(f"hfsdp: {said}", file=sys.stderr, flush=True)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        info: dict[str, Any] = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "its process is starting"
    return f"pid {info['pid']} on host {info.get('host', '?')}, started {info.get('started', '?')}"
