"""An earlier run kept whole until the run that replaces it is sure: what ``--overwrite`` would remove and what
``--resume`` rewrites before its first step are set aside inside the run folder (:func:`set_aside`), put back if
the new run stops before its first step (:meth:`Earlier.put_back`), and removed only once that step is done
(:meth:`Earlier.drop`).

Set aside means renamed into ``<run>/.hfsdp-earlier-run/`` (same file system: no copy) or, for a file a resume
rewrites in place (``metrics.jsonl``, ``config.yaml``), copied there; a list of what is there
(``earlier-run.json``) is written before the folder takes its name, so the folder is complete or absent. The run
lock (:class:`hfsdp.disk.lock.RunLock`) holds it: a run killed before its first step (kill -9) leaves the folder
and frees the lock, and the next process that trains into the run folder or reads it
(:func:`hfsdp.disk.lock.put_back_abandoned`) puts the earlier run back. Every step is a rename or the removal of a copy, so a
put-back or a drop stopped midway is finished by the next one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from hfsdp.disk.durable import fsync_dir, fsync_tree
from hfsdp.errors import UserError

ASIDE = ".hfsdp-earlier-run"  # in the run folder, while a new run has not done its first step
# in ASIDE: {"moved": [names], "copied": [names], "outputs": [patterns], "present": [the earlier run's outputs],
# "pid": N}
LIST = "earlier-run.json"
_DROPPED = ASIDE + ".dropped"  # ASIDE renamed once its files are not needed any more, then removed
_NEW = "new-"  # in ASIDE: a new run's entry renamed there while the earlier one is put back


@dataclass
class Earlier:
    """The earlier run of ``folder``, set aside by this process until the new run's first step."""

    folder: Path
    pending: bool = True

    def drop(self) -> None:
        """The new run did its first step: the earlier run's files set aside go (a renamed folder, then removed)."""
        if self.pending:
            self.pending = False
            _drop(self.folder)

    def put_back(self) -> str | None:
        """The new run stopped before its first step: the earlier run as it was, what the new run wrote of the
        run's outputs removed; what to say (None once dropped or put back)."""
        if not self.pending:
            return None
        self.pending = False
        _put_back(self.folder)
        return (f"{self.folder}: the earlier run is back as it was (this run stopped before its first step, so "
                "nothing of it was removed)")


def set_aside(folder: Path, move: list[str], copy: list[str], outputs: list[str]) -> Earlier | None:
    """Set the entries ``move`` of the run folder ``folder`` aside (renamed) and copies of ``copy`` (kept in place,
    which the new run rewrites); ``outputs``: the name patterns of everything a run writes there (a put-back removes
    those the earlier run did not have). For a process that holds the folder's run lock. None when there is nothing to set
    aside."""
    move = [name for name in move if (folder / name).exists() or (folder / name).is_symlink()]
    copy = [name for name in copy if (folder / name).exists() and name not in move]
    if not move and not copy:
        return None
    aside, building = folder / ASIDE, folder / f"{ASIDE}.tmp"
    for stale in (building, folder / _DROPPED):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        building.mkdir()
        for name in copy:
            source = folder / name
            shutil.copytree(source, building / name, symlinks=True) if source.is_dir() and not source.is_symlink() \
                else shutil.copy2(source, building / name, follow_symlinks=False)
        present = sorted(e.name for e in folder.iterdir() if any(fnmatch(e.name, p) for p in outputs))
        (building / LIST).write_text(json.dumps({"moved": move, "copied": copy, "outputs": outputs,
                                                 "present": present, "pid": os.getpid()}))
        fsync_tree(building)
    except BaseException as err:
        shutil.rmtree(building, ignore_errors=True)
        if isinstance(err, OSError):
            raise UserError(f"{folder}: cannot copy the earlier run's {', '.join(copy)} aside until this run's "
                            f"first step ({err.strerror or err}); nothing of it was changed. Free space there, or "
                            "set another train.output_dir") from None
        raise
    os.rename(building, aside)  # complete, or absent
    earlier = Earlier(folder)
    try:
        for name in move:
            os.rename(folder / name, aside / name)
        fsync_dir(aside)
        fsync_dir(folder)
    except BaseException:
        earlier.put_back()
        raise
    return earlier


def _put_back(folder: Path) -> None:
    aside = folder / ASIDE
    listed = json.loads((aside / LIST).read_text())
    for name in [*listed["moved"], *listed["copied"]]:
        if not (aside / name).exists() and not (aside / name).is_symlink():
            continue  # put back already (a put-back stopped midway), or never moved
        _set_new_aside(folder, name)
        os.rename(aside / name, folder / name)
    for entry in sorted(folder.iterdir()):
        if entry.name not in listed["present"] and any(fnmatch(entry.name, p) for p in listed["outputs"]):
            _set_new_aside(folder, entry.name)  # the new run's own
    fsync_dir(folder)
    _drop(folder)


def _set_new_aside(folder: Path, name: str) -> None:
    """The new run's ``name`` out of the way (into ASIDE, removed with it)."""
    if (folder / name).exists() or (folder / name).is_symlink():
        target = folder / ASIDE / f"{_NEW}{name}"
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(folder / name, target)


def _drop(folder: Path) -> None:
    if (folder / ASIDE).exists():
        os.rename(folder / ASIDE, folder / _DROPPED)
        fsync_dir(folder)
    shutil.rmtree(folder / _DROPPED, ignore_errors=True)


def left_behind(folder: Path) -> bool:
    """``folder`` holds what a process stopped midway left here (an earlier run set aside, a drop unfinished)."""
    return any((folder / name).exists() for name in (ASIDE, _DROPPED, f"{ASIDE}.tmp"))


def finish_abandoned(folder: Path) -> str | None:
    """Finish what a process killed while it held the run lock of ``folder`` left: its earlier run set aside and
    never dropped is put back (the killed run never did its first step), a drop stopped midway is finished. For a
    process that holds the lock or found it free (:func:`hfsdp.disk.lock.put_back_abandoned`); what to say."""
    shutil.rmtree(folder / f"{ASIDE}.tmp", ignore_errors=True)  # copies only: the earlier run was not touched
    if not (folder / ASIDE).is_dir():
        _drop(folder)
        return None
    pid = json.loads((folder / ASIDE / LIST).read_text()).get("pid", "?")
    _put_back(folder)
    return (f"{folder}: put back the earlier run that a run killed before its first step (pid {pid}) had set "
            "aside; it is as it was")
