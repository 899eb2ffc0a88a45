"""The data files a config names: which reader takes a path (a plugin's prefix or suffix, or a built-in suffix),
glob patterns and shard folders, and the problems of each path, found before any weight loads."""

from __future__ import annotations

import glob
import os
import typing
from pathlib import Path

from hfsdp.config.schema import DataConfig


# Suffixes of the data files hfsdp reads (data.py maps each to its datasets loader).
DATA_SUFFIXES = (".txt", ".text", ".json", ".jsonl", ".csv", ".parquet")


def data_reader_key(path: str, readers: typing.Iterable[str]) -> str | None:
    """The key of the plugin reader for ``path``: a source prefix (``"mydb://"``) it starts with, or a file suffix
    (``".tsv"``) it ends with (case-insensitive); None when no plugin reader claims it."""
    keys = list(readers)
    for key in keys:
        if key.endswith("://") and path.startswith(key):
            return key
    suffix = Path(path).suffix.lower()
    return next((key for key in keys if not key.endswith("://") and key.lower() == suffix), None)


def is_glob(path: str) -> bool:
    """A path with glob characters that names no file or folder itself (a file may have ``[`` in its name)."""
    return any(c in path for c in "*?[") and not Path(path).expanduser().exists()


def shard_files(path: str) -> list[Path]:
    """The data files a local source is made of: the file itself, the files a glob matches (sorted), or a folder's
    data files (a folder saved by datasets holds none: it is read as a whole)."""
    local = Path(path).expanduser()
    if is_glob(path):
        return sorted(Path(p) for p in glob.glob(str(local), recursive=True) if Path(p).is_file())
    if local.is_dir():
        return sorted(p for p in local.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                      and not any(part.startswith(".") for part in p.relative_to(local).parts))
    return [local]


def empty_file(path: Path) -> bool:
    """A data file without a single non-blank character in its first 4 KiB: no rows (an empty shard)."""
    with open(path, "rb") as f:
        return not f.read(4096).strip()


def _source_path_problems(where: str, value: str, readers: list[str]) -> list[tuple[str, str]]:
    claimed = data_reader_key(value, readers)
    if claimed is not None and claimed.endswith("://"):
        return []
    local = Path(value).expanduser()
    if is_glob(value):
        files = shard_files(value)
        if not files:
            return [(where, f"{value} matches no file ({RELATIVE_DATA_PATHS})")]
        kinds = sorted({f.suffix.lower() for f in files})
        if len(kinds) > 1:
            return [(where, f"{value} matches files of {len(kinds)} kinds ({', '.join(kinds)}): a source's shards "
                            "are one kind; narrow the glob or give each kind its own source")]
        if kinds[0] not in DATA_SUFFIXES:
            return [(where, f"{value}: hfsdp reads {', '.join(DATA_SUFFIXES)} shards, not '{kinds[0]}'")]
    elif local.is_file():
        if claimed is None and local.suffix.lower() not in DATA_SUFFIXES:
            plugin_kinds = [k for k in readers if not k.endswith("://")]
            return [(where, f"{local}: hfsdp reads {', '.join(DATA_SUFFIXES)} files"
                            + (f" (and enabled plugins {', '.join(plugin_kinds)})" if plugin_kinds else "")
                            + f", not '{local.suffix or local.name}': convert it, or enable a plugin "
                              "that reads it (hook hfsdp_data_readers)")]
        files = [local]
    elif local.is_dir():
        if not os.access(local, os.R_OK | os.X_OK):
            return [(where, f"cannot read the folder {local}: permission denied")]
        files = shard_files(value)
    elif value.startswith((".", "/", "~")) or local.suffix.lower() in DATA_SUFFIXES or claimed is not None:
        return [(where, f"{local.resolve()} does not exist ({RELATIVE_DATA_PATHS})")]
    else:
        return []  # a datasets name, loaded (and checked) with the data
    problems = []
    for f in files:
        if not os.access(f, os.R_OK):
            problems.append((where, f"cannot read {f}: permission denied"))
        elif len(files) > 1 and empty_file(f):
            problems.append((where, f"the shard {f} is empty (no rows): remove it, or fill it"))
    return problems


def data_path_problems(data: DataConfig, readers: typing.Iterable[str]) -> list[tuple[str, str]]:
    """Every training source's path and ``data.eval_path``: exists, is readable, and hfsdp or an enabled plugin reads
    its kind; a glob or folder of shards: matches files of one kind, none of them empty. A plugin's own source
    (``prefix://``) is the plugin's to check; a name that is no local path is a datasets name, loaded (and checked)
    with the data."""
    readers = list(readers)
    paths = [("data.path", data.path)] if data.datasets is None else \
        [(f"data.datasets[{i}].path", s.path) for i, s in enumerate(data.datasets)]
    problems = []
    for where, value in paths + [("data.eval_path", data.eval_path)]:
        if value:
            problems += _source_path_problems(where, value, readers)
    return problems


# The one rule for relative data paths, named wherever a missing path is reported.
RELATIVE_DATA_PATHS = ("a relative path in a config file is taken from the config file's folder; one given with "
                       "--set, from the working directory")
