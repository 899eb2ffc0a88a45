"""The preprocessing cache: a tokenized dataset is built once per node (the first process builds the entry under a
file lock, :func:`hfsdp.disk.lock.one_at_a_time`; the others poll for it instead of waiting in a collective that
could time out) and an entry is complete or absent (written into a temporary folder, fsynced, renamed into place,
its record last).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hfsdp.data.images import processor_of
from hfsdp.disk.lock import one_at_a_time
from hfsdp.disk.space import OutOfSpace, disk_full, folder_bytes, size_text
from hfsdp.config.schema import DataConfig
from hfsdp.errors import UserError


def cache_key(raw_fingerprints: list[str], tokenizer, cfg: DataConfig, format_owner: str, extra: str = "") -> str:
    """Key of the preprocessing cache: raw data fingerprint + tokenizer + the data config + format plugin."""
    vocab = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else str(tokenizer.get_vocab())
    template = getattr(tokenizer, "chat_template", None) or ""
    # a vision-language model's image processor decides how many tokens each image expands to
    processor = processor_of(tokenizer)
    images = processor.image_processor.to_json_string() if processor is not None else ""
    payload = json.dumps(
        [raw_fingerprints, hashlib.sha256(vocab.encode()).hexdigest(), template, cfg.model_dump(mode="json"),
         format_owner, extra] + ([images] if images else []),
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


# The file that completes a preprocessing cache entry: written last, inside the folder renamed into place, so that
# an entry is whole or absent (a killed preprocessing leaves only a temporary folder no run reads).
CACHE_META = "hfsdp_data.json"


# Seconds between two looks of a process waiting for its node's preprocessing (a file check, no collective).
POLL_S = 0.5


@dataclass(frozen=True)
class Preprocessing:
    """Who preprocesses: ``builder`` processes tokenize (the first of each node), the others wait for the cache
    entry they build, polling the cache folder, so no collective can time out however long it takes. ``run``
    names this run's failure marker (the same on every rank), so that a builder's error stops the waiters too."""

    builder: bool = True
    run: str = "local"


def _fsync(paths) -> None:
    import os

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _load_entry(target: Path):
    import datasets

    with quiet_datasets():
        return datasets.load_from_disk(str(target)), json.loads((target / CACHE_META).read_text())


def _build_entry(target: Path, build: Callable[[], tuple[Any, dict]], marker: Path):
    """Build into a temporary folder next to ``target``, fsync it and rename it into place."""
    import tempfile

    try:
        result, meta = build()
    except Exception as err:
        marker.write_text(json.dumps({"user_error": isinstance(err, UserError), "message": str(err)}))
        raise
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        with quiet_datasets():
            result.save_to_disk(str(tmp / "data"))
        (tmp / "data" / CACHE_META).write_text(json.dumps(meta))
        _fsync([*(tmp / "data").rglob("*"), tmp / "data"])  # on disk before it is renamed into place
        shutil.rmtree(target, ignore_errors=True)
        (tmp / "data").rename(target)
        _fsync([target.parent])
    except Exception as err:
        full = disk_full(err, tmp)  # before the partial entry is removed
        written = folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)  # room for the marker
        out = err if full is None else OutOfSpace(
            f"preprocessing cache: no space left on device: {full.text()}, and the tokenized data needs more than "
            f"the {size_text(written)} written before the disk filled ({type(err).__name__}: {err}); "
            "nothing was cached. Free space there or set HFSDP_CACHE_DIR to a folder with more room")
        with contextlib.suppress(OSError):  # the waiters stop too
            marker.write_text(json.dumps({"user_error": full is not None, "message": str(out)}))
        if full is None:
            raise
        raise out from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_entry(target)


def load_or_build(cache_dir: Path | None, key: str, build: Callable[[], tuple[Any, dict]],
                  who: Preprocessing = Preprocessing()):
    """The cached (DatasetDict, meta) for ``key``, or built and stored atomically by the builders (one at a time
    per cache folder, under a file lock), while the other processes poll for the complete entry; returns
    (dataset, meta, hit)."""
    if cache_dir is None:
        return *build(), False
    target = cache_dir / "datasets" / key
    target.parent.mkdir(parents=True, exist_ok=True)
    marker = target.with_name(f"{key}.failed-{who.run}")
    if not who.builder:
        while True:
            if (target / CACHE_META).is_file():
                try:
                    return *_load_entry(target), True
                except Exception:  # being replaced by a builder: look again
                    pass
            if marker.is_file():
                failure = json.loads(marker.read_text())
                if failure["user_error"]:
                    raise UserError(failure["message"])
                raise RuntimeError(f"the preprocessing of this node failed in its first process: {failure['message']}")
            time.sleep(POLL_S)
    with one_at_a_time(target.with_name(f"{key}.lock")):
        for stale in target.parent.glob(f"{key}.tmp-*"):  # a builder killed midway (only a lock holder makes them)
            shutil.rmtree(stale, ignore_errors=True)
        if (target / CACHE_META).is_file():
            try:
                return *_load_entry(target), True
            except Exception:  # a damaged cache entry is rebuilt, not fatal
                shutil.rmtree(target, ignore_errors=True)
        return *_build_entry(target, build, marker), False


@contextlib.contextmanager
def quiet_datasets() -> Any:
    """No progress bars from ``datasets``' own bookkeeping (reading files: "Generating train split"; the
    preprocessing cache: "Saving the dataset", "Loading dataset from disk"): the console shows one bar per phase,
    hfsdp's (tokenizing, packing, training). Bars the caller turned off stay off. Nor its log lines: a file it cannot
    read is logged by its reader ("Failed to load JSON from file ...") before the error hfsdp reports in its own
    words (``hfsdp.data.broken_rows``)."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if was_on:
            datasets.enable_progress_bars()
