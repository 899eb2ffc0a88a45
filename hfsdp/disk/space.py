"""Free space, told as what it is: the free space of a folder's file system (:func:`space_of`) against what a
checkpoint and an export need (:func:`estimate`, :func:`check_space`), and a failed write recognised as a full disk
(:func:`disk_full`) even where torch's own writer hides the errno (its zip writer says ``unexpected pos N vs M``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from hfsdp.errors import UserError
from hfsdp.units import GIB, KIB, MIB

# A file system with less than this free after a write failed is full: the writer stopped because nothing was left.
FULL_BELOW = 1 * MIB


class OutOfSpace(UserError):
    """A write that a full disk stopped; what it would have replaced is intact."""

    exit_code = 1


def size_text(nbytes: int) -> str:
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if nbytes >= unit:
            return f"{nbytes / unit:.1f} {name}"
    return f"{nbytes} bytes"


@dataclass(frozen=True)
class Space:
    filesystem: str  # e.g. "tmpfs at /mnt/scratch"
    free: int  # bytes this process may still write

    def text(self) -> str:
        return f"{self.filesystem} has {size_text(self.free)} ({self.free} bytes) free"


def _mount_of(path: Path) -> str:
    """The file system holding ``path``, as "<type> at <mount point>" (from /proc/self/mounts; the mount point alone
    where that cannot be read)."""
    real = os.path.realpath(path)
    best, kind = "/", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return f"{kind} at {best}" if kind else best


def space_of(path: Path) -> Space:
    """Free space of the file system that holds ``path`` (or would: its nearest existing folder). Root may write into
    the blocks reserved for it (ext4), so its free space counts them."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    st = os.statvfs(existing)
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return Space(_mount_of(existing), blocks * st.f_frsize)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())


def _errors_in(error: BaseException) -> list[BaseException]:
    """``error`` and every error behind it: its causes and contexts, and the per-rank failures DCP gathers."""
    from torch.distributed.checkpoint.api import CheckpointException

    found, todo = [], [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in found):
            continue
        found.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    return found


def disk_full(error: BaseException, path: Path, still_needed: int = 0) -> Space | None:
    """The space left where ``path`` is, if ``error`` (a failed write there) was a full disk: an ENOSPC (or EDQUOT:
    a quota) anywhere behind it, or, now that it failed, less free than the write still needed (``still_needed``
    bytes, where known) or almost nothing (torch's zip writer reports a short write as ``unexpected pos``, without
    the errno; on a disk shared with other jobs a few MiB may be free again by then). Call it before the failed
    write's files are removed."""
    space = space_of(path)
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _errors_in(error)):
        return space
    return space if space.free < max(FULL_BELOW, still_needed) else None


def estimate(model) -> tuple[int, int]:
    """Bytes of one checkpoint and of the exported model of this run, from ``model`` built on the meta device as
    training changes it (:func:`hfsdp.model.loading.build_meta_model`): a checkpoint holds the model's state dict
    (tied weights under each of their names, as DCP writes them) and, for every trainable parameter, AdamW's two
    moments of its size; an export, every parameter once. A lower bound (the tokenizer, config and small state files
    come on top), so that a refusal built on it is never wrong."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = list(model.parameters())  # tied parameters once
    moments = 2 * sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return state + moments, sum(p.numel() * p.element_size() for p in params)


def check_space(output_dir: Path, checkpoint_bytes: int, export_bytes: int, config) -> str | None:
    """Refuse a run whose ``train.output_dir`` cannot hold even one checkpoint (or its export); the warning (one line,
    or None) when the checkpoints kept at once (``train.keep_last`` + the one being written) and the export cannot."""
    train = config.train
    space = space_of(output_dir)
    first = checkpoint_bytes if train.save_every else 0
    needed_now = max(first, export_bytes if train.export_final else 0)
    if needed_now and space.free < needed_now:
        what = "one checkpoint" if first >= needed_now else "the final export"
        raise UserError(f"no space left on device for this run: {space.text()} and {what} of this model needs about "
                        f"{size_text(needed_now)} ({needed_now} bytes); free space there or set train.output_dir to a "
                        "folder with more room")
    if not train.save_every:
        return None
    kept = train.keep_last if train.keep_last is not None else (train.max_steps or 0) // train.save_every
    at_once = (kept + 1) * checkpoint_bytes + (export_bytes if train.export_final else 0)
    if kept and space.free < at_once:
        return (f"warning: {space.text()}, less than the about {size_text(at_once)} this run holds at once "
                f"({kept + 1} checkpoints: train.keep_last {train.keep_last} + the one being written"
                + (", and the final export" if train.export_final else "") + "); it stops at the save that does not "
                "fit, the last complete checkpoint kept")
    return None
