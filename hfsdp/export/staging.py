"""Output folders written so that nothing hfsdp did not write is ever removed, and nothing half-written is left.

An export (``hfsdp export CHECKPOINT OUT``, a LoRA adapter, ``train.output_dir/final``) is written into a fresh
temporary folder next to OUT, completed with a record listing every file it wrote (``hfsdp_export.json``), synced
to disk, and only then renamed to OUT. A failure at any point removes the temporary folder and leaves OUT as it was.
OUT may be new or empty; an OUT that holds anything else is refused, except an earlier hfsdp export whose files
are all its own, which ``--overwrite`` replaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Iterator

from hfsdp import __version__
from hfsdp.disk.space import OutOfSpace, disk_full, folder_bytes, size_text
from hfsdp.disk.durable import EXPORT_RECORD, RECORD, fsync_dir, fsync_tree, replace_folder, write_atomic
from hfsdp.errors import UserError


def _entries(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def _holds_a_run(folder: Path) -> str | None:
    """The run folder or checkpoint that ``folder`` is or holds (itself or one level down), if any."""
    markers = ("checkpoints", "metrics.jsonl", RECORD)  # a training run (train.output_dir), a checkpoint
    for candidate in (folder, *sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())):
        if any((candidate / marker).exists() for marker in markers):
            return str(candidate)
    return None


# Files of an export a user may edit (the model card): recorded with their digest, so that an export replacing the
# folder refuses to lose edits made since
EDITABLE = ("README.md",)


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def editable_digests(folder: Path) -> dict[str, str]:
    return {name: file_sha256(folder / name) for name in EDITABLE if (folder / name).is_file()}


def add_to_record(folder: Path, names: list[str]) -> None:
    """Files hfsdp wrote into the export ``folder`` after it was complete (``hfsdp eval``'s results, the model card it
    filled in) added to its record, with the editable files' new digests, so that ``--overwrite`` may replace them.
    A folder without a record (not an hfsdp export) is left as it is."""
    record = folder / EXPORT_RECORD
    if not record.is_file():
        return
    data = json.loads(record.read_text())
    data["files"] = sorted(set(data.get("files", [])) | set(names))
    data["sha256"] = editable_digests(folder)
    write_atomic(record, json.dumps(data, indent=2))


def check_export_target(out_dir: Path, *, overwrite: bool, source: Path | None = None) -> None:
    """Refuse an export folder whose replacement could remove anything hfsdp did not write there.

    ``source`` is the checkpoint being exported: OUT may neither contain it nor lie inside it.
    """
    out = out_dir.resolve()
    if source is not None:
        src = source.resolve()
        if out == src or out in src.parents:
            raise UserError(f"export: OUT {out_dir} contains the checkpoint being exported ({source}); export never "
                            "writes over its source: choose a new or empty folder")
        if src in out.parents:
            raise UserError(f"export: OUT {out_dir} is inside the checkpoint {source}; choose a folder outside it")
    if not out.exists():
        if out_dir.is_symlink():
            raise UserError(f"export: OUT {out_dir} is a dangling symbolic link; remove it or choose another folder")
        return
    if not out.is_dir():
        raise UserError(f"export: OUT {out_dir} exists and is not a folder; choose a new or empty folder")
    entries = _entries(out)
    if not entries:
        return
    run = _holds_a_run(out)
    if run is not None:
        what = "is a training run or checkpoint folder" if run == str(out) else f"holds a training run ({run})"
        raise UserError(f"export: OUT {out_dir} {what}; export would replace it: choose a new or empty folder")
    record = out / EXPORT_RECORD
    if not record.is_file():
        raise UserError(f"export: OUT {out_dir} exists, is not empty and is not an earlier hfsdp export; export never "
                        "removes what it did not write: choose a new or empty folder")
    if not overwrite:
        raise UserError(f"export: OUT {out_dir} holds an earlier hfsdp export; pass --overwrite to replace it, "
                        "or choose another folder")
    try:
        data = json.loads(record.read_text())
        written, digests = set(data["files"]), dict(data.get("sha256") or {})
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise UserError(f"export: {record} is unreadable ({type(err).__name__}); remove the folder yourself "
                        "or choose another one") from None
    edited = sorted(name for name, digest in digests.items()
                    if (out / name).is_file() and file_sha256(out / name) != digest)
    if edited:
        raise UserError(f"export: {', '.join(edited)} in OUT {out_dir} changed since hfsdp wrote it (your edits "
                        "would be lost): move it out of the folder first, or choose another folder")
    foreign = sorted(entries - written - {EXPORT_RECORD})
    if foreign:
        raise UserError(f"export: OUT {out_dir} holds {len(foreign)} file(s) the earlier export did not write "
                        f"({', '.join(foreign[:5])}); move them elsewhere or choose another folder")


@contextlib.contextmanager
def staged_export(out_dir: Path, *, overwrite: bool, source: Path | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder inside OUT's parent to write the export into; on success record its files,
    sync them and rename it to ``out_dir``. Any failure (also KeyboardInterrupt) removes the temporary folder."""
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite=overwrite, source=source)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in _left_by_dead_exports(out_dir):
        shutil.rmtree(stale, ignore_errors=True)
        print(f"removed {stale}, the temporary folder of an export into {out_dir} that was stopped midway")
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        files = sorted(_entries(tmp))
        (tmp / EXPORT_RECORD).write_text(json.dumps(
            {"written_by": f"hfsdp {__version__}", "source": str(source or "training"), "files": files,
             "sha256": editable_digests(tmp)}, indent=2))
        fsync_tree(tmp)
        check_export_target(out_dir, overwrite=overwrite, source=source)  # nothing foreign appeared meanwhile
        _move_into_place(tmp, out_dir)
    except BaseException as err:
        full = disk_full(err, tmp) if isinstance(err, Exception) and tmp.is_dir() else None
        written = folder_bytes(tmp) if full else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if full is None:
            raise
        kept = f"{out_dir} and {source} are" if source is not None else f"{out_dir} and the run's checkpoints are"
        raise OutOfSpace(f"export: no space left on device: {full.text()}, and the export needs more than "
                                 f"the {size_text(written)} written before the disk filled "
                                 f"({type(err).__name__}: {err}); nothing was changed: {kept} as they were. Free "
                                 "space there or export to a folder with more room") from err


def _left_by_dead_exports(out_dir: Path) -> list[Path]:
    """The temporary folders (``.OUT.tmp-HOST-PID-*``) of exports into ``out_dir`` whose process, on this host, is
    gone (a kill -9, a lost session): never renamed into place, never to be. Another host's, or a live process's
    (an export running beside this one), are left alone."""
    prefix = f".{out_dir.name}.tmp-{socket.gethostname()}-"
    dead = []
    for folder in out_dir.parent.glob(f"{prefix}*"):
        pid = folder.name[len(prefix):].rsplit("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            dead.append(folder)
    return sorted(dead)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_unfinished(out_dir: Path) -> list[Path]:
    """Remove what exports into ``out_dir`` that were stopped midway left beside it (a temporary folder
    ``.OUT.tmp-*``, an old copy renamed aside ``.OUT.old-*``); returns them. Only for a folder no other process can be
    exporting into: ``final/`` of a run whose lock this process holds."""
    out_dir = Path(out_dir)
    stale = sorted([*out_dir.parent.glob(f".{out_dir.name}.tmp-*"), *out_dir.parent.glob(f".{out_dir.name}.old-*")])
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):  # an earlier export, checked to hold only its own files
        replace_folder(tmp, out_dir)
    else:
        os.replace(tmp, out_dir)  # new, or an empty folder (rename replaces an empty directory)
        fsync_dir(out_dir.parent)
