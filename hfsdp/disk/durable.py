"""Writes that survive a crash: files and folders synced to disk, a file or a folder replaced atomically, and the
record files that mark a folder complete (written last: a folder without its record is never trusted).
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

RECORD = "hfsdp_checkpoint.json"  # a complete checkpoint (hfsdp.checkpoint.store)
EXPORT_RECORD = "hfsdp_export.json"  # a complete export, listing the files it wrote (hfsdp.export.staging)


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or its old content, never part of it: written beside it, synced, renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_folder(new: Path, old: Path) -> None:
    """Put the complete folder ``new`` where the complete folder ``old`` is, then delete the old copy. Where the
    kernel and file system can swap two names atomically (Linux ``renameat2(RENAME_EXCHANGE)``: ext4, xfs, btrfs,
    tmpfs...), ``old``'s path names a complete folder at every moment; elsewhere the old copy is renamed aside first,
    leaving one rename's time in which only the two hidden copies exist."""
    if not _exchange(new, old):
        aside = old.parent / f".{old.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(old, aside)
        os.replace(new, old)
        new = aside
    fsync_dir(old.parent)
    shutil.rmtree(new)  # now the old copy
    fsync_dir(old.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b``; False where that is not supported."""
    import ctypes
    import errno

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and every folder's entries to disk (files first, the top folder last)."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))
