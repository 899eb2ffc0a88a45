"""Datasets: the raw rows of each source (built-in loaders, shards, or a plugin's reader), tokenized with the
source's format, cached (``components.data_cache``), with the data report; per-step batches are ``hfsdp.data.batches``.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping


from hfsdp import IGNORE_INDEX
from hfsdp.config.data_paths import (
    DATA_SUFFIXES,
    RELATIVE_DATA_PATHS,
    data_reader_key,
    empty_file,
    is_glob,
    shard_files,
)
from hfsdp.config.schema import DataConfig, HfsdpConfig
from hfsdp.data.broken_rows import first_problem
from hfsdp.data.batches import NEXT_FIT_ROWS, Mixture, padding_report, row_lengths
from hfsdp.data.cache import Preprocessing, cache_key, load_or_build, quiet_datasets
from hfsdp.data.images import FORMATS_WITH_IMAGES, IMAGES_COLUMN, rows_with_images
from hfsdp.errors import PluginError, RowError, UserError

if TYPE_CHECKING:
    from hfsdp.data.batches import BatchPlan
    from hfsdp.hooks.host import PluginHost

_LOADERS = dict(zip(DATA_SUFFIXES, ("text", "text", "json", "json", "csv", "parquet")))
# A plugin's data reader: file suffix or source prefix -> (plugin, read(path, split, data_config)).
Readers = Mapping[str, tuple[str, Callable[..., Any]]]


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
    files: list[Path] = []
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
        _say_what_is_broken(files)
        raise UserError(f"data: cannot load split '{split}' of {path}: {err}") from None
    except Exception as err:  # datasets raises many kinds for unreadable files (e.g. malformed JSON)
        _say_what_is_broken(files)
        detail = f"{type(err).__name__}: {err}"
        if err.__cause__ is not None:  # DatasetGenerationError wraps the parser's message
            detail += f" ({type(err.__cause__).__name__}: {err.__cause__})"
        raise UserError(f"data: cannot read {path}: {detail}") from None


def _say_what_is_broken(files: list[Path]) -> None:
    """A data file that ``datasets`` could not read: the file, line and what is wrong, found again by hfsdp (pyarrow
    counts rows from 0 over what it parsed, or names none), as a UserError; nothing where hfsdp finds nothing."""
    for f in files:
        if problem := first_problem(f, _LOADERS[f.suffix.lower()]):
            raise UserError(f"data: {problem}") from None


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
        # a row with images is never cut (the cut could fall inside an image's tokens): dropped instead
        dropped_long = too_long and (cfg.too_long == "drop" or bool(row.get(IMAGES_COLUMN)))
        if too_long and not dropped_long:
            row = {k: v[: cfg.max_seq_len] if isinstance(v, list) and k != IMAGES_COLUMN else v for k, v in row.items()}
        # Labels are shifted by one inside the loss, so a row needs a labelled token after position 0.
        empty = not dropped_long and any(all(label == IGNORE_INDEX for label in row[k][1:]) for k in labels)
        for k in batch:
            out[k].append(row[k])
        out["_truncated"].append(too_long and not dropped_long)
        out["_dropped_long"].append(dropped_long)
        out["_dropped_empty"].append(empty)
    return out


def _has_images(raw) -> bool:
    """Whether any row of a raw split has an entry in its images column."""
    column = raw.with_format("arrow")[IMAGES_COLUMN] if len(raw) else None
    if column is None:
        return False
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return bool(pc.max(pc.list_value_length(column)).as_py() or 0)
    return column.null_count < len(column)


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
    if IMAGES_COLUMN in raw.column_names and IMAGES_COLUMN not in tokenized.column_names and _has_images(raw):
        raise UserError(f"data.format '{cfg.format}' does not read the rows' {IMAGES_COLUMN} column: "
                        f"{FORMATS_WITH_IMAGES} so far; remove the images, or use one of those formats")
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
    (``hfsdp_transform_dataset`` once per source, with its eval rows), so that every row belongs to one source; the
    training split is the sources' rows one after the other (``meta["sources"]``: how many each)."""
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
        trains, evals, stats, columns, next_fit = [], [], [], [], []
        for i, (raw_train, raw_eval) in enumerate(raws):
            train, train_stats = tokenized(raw_train, i, "train")
            stats.append(dataclasses.asdict(train_stats))
            splits = {"train": train}
            if raw_eval is not None:
                splits["eval"] = tokenized(raw_eval, i, "eval")[0]
            columns.append(train.column_names)  # the formats' rows, compared before any transform
            _check_columns(names[: i + 1], columns)
            part = host.chain("hfsdp_transform_dataset", "dataset", datasets.DatasetDict(splits), config=config,
                              tokenizer=tokenizer)
            trains.append(part["train"])
            next_fit.append(getattr(part["train"], NEXT_FIT_ROWS, None))
            if "eval" in part:
                evals.append(part["eval"])
        result = {"train": datasets.concatenate_datasets(trains) if len(trains) > 1 else trains[0]}
        if evals:
            result["eval"] = datasets.concatenate_datasets(evals) if len(evals) > 1 else evals[0]
        meta = {"sources": [len(t) for t in trains], "train": stats}
        if None not in next_fit:  # every source's transform packed its rows and counted next-fit's
            meta["next_fit_rows"] = sum(next_fit)
        return datasets.DatasetDict(result), meta

    t0 = time.perf_counter()
    result, meta, hit = load_or_build(cache_dir, key, build, who)
    seconds = time.perf_counter() - t0
    train = result["train"]
    totals = _add(*(TokenizeStats(**s) for s in meta["train"]))
    shown = rows_with_images(train)  # (a vision-language model's rows: how many show images)
    report = {"train": f"{len(train)} rows ({totals.summary()}{f', {shown} with images' if shown else ''})",
              "cache_hit": hit, "preprocess_s": seconds,
              "padding": padding_report(train, config.train.per_device_batch_size, config.train.seed,
                                        config.train.group_by_length, meta.get("next_fit_rows")),
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


