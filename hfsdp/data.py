"""Datasets: load raw rows, tokenize them with the configured format plugin, cache the result, batch it.

Batching is a pure function of (seed, step): the global batch of optimizer step ``s`` is a fixed slice of a stream of
seeded per-epoch permutations, and each rank takes its share. Resuming at step ``s`` therefore neither replays nor
skips a sample, and a run on N ranks sees exactly the global batches of a single-process run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import shutil
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX
from hfsdp.config import (DATA_SUFFIXES, RELATIVE_DATA_PATHS, DataConfig, HfsdpConfig, TrainConfig,
                          data_reader_key, empty_file, is_glob, shard_files)
from hfsdp.errors import PluginError, RowError, UserError

if TYPE_CHECKING:
    from hfsdp.plugins import PluginHost

_LOADERS = dict(zip(DATA_SUFFIXES, ("text", "text", "json", "json", "csv", "parquet")))
# A plugin's data reader: file suffix or source prefix -> (plugin, read(path, split, data_config)).
Readers = Mapping[str, tuple[str, Callable[..., Any]]]


@contextlib.contextmanager
def quiet_datasets() -> Any:
    """No progress bars from ``datasets``' own bookkeeping (reading files: "Generating train split"; the
    preprocessing cache: "Saving the dataset", "Loading dataset from disk"): the console shows one bar per phase,
    hfsdp's (tokenizing, packing, training). Bars the caller turned off stay off."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _read_with_plugin(path: str, cfg: DataConfig, split: str, plugin: str, read: Callable[..., Any]):
    """Rows from a plugin's reader (list of dicts, dict of columns, or a Dataset) as a ``datasets.Dataset``."""
    import datasets

    try:
        rows = read(path, split, cfg)
    except UserError:
        raise
    except Exception as err:
        raise PluginError(plugin, "hfsdp_data_readers", err) from err
    if isinstance(rows, datasets.Dataset):
        return rows
    if isinstance(rows, dict):
        return datasets.Dataset.from_dict(rows)
    if isinstance(rows, list) and all(isinstance(row, dict) for row in rows):
        return datasets.Dataset.from_list(rows)
    raise PluginError(plugin, "hfsdp_data_readers", TypeError(
        f"the reader for {path} returned {type(rows).__name__}; return a list of dicts, a dict of column lists, "
        "or a datasets.Dataset"))


def default_num_proc() -> int:
    """``data.num_proc``'s default: the cores this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _non_empty(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb"):  # surfaces an unreadable file as a PermissionError, below
            pass
        if empty_file(f):
            raise UserError(f"data: {f} is empty (no rows to train on)" if len(files) == 1 else
                            f"data: the shard {f} is empty (no rows): remove it, or fill it")


@quiet_datasets()
def _load_split(path: str, cfg: DataConfig, split: str, readers: Readers, num_proc: int | None = None):
    """One split of a source; a glob or folder of shards is read ``num_proc`` shards at a time."""
    import datasets

    key = data_reader_key(path, readers)
    if key is not None:
        return _read_with_plugin(path, cfg, split, *readers[key])
    local = Path(path).expanduser()
    try:
        if is_glob(path) or local.is_file():
            files = shard_files(path)
            if not files:
                raise UserError(f"data: {path} matches no file ({RELATIVE_DATA_PATHS})")
            loaders = {_LOADERS.get(f.suffix.lower()) for f in files}
            if None in loaders or len(loaders) > 1:
                raise UserError(f"data: cannot read {path}: use one kind of {', '.join(_LOADERS)} files (or a "
                                "datasets folder)")
            _non_empty(files)
            loader = loaders.pop()
            extra = {"sample_by": "paragraph"} if loader == "text" else {}
            return datasets.load_dataset(loader, data_files={split: [str(f) for f in files]}, split=split,
                                         num_proc=_shard_procs(num_proc, len(files)), **extra)
        if local.is_dir() and (local / "dataset_dict.json").is_file():
            return datasets.load_from_disk(str(local))[split]
        if local.is_dir():  # a folder of data files (split names taken from the file names, as datasets does)
            files = shard_files(path)
            _non_empty(files)
            return datasets.load_dataset(str(local), cfg.name, split=split,
                                         num_proc=_shard_procs(num_proc, len(files)))
        if path.startswith((".", "/", "~")) or local.suffix.lower() in _LOADERS:
            raise UserError(f"data.path: {local.resolve()} does not exist ({RELATIVE_DATA_PATHS})")
        return datasets.load_dataset(path, cfg.name, split=split, num_proc=num_proc)
    except UserError:
        raise
    except PermissionError as err:
        raise UserError(f"data: cannot read {path}: permission denied ({err.strerror})") from None
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise UserError(f"data: cannot load split '{split}' of {path}: {err}") from None
    except Exception as err:  # datasets raises many kinds for unreadable files (e.g. malformed JSON)
        detail = f"{type(err).__name__}: {err}"
        if err.__cause__ is not None:  # DatasetGenerationError wraps the parser's message
            detail += f" ({type(err.__cause__).__name__}: {err.__cause__})"
        raise UserError(f"data: cannot read {path}: {detail}") from None


def _shard_procs(num_proc: int | None, shards: int) -> int | None:
    """Processes that read shards: one per shard at most (datasets reads a shard in one process); None: one."""
    procs = min(num_proc or 1, shards)
    return procs if procs > 1 else None


def load_raw(cfg: DataConfig, seed: int, readers: Readers | None = None, num_proc: int | None = None,
             eval_path: bool = True):
    """The raw train and eval splits (eval may be None) of one source (:meth:`DataConfig.sources`). ``readers``:
    the enabled plugins' data readers, which read the paths they claim (see ``hfsdp_data_readers``); hfsdp reads
    the rest. ``eval_path``: read ``data.eval_path`` as this source's eval rows (a mixture reads it once)."""
    readers = readers or {}
    train = _load_split(cfg.path, cfg, cfg.split, readers, num_proc)
    eval_ = None
    if cfg.eval_path:
        if eval_path:
            eval_ = _load_split(cfg.eval_path, cfg, cfg.split, readers, num_proc)
    elif cfg.eval_split:
        eval_ = _load_split(cfg.path, cfg, cfg.eval_split, readers, num_proc)
    elif cfg.eval_fraction > 0:
        if len(train) < 2:
            raise UserError(f"data.eval_fraction: {cfg.path} has {len(train)} row(s), too few to hold some out")
        parts = train.train_test_split(test_size=cfg.eval_fraction, seed=seed)
        train, eval_ = parts["train"], parts["test"]
    if len(train) == 0:
        raise UserError(f"data.path: {cfg.path} has no rows")
    if eval_ is not None and cfg.max_eval_samples:
        eval_ = eval_.select(range(min(cfg.max_eval_samples, len(eval_))))
    return train, eval_


@dataclass
class TokenizeStats:
    rows: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_labels: int = 0

    def summary(self) -> str:
        return (f"{self.rows} rows: {self.truncated} truncated, {self.dropped_too_long} dropped as too long, "
                f"{self.dropped_no_labels} dropped without trainable tokens")


def _no_rows_fix(cfg: DataConfig) -> str:
    if cfg.too_long == "drop":
        return "raise data.max_seq_len or use data.too_long: truncate"
    return (f"raise data.max_seq_len ({cfg.max_seq_len}): a truncated row keeps only the labelled tokens within it, "
            "and a row with none is dropped")


def _fit_length(batch: dict[str, list], cfg: DataConfig) -> dict[str, list]:
    """The length policy, per row. A row may hold several sequences (``input_ids``, and e.g. a preference row's
    ``rejected_input_ids``, each with its labels column named like it): it is too long if any is, truncation cuts each
    (keeping its start), and it has no trainable tokens if any of its labels columns has none."""
    out: dict[str, list] = {k: [] for k in batch}
    out["_truncated"], out["_dropped_long"], out["_dropped_empty"] = [], [], []
    sequences = [k for k in batch if k.endswith("input_ids")]
    labels = [k for k in batch if k.endswith("labels")]
    for i in range(len(batch["input_ids"])):
        row = {k: batch[k][i] for k in batch}
        too_long = any(len(row[k]) > cfg.max_seq_len for k in sequences)
        if too_long and cfg.too_long == "truncate":
            row = {k: v[: cfg.max_seq_len] if isinstance(v, list) else v for k, v in row.items()}
        dropped_long = too_long and cfg.too_long == "drop"
        # Labels are shifted by one inside the loss, so a row needs a labelled token after position 0.
        empty = not dropped_long and any(all(label == IGNORE_INDEX for label in row[k][1:]) for k in labels)
        for k in batch:
            out[k].append(row[k])
        out["_truncated"].append(too_long and not dropped_long)
        out["_dropped_long"].append(dropped_long)
        out["_dropped_empty"].append(empty)
    return out


def tokenize(raw, tokenize_fn: Callable[..., dict], tokenizer, cfg: DataConfig, num_proc: int | None,
             desc: str = "tokenizing"):
    """Tokenize a raw split with a format function, then apply the length policy; returns (dataset, stats)."""

    def fn(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        try:
            return _fit_length(tokenize_fn(batch, tokenizer, cfg), cfg)
        except RowError as err:
            where = f"row {indices[err.position]}" if err.position is not None and indices else \
                f"rows {indices[0]}-{indices[-1]}" if indices else "a batch"
            raise UserError(f"data.format '{cfg.format}': {where} (counting from 0): {err}") from None
        except UserError as err:
            if type(err) is UserError:
                raise
            raise UserError(str(err)) from None  # plain UserError: it crosses num_proc worker processes intact
        except Exception as err:  # malformed rows (a message without "role", a number for a text) or a format bug
            where = f"rows {indices[0]}-{indices[-1]}" if indices else "a batch"
            raise UserError(f"data.format '{cfg.format}': could not tokenize {where}: {type(err).__name__}: "
                            f"{err}. Check that the rows have the columns and types this format expects") from None

    tokenized = raw.map(fn, batched=True, with_indices=True, remove_columns=raw.column_names, num_proc=num_proc,
                        desc=desc)
    import numpy as np

    table = tokenized.with_format("arrow")  # counted from the Arrow columns, never as Python lists of the corpus
    flags = {name: table[name].to_numpy(zero_copy_only=False).astype(bool)
             for name in ("_truncated", "_dropped_long", "_dropped_empty")}
    stats = TokenizeStats(rows=len(tokenized), truncated=int(flags["_truncated"].sum()),
                          dropped_too_long=int(flags["_dropped_long"].sum()),
                          dropped_no_labels=int(flags["_dropped_empty"].sum()))
    tokenized = tokenized.remove_columns(list(flags))
    dropped = flags["_dropped_long"] | flags["_dropped_empty"]
    if dropped.any():
        tokenized = tokenized.select(np.flatnonzero(~dropped))
    return tokenized, stats


def _row_name(path: str, index: int) -> str:
    return f"line {index + 1} of {path}" if path.endswith(".jsonl") else f"row {index} of {path} (counting from 0)"


# hfsdp validate tokenizes up to this many rows of each data file, spread over the file.
VALIDATE_SAMPLE = 200


def check_rows(config: HfsdpConfig, host: PluginHost, tokenizer, sample: int = VALIDATE_SAMPLE) -> str:
    """Run a sample of each local data file's rows (up to ``sample``, spread over the file) through the format's
    tokenization, one row at a time, so that a row the format cannot read is reported with its number and the fix
    by ``hfsdp validate``, before anything trains. Returns what was checked, in one line."""
    readers = host.data_readers(config)
    top = config.data
    sources = [(f"data.datasets[{i}].path" if top.datasets else "data.path", cfg, cfg.path, cfg.split)
               for i, cfg in enumerate(top.sources())]
    if top.eval_path:
        sources.append(("data.eval_path", top, top.eval_path, top.split))
    elif top.eval_split:
        sources += [(key, cfg, path, cfg.eval_split) for key, cfg, path, _ in list(sources)]
    checked, skipped, columns = [], [], {}
    for key, cfg, path, split in sources:
        if data_reader_key(path, readers) is None and not is_glob(path) and not Path(path).expanduser().exists():
            skipped.append(path)  # a hub dataset: read at train time
            continue
        _, tokenize_fn = host.tokenize_function(config, cfg.format)
        raw = _load_split(path, cfg, split, readers)
        count = min(len(raw), sample)
        positions = [k * len(raw) // count for k in range(count)]
        for i in positions:
            row = raw[i]
            try:
                out = tokenize_fn({column: [value] for column, value in row.items()}, tokenizer, cfg)
            except UserError as err:
                raise UserError(f"{key}: {_row_name(path, i)}: {err}") from None
            except Exception as err:  # a format plugin's own failure on this row
                raise UserError(f"{key}: {_row_name(path, i)}: data.format '{cfg.format}' could not tokenize it: "
                                f"{type(err).__name__}: {err}. Check that the rows have the columns and types this "
                                "format expects") from None
        checked.append(f"{len(positions)} of {len(raw)} rows of {path}{f' ({split})' if split != 'train' else ''}")
        if positions:
            columns.setdefault(key.removesuffix(".path"), list(out))
    if top.datasets:
        _check_columns(list(columns), list(columns.values()))
    formats = sorted({cfg.format for _, cfg, _, _ in sources})
    line = f"data: format {', '.join(formats)} tokenized " + ("; ".join(checked) if checked else "no rows")
    return line + (f"; not checked (not local): {', '.join(skipped)}" if skipped else "")


def cache_key(raw_fingerprints: list[str], tokenizer, cfg: DataConfig, format_owner: str, extra: str = "") -> str:
    """Key of the preprocessing cache: raw data fingerprint + tokenizer + the data config + format plugin."""
    vocab = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else str(tokenizer.get_vocab())
    template = getattr(tokenizer, "chat_template", None) or ""
    payload = json.dumps(
        [raw_fingerprints, hashlib.sha256(vocab.encode()).hexdigest(), template, cfg.model_dump(mode="json"),
         format_owner, extra],
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_entry(target)


def load_or_build(cache_dir: Path | None, key: str, build: Callable[[], tuple[Any, dict]],
                  who: Preprocessing = Preprocessing()):
    """The cached (DatasetDict, meta) for ``key``, or built and stored atomically by the builders (one at a time
    per cache folder, under a file lock), while the other processes poll for the complete entry; returns
    (dataset, meta, hit)."""
    from filelock import FileLock

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
    with FileLock(str(target) + ".lock"):
        if (target / CACHE_META).is_file():
            try:
                return *_load_entry(target), True
            except Exception:  # a damaged cache entry is rebuilt, not fatal
                shutil.rmtree(target, ignore_errors=True)
        return *_build_entry(target, build, marker), False


def _check_columns(names: list[str], columns: list[list[str]]) -> None:
    """Sources mixed into one training set must give the same columns (formats that fit one model's batches)."""
    for name, these in zip(names[1:], columns[1:]):
        if sorted(these) != sorted(columns[0]):
            raise UserError(f"{name} gives the columns {sorted(these)}, {names[0]} gives {sorted(columns[0])}: "
                            "sources mixed into one training set need formats whose rows have the same columns (text, "
                            "instruction and chat mix; a format with other columns needs a run of its own)")


def prepare_datasets(config: HfsdpConfig, host: PluginHost, tokenizer, cache_dir: Path,
                     who: Preprocessing = Preprocessing()):
    """The tokenized train and eval splits (built by the format plugins and the dataset transforms, or read from
    the preprocessing cache), the raw eval rows, and a report of what was done (:func:`format_data_report`).

    Each training source (:meth:`DataConfig.sources`) is tokenized with its own format and transformed on its own
    (``hfsdp_transform_dataset`` once per source, with its eval rows), so that every row belongs to one source; the training split is the sources' rows one after the other (``meta["sources"]``: how
    many each)."""
    import datasets

    top = config.data
    sources = top.sources()
    names = [f"data.datasets[{i}]" if top.datasets else "data.path" for i in range(len(sources))]
    num_proc = top.num_proc or default_num_proc()
    readers = host.data_readers(config)
    raws = [load_raw(cfg, config.train.seed, readers, num_proc, eval_path=i == 0) for i, cfg in enumerate(sources)]
    functions = [host.tokenize_function(config, cfg.format) for cfg in sources]
    owners = sorted({f"{owner}=={next((p.version for p in host.plugins if p.name == owner), '?')}"
                     for owner, _ in functions})
    transforms = ",".join(host.implementers("hfsdp_transform_dataset"))
    fingerprints = [ds._fingerprint if ds is not None else "" for pair in raws for ds in pair]
    key = cache_key(fingerprints, tokenizer, top, ",".join(owners),
                    extra=transforms + repr(sorted((k, repr(v)) for k, v in config.plugin_config.items())))

    def tokenized(raw, i: int, split: str):
        procs = max(1, min(num_proc, len(raw) // MIN_ROWS_PER_PROC))  # starting a process costs more than few rows
        where = [names[i], split] if len(sources) > 1 else [split]
        ds, stats = tokenize(raw, functions[i][1], tokenizer, sources[i], procs if procs > 1 else None,
                             desc=" ".join(["tokenizing", *where]))
        if len(ds) == 0:  # checked before caching: datasets cannot reload an empty saved split
            origin = names[i] if split == "train" else "the eval data"
            raise UserError(f"data: no {split} rows left after tokenization of {origin} ({stats.summary()}); "
                            + _no_rows_fix(sources[i]))
        return ds, stats

    def build():
        trains, evals, stats = [], [], []
        for i, (raw_train, raw_eval) in enumerate(raws):
            train, train_stats = tokenized(raw_train, i, "train")
            stats.append(dataclasses.asdict(train_stats))
            splits = {"train": train}
            if raw_eval is not None:
                splits["eval"] = tokenized(raw_eval, i, "eval")[0]
            _check_columns(names[: i + 1], [t.column_names for t in (*trains, train)])
            part = host.chain("hfsdp_transform_dataset", "dataset", datasets.DatasetDict(splits), config=config,
                              tokenizer=tokenizer)
            trains.append(part["train"])
            if "eval" in part:
                evals.append(part["eval"])
        result = {"train": datasets.concatenate_datasets(trains) if len(trains) > 1 else trains[0]}
        if evals:
            result["eval"] = datasets.concatenate_datasets(evals) if len(evals) > 1 else evals[0]
        return datasets.DatasetDict(result), {"sources": [len(t) for t in trains], "train": stats}

    t0 = time.perf_counter()
    result, meta, hit = load_or_build(cache_dir, key, build, who)
    seconds = time.perf_counter() - t0
    train = result["train"]
    totals = _add(*(TokenizeStats(**s) for s in meta["train"]))
    report = {"train": f"{len(train)} rows ({totals.summary()})", "cache_hit": hit, "preprocess_s": seconds,
              "padding": padding_report(train, config.train.per_device_batch_size, config.train.seed,
                                        config.train.group_by_length),
              "sources": source_rows(train, sources, top, meta)}
    if "eval" in result:
        report["eval"] = f"{len(result['eval'])} rows"
    raw_eval = raws[0][1]
    return train, result.get("eval"), raw_eval, report


# A tokenizing process gets at least this many rows (fewer rows are tokenized in fewer processes).
MIN_ROWS_PER_PROC = 1000


def _add(*stats: TokenizeStats) -> TokenizeStats:
    return TokenizeStats(*(sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(TokenizeStats)))


def source_rows(train, sources: list[DataConfig], top: DataConfig, meta: dict) -> list[dict[str, Any]]:
    """Each training source's rows, tokens and truncations (config order), and its planned share of the mixture."""
    lengths = row_lengths(train)
    mixture = Mixture.of(top, meta["sources"])
    out, start = [], 0
    for cfg, rows, stats, share in zip(sources, meta["sources"], meta["train"], mixture.shares):
        out.append({"path": cfg.path, "format": cfg.format, "rows": rows,
                    "tokens": int(lengths[start:start + rows].sum()), "truncated": stats["truncated"],
                    "share_planned": float(share)})
        start += rows
    return out


def format_data_report(report: dict[str, Any]) -> str:
    return (f"data: train {report['train']}; eval {report.get('eval', 'none')}; {report['padding']}; "
            f"preprocessing {report['preprocess_s']:.2f} s{' (preprocessing cache hit)' if report['cache_hit'] else ''}")


def with_realised_shares(sources: list[dict[str, Any]], plan: "BatchPlan", steps: int) -> list[dict[str, Any]]:
    """``sources`` (:func:`source_rows`) with each one's share of the rows trained on in ``steps`` steps."""
    counts = plan.source_counts(steps)
    total = max(1, sum(counts))
    return [{**source, "share_realised": count / total} for source, count in zip(sources, counts)]


def format_sources(sources: list[dict[str, Any]], steps: int) -> str:
    """The mixture, one line per source (:func:`with_realised_shares` over ``steps``: the plan's rows of them)."""
    return "\n".join(f"  source {i}: {s['path']} ({s['format']}): {s['rows']} rows, {s['tokens']} tokens, "
                     f"{s['truncated']} truncated; share planned {s['share_planned']:.1%}, "
                     f"{s['share_realised']:.1%} of the rows of the run's {steps} steps" for i, s in enumerate(sources))


class Mixture:
    """How the training sources (stored one after the other) share the positions of the training stream.

    Of the first ``n`` positions, source ``i`` gets ``floor(n*C_i) - floor(n*C_(i-1))``, ``C`` being the cumulative
    shares (exact fractions): every prefix of the stream holds each source within one row of its share. Within an
    epoch of ``epoch_rows`` positions those rows are shuffled (seeded by seed and epoch); source ``i`` reads its
    rows as a stream of seeded per-pass permutations of its own. A single source is one permutation per epoch, the
    plan hfsdp has always had."""

    def __init__(self, rows: list[int], shares: list[Fraction], epoch_rows: int):
        self.rows, self.shares, self.epoch_rows = list(rows), list(shares), epoch_rows
        self.offsets = [0]
        for n in self.rows:
            self.offsets.append(self.offsets[-1] + n)
        self._cumulative = list(itertools.accumulate(self.shares))

    @classmethod
    def of(cls, cfg: DataConfig, rows: list[int]) -> "Mixture":
        """The mixture ``data.datasets`` asks for, given each source's rows: by weight (an epoch is all their
        rows), or by epochs per source (an epoch holds each source's rows that many times; default once)."""
        specs = cfg.datasets or [None]
        if specs[0] is not None and specs[0].weight is not None:
            weights = [Fraction(str(s.weight)) for s in specs]
            return cls(rows, [w / sum(weights) for w in weights], sum(rows))
        passes = [Fraction(str(s.epochs)) if s is not None and s.epochs is not None else Fraction(1) for s in specs]
        sizes = [p * n for p, n in zip(passes, rows)]
        return cls(rows, [size / sum(sizes) for size in sizes], max(1, math.floor(sum(sizes))))

    def counts(self, n: int) -> list[int]:
        """Positions of the first ``n`` that go to each source."""
        ends = [math.floor(n * c) for c in self._cumulative[:-1]] + [n]
        return [b - a for a, b in zip([0] + ends[:-1], ends)]

    def _stream(self, source: int, start: int, stop: int, seed: int) -> list[int]:
        """Rows ``start``..``stop`` of a source's stream (global row indices): one seeded permutation per pass."""
        n, out = self.rows[source], []
        for p in range(start // n, (stop - 1) // n + 1 if stop > start else start // n):
            generator = torch.Generator().manual_seed(seed + p + source * SOURCE_SEED_STRIDE)
            perm = torch.randperm(n, generator=generator)
            lo, hi = max(start - p * n, 0), min(stop - p * n, n)
            out.extend((perm[lo:hi] + self.offsets[source]).tolist())
        return out

    def order(self, epoch: int, seed: int) -> list[int]:
        """Global row indices of the positions of ``epoch``."""
        import numpy as np

        lo, hi = self.counts(epoch * self.epoch_rows), self.counts((epoch + 1) * self.epoch_rows)
        streams = [self._stream(i, a, b, seed) for i, (a, b) in enumerate(zip(lo, hi))]
        if len(streams) == 1:
            return streams[0]
        labels = np.random.default_rng((seed, epoch)).permutation(np.repeat(np.arange(len(streams)),
                                                                            [b - a for a, b in zip(lo, hi)]))
        order = np.empty(labels.size, dtype=np.int64)
        for i, stream in enumerate(streams):
            order[labels == i] = stream
        return order.tolist()

    def source_of(self, rows) -> "Any":
        import numpy as np

        return np.searchsorted(np.asarray(self.offsets[1:]), np.asarray(rows), side="right")


# Source i's permutations are seeded seed + pass + i * this (source 0: seed + pass, hfsdp's single-source plan).
SOURCE_SEED_STRIDE = 2 ** 32


GROUP_SPAN = 64


def group_by_length(order: list[int], lengths, batch: int, generator: torch.Generator) -> list[int]:
    """``order`` rearranged so that each run of ``batch`` positions holds rows of similar length: every span of
    ``GROUP_SPAN`` batches is sorted longest first and cut into batches, and the full batches of a span are shuffled
    (a last, partial batch stays last, so that the batches after it keep their boundaries)."""
    out: list[int] = []
    span = GROUP_SPAN * batch
    for start in range(0, len(order), span):
        chunk = sorted(order[start:start + span], key=lambda i: -lengths[i])  # stable: ties keep the seeded order
        full = len(chunk) // batch
        for k in torch.randperm(full, generator=generator).tolist():
            out.extend(chunk[k * batch:(k + 1) * batch])
        out.extend(chunk[full * batch:])
    return out


def row_lengths(dataset):
    """Tokens per row of a tokenized dataset (read from its Arrow column, without decoding the rows)."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_numpy(zero_copy_only=False)


class BatchPlan:
    """Which rows each rank trains on at each optimizer step, as a pure function of (seed, step).

    With ``lengths`` (``train.group_by_length``) each epoch's seeded order is regrouped so that every global batch
    holds rows of similar length, sorted longest first, so that each micro-batch (a consecutive slice of it) pads
    little. A global batch still depends only on (seed, step) and the global batch size, never on how it is split
    over ranks and micro-batches: N ranks keep training on exactly the global batches of one process."""

    def __init__(self, num_rows: int, per_device_batch: int, world_size: int, accumulation: int, seed: int,
                 lengths=None, mixture: Mixture | None = None):
        self.mixture = mixture or Mixture([num_rows], [Fraction(1)], num_rows)
        self.num_rows = self.mixture.epoch_rows  # positions per epoch
        self.per_device_batch = per_device_batch
        self.world_size = world_size
        self.accumulation = accumulation
        self.seed = seed
        self.lengths = lengths
        self._epoch_cache: tuple[int, list[int]] | None = None

    @classmethod
    def for_run(cls, dataset, cfg: TrainConfig, world_size: int, mixture: Mixture | None = None) -> "BatchPlan":
        """The plan of a run's ``train:`` section on ``world_size`` ranks (``mixture``: of several sources)."""
        return cls(len(dataset), cfg.per_device_batch_size, world_size, cfg.gradient_accumulation_steps, cfg.seed,
                   lengths=row_lengths(dataset) if cfg.group_by_length else None, mixture=mixture)

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.world_size * self.accumulation

    def steps_for_epochs(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.num_rows / self.global_batch))

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = self.mixture.order(epoch, self.seed)
            if self.lengths is not None:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                # grouping draws after the first source's permutation of this epoch, from its generator's state
                torch.randperm(self.mixture.rows[0], generator=generator)
                # Global batches run on across epochs: group from this epoch's first batch boundary on.
                head = -epoch * self.num_rows % self.global_batch
                order = order[:head] + group_by_length(order[head:], self.lengths, self.global_batch, generator)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]

    def rows(self, step: int, micro_step: int, rank: int) -> list[int]:
        start = step * self.global_batch + (micro_step * self.world_size + rank) * self.per_device_batch
        return [self._order(p // self.num_rows)[p % self.num_rows] for p in range(start, start + self.per_device_batch)]

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch / self.num_rows

    def source_counts(self, steps: int) -> list[int]:
        """Rows of each source in the global batches of the first ``steps`` steps."""
        import numpy as np

        counts = np.zeros(len(self.mixture.rows), dtype=np.int64)
        end = steps * self.global_batch
        for epoch in range(0, (end - 1) // self.num_rows + 1 if end else 0):
            order = self._order(epoch)[: end - epoch * self.num_rows]
            counts += np.bincount(self.mixture.source_of(order), minlength=counts.size)
        return counts.tolist()


# Rows of the training set hashed at a time by :func:`identity`.
IDENTITY_CHUNK = 65536


def identity(dataset) -> dict[str, Any]:
    """What a checkpoint records of the training rows it was trained on: their number and a hash of their tokens
    (every column, in order), so that a resume on other data, or the same file changed, is refused."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    digest = hashlib.sha256()
    for name in sorted(table.column_names):
        column_type = table.features.arrow_schema.field(name).type
        digest.update(name.encode())
        if pa.types.is_list(column_type) or pa.types.is_large_list(column_type):
            # every row's length, then every token: read IDENTITY_CHUNK rows at a time (memory stays bounded)
            for part in (pc.list_value_length, pc.list_flatten):
                for batch in table.select_columns([name]).iter(batch_size=IDENTITY_CHUNK):
                    digest.update(part(batch[name]).to_numpy(zero_copy_only=False).astype("int64").tobytes())
        else:
            digest.update(json.dumps(table[name].to_pylist(), default=str).encode())
    return {"train_rows": len(dataset), "train_fingerprint": digest.hexdigest()[:16]}


def collate(rows: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch; padding has label -100 and attention mask 0."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    has_positions = "position_ids" in rows[0]
    positions = torch.zeros((len(rows), width), dtype=torch.long) if has_positions else None
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        attention[i, :n] = 1
        if positions is not None:
            positions[i, :n] = torch.tensor(r["position_ids"])
            positions[i, n:] = torch.arange(width - n)  # padding restarts at 0: a block of its own
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
    if positions is not None:
        batch["position_ids"] = positions
    return batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model gets from a collated batch: everything but the labels, and no attention mask where it masks
    nothing (rows of one length): the model then takes its causal path (SDPA's ``is_causal`` kernel) without
    building or checking a mask, which on a GPU is a host sync per forward.

    No forward of a training or eval batch builds a KV cache (``use_cache`` is on by default, even in training): a
    layer recomputed in backward under FSDP's activation checkpointing would append its keys to the cache a second
    time and attend over twice the row, and packed rows need the cache off (below).

    Packed rows (with ``position_ids``) go without the 2D attention mask: given neither mask nor cache, transformers
    builds a block-diagonal causal mask from where ``position_ids`` restart at 0 (``find_packed_sequence_indices`` in
    ``transformers.masking_utils``), so no token attends across samples. A 2D mask, or a cache, switches that
    detection off and lets packed samples see each other.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    inputs["use_cache"] = False
    if "position_ids" in inputs:
        inputs.pop("attention_mask", None)
    elif "attention_mask" in inputs and bool(inputs["attention_mask"].all()):
        inputs.pop("attention_mask")
    return inputs


@torch.no_grad()
def check_packed_attention(model, vocab_size: int, device) -> None:
    """Packed rows are only correct if the model keeps each sample's attention to itself. Probe it on the real
    (wrapped) model before training: a sample's logits inside a packed row must equal its logits alone. Refuses
    (UserError) when the packed logits are closer to those of the sample *after* the other one (what attending
    across the boundary gives) than a tenth of the way. Every rank runs the same forwards (FSDP collectives)."""
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (7, 6))

    def logits_of_second(rows: dict[str, list[int]]) -> torch.Tensor:
        batch = {k: v.to(device) for k, v in collate([{**rows, "labels": rows["input_ids"]}], pad_id=0).items()}
        return model(**model_inputs(batch)).logits[0, -len(second):].float().cpu()

    was_training = model.training
    model.eval()
    try:
        alone = logits_of_second({"input_ids": second})
        packed = logits_of_second({"input_ids": first + second,
                                   "position_ids": list(range(len(first))) + list(range(len(second)))})
        attending = logits_of_second({"input_ids": first + second})
    finally:
        model.train(was_training)
        reshard(model)
    leak, context = float((packed - alone).abs().max()), float((attending - alone).abs().max())
    if leak > 0.1 * context:
        raise UserError(
            f"packing: this model lets packed samples attend to each other (a probe's logits changed by {leak:.3g} "
            f"when packed after another sample; attending to it changes them by {context:.3g}). Its attention does "
            "not follow the position_ids restarts that hfsdp relies on (transformers' packed-sequence detection): "
            "remove the packing plugin for this model"
        )


def reshard(model) -> None:
    """Free the parameters FSDP2 gathered for forwards outside training (the root module keeps its own gathered
    after a forward, expecting the backward), so that the model holds its shards again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass
class MicroBatch:
    """A collated micro-batch on its device, with the counts the loss normalisation needs, taken on the host."""

    inputs: dict[str, Any]  # what the model gets (``model_inputs``, maybe ``logits_to_keep``)
    targets: torch.Tensor  # the next-token label of each logit the model returns (IGNORE_INDEX: no loss there)
    lengths: list[int]  # real (non-padding) tokens of each row
    num_targets: int  # what the loss sums over: labelled positions (an objective's own units, e.g. DPO's pairs)
    label_positions: torch.Tensor | None = None  # flat indices of the labelled targets (what the chunked loss reads)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def make_filler(self) -> None:
        """No loss in this batch: a filler forward, so that every rank runs the same number of them (eval)."""
        self.targets.fill_(IGNORE_INDEX)
        self.num_targets, self.label_positions = 0, self.label_positions[:0]


def micro_batch(rows: list[dict[str, list[int]]], pad_id: int, device, select_logits: bool = False) -> MicroBatch:
    """Collate ``rows``, choose the model inputs and count tokens on the CPU, then move the tensors to ``device``:
    nothing here waits for the device.

    ``select_logits`` (for models whose forward takes ``logits_to_keep``): the model computes logits only at the
    positions where some row has a next-token label. The LM head (a vocabulary-sized projection) and the cross
    entropy then skip prompts and padding, which are most positions of instruction and chat data; the loss is the
    same sum over the same labelled positions."""
    batch = collate(rows, pad_id)
    inputs = model_inputs(batch)
    shifted = batch["labels"][:, 1:]
    labelled = shifted != IGNORE_INDEX
    targets = F.pad(shifted, (0, 1), value=IGNORE_INDEX)  # position t predicts token t + 1; the last predicts none
    if select_logits:  # never the last position (it predicts nothing); one logit, without loss, if none has a label
        keep = labelled.any(0).nonzero().flatten() if labelled.any() else torch.zeros(1, dtype=torch.long)
        inputs["logits_to_keep"] = keep
        targets = targets[:, keep]

    def move(value):
        return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value

    return MicroBatch(inputs={k: move(v) for k, v in inputs.items()}, targets=move(targets),
                      lengths=[len(r["input_ids"]) for r in rows], num_targets=int(labelled.sum()),
                      label_positions=move((targets.reshape(-1) != IGNORE_INDEX).nonzero().flatten()))


def micro_batches(dataset, plan: "BatchPlan", step: int, rank: int, pad_id: int, device,
                  select_logits: bool = False, make: Callable[..., MicroBatch] = micro_batch) -> list[MicroBatch]:
    """This rank's micro-batches of optimizer step ``step`` (``make``: an objective's ``micro_batch``)."""
    return [make([dataset[i] for i in plan.rows(step, m, rank)], pad_id, device, select_logits)
            for m in range(plan.accumulation)]


def padding_fraction(lengths, batch_size: int, seed: int, grouped: bool = False) -> float:
    """Share of padding in micro-batches of ``batch_size`` rows drawn in a seeded random order (``grouped``: then
    grouped by length, as ``train.group_by_length`` does)."""
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return 0.0
    order = np.random.default_rng(seed).permutation(lengths.size)
    if grouped:
        order = np.asarray(group_by_length(order.tolist(), lengths, batch_size, torch.Generator().manual_seed(seed)))
    lengths = lengths[order]
    full = lengths.size // batch_size * batch_size
    padded = int(lengths[:full].reshape(-1, batch_size).max(axis=1).sum()) * batch_size
    if full < lengths.size:
        padded += int(lengths[full:].max()) * (lengths.size - full)
    return 1.0 - float(lengths.sum()) / padded


def padding_report(dataset, batch_size: int, seed: int, grouped: bool = False) -> str:
    """Padding of the training micro-batches; for packed rows (with ``position_ids``) also before packing."""
    import numpy as np
    import pyarrow.compute as pc

    rows = row_lengths(dataset)
    after = padding_fraction(rows, batch_size, seed, grouped)
    if "position_ids" not in dataset.column_names:
        return f"padding {after:.1%}" + (" (grouped by length)" if grouped else "")
    table = dataset.with_format("arrow")
    flat = pc.list_flatten(table["position_ids"]).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(flat == 0)
    samples = np.diff(np.append(starts, flat.size))
    before = padding_fraction(samples, batch_size, seed)
    return f"padding {before:.1%} -> {after:.1%} ({samples.size} samples packed into {rows.size} rows)"


def eval_batches(num_rows: int, per_device_batch: int, world_size: int, rank: int) -> list[list[int] | None]:
    """This rank's eval batches. Every rank gets the same number (FSDP collectives need all ranks in step);
    ``None`` marks a filler batch that carries no loss."""
    mine = list(range(rank, num_rows, world_size))
    per_rank = math.ceil(math.ceil(num_rows / world_size) / per_device_batch)
    batches: list[list[int] | None] = [mine[i * per_device_batch:(i + 1) * per_device_batch] for i in range(per_rank)]
    return [b if b else None for b in batches]
