"""Datasets: load raw rows, tokenize them with the configured format plugin, cache the result, batch it.

Batching is a pure function of (seed, step): the global batch of optimizer step ``s`` is a fixed slice of a stream of
seeded per-epoch permutations, and each rank takes its share. Resuming at step ``s`` therefore neither replays nor
skips a sample, and a run on N ranks sees exactly the global batches of a single-process run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX
from hfsdp.config import DATA_SUFFIXES, RELATIVE_DATA_PATHS, DataConfig, HfsdpConfig, TrainConfig, data_reader_key
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


@quiet_datasets()
def _load_split(path: str, cfg: DataConfig, split: str, readers: Readers):
    import datasets

    key = data_reader_key(path, readers)
    if key is not None:
        return _read_with_plugin(path, cfg, split, *readers[key])
    local = Path(path).expanduser()
    try:
        if local.is_file():
            loader = _LOADERS.get(local.suffix.lower())
            if loader is None:
                raise UserError(f"data: cannot read {local}: use one of {', '.join(_LOADERS)} or a datasets folder")
            with open(local, "rb") as f:  # also surfaces an unreadable file as a PermissionError, below
                if not f.read(4096).strip():
                    raise UserError(f"data: {local} is empty (no rows to train on)")
            extra = {"sample_by": "paragraph"} if loader == "text" else {}
            return datasets.load_dataset(loader, data_files={split: str(local)}, split=split, **extra)
        if local.is_dir() and (local / "dataset_dict.json").is_file():
            return datasets.load_from_disk(str(local))[split]
        if local.is_dir():  # a folder of data files
            return datasets.load_dataset(str(local), cfg.name, split=split)
        if path.startswith((".", "/", "~")) or local.suffix.lower() in _LOADERS:
            raise UserError(f"data.path: {local.resolve()} does not exist ({RELATIVE_DATA_PATHS})")
        return datasets.load_dataset(path, cfg.name, split=split)
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


def load_raw(cfg: DataConfig, seed: int, readers: Readers | None = None):
    """The raw train and eval splits (eval may be None). ``readers``: the enabled plugins' data readers, which
    read the paths they claim (see ``hfsdp_data_readers``); hfsdp reads the rest."""
    readers = readers or {}
    train = _load_split(cfg.path, cfg, cfg.split, readers)
    eval_ = None
    if cfg.eval_path:
        eval_ = _load_split(cfg.eval_path, cfg, cfg.split, readers)
    elif cfg.eval_split:
        eval_ = _load_split(cfg.path, cfg, cfg.eval_split, readers)
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


def tokenize(raw, tokenize_fn: Callable[..., dict], tokenizer, cfg: DataConfig, num_proc: int | None):
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
                        desc="tokenizing")
    stats = TokenizeStats(
        rows=len(tokenized),
        truncated=sum(tokenized["_truncated"]),
        dropped_too_long=sum(tokenized["_dropped_long"]),
        dropped_no_labels=sum(tokenized["_dropped_empty"]),
    )
    keep = [i for i, (a, b) in enumerate(zip(tokenized["_dropped_long"], tokenized["_dropped_empty"])) if not (a or b)]
    tokenized = tokenized.select(keep).remove_columns(["_truncated", "_dropped_long", "_dropped_empty"])
    return tokenized, stats


def _row_name(path: str, index: int) -> str:
    return f"line {index + 1} of {path}" if path.endswith(".jsonl") else f"row {index} of {path} (counting from 0)"


# hfsdp validate tokenizes up to this many rows of each data file, spread over the file.
VALIDATE_SAMPLE = 200


def check_rows(config: HfsdpConfig, host: PluginHost, tokenizer, sample: int = VALIDATE_SAMPLE) -> str:
    """Run a sample of each local data file's rows (up to ``sample``, spread over the file) through the format's
    tokenization, one row at a time, so that a row the format cannot read is reported with its number and the fix
    by ``hfsdp validate``, before anything trains. Returns what was checked, in one line."""
    cfg = config.data
    _, tokenize_fn = host.tokenize_function(config)
    readers = host.data_readers(config)
    sources = [("data.path", cfg.path, cfg.split)]
    if cfg.eval_path:
        sources.append(("data.eval_path", cfg.eval_path, cfg.split))
    elif cfg.eval_split:
        sources.append(("data.path", cfg.path, cfg.eval_split))
    checked, skipped = [], []
    for key, path, split in sources:
        if data_reader_key(path, readers) is None and not Path(path).expanduser().exists():
            skipped.append(path)  # a hub dataset: read at train time
            continue
        raw = _load_split(path, cfg, split, readers)
        count = min(len(raw), sample)
        positions = [k * len(raw) // count for k in range(count)]
        for i in positions:
            row = raw[i]
            try:
                tokenize_fn({column: [value] for column, value in row.items()}, tokenizer, cfg)
            except UserError as err:
                raise UserError(f"{key}: {_row_name(path, i)}: {err}") from None
            except Exception as err:  # a format plugin's own failure on this row
                raise UserError(f"{key}: {_row_name(path, i)}: data.format '{cfg.format}' could not tokenize it: "
                                f"{type(err).__name__}: {err}. Check that the rows have the columns and types this "
                                "format expects") from None
        checked.append(f"{len(positions)} of {len(raw)} rows of {path}{f' ({split})' if split != 'train' else ''}")
    line = f"data: format {cfg.format} tokenized " + ("; ".join(checked) if checked else "no rows")
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


def load_or_build(cache_dir: Path | None, key: str, build: Callable[[], Any]):
    """Return the cached DatasetDict for ``key`` or build and store it (atomically) — a second run skips tokenizing."""
    import datasets

    if cache_dir is None:
        return build(), False
    target = cache_dir / "datasets" / key
    if (target / "dataset_dict.json").is_file():
        try:
            with quiet_datasets():
                return datasets.load_from_disk(str(target)), True
        except Exception:  # a damaged cache entry is rebuilt, not fatal
            shutil.rmtree(target, ignore_errors=True)
    result = build()
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_datasets():
        result.save_to_disk(str(tmp))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return datasets.load_from_disk(str(target)), False


# Grouping by length sorts spans of this many global batches at a time (as transformers' LengthGroupedSampler
# sorts "megabatches" of 50): long enough to find rows of similar length, short enough to keep batches varied.
def prepare_datasets(config: HfsdpConfig, host: PluginHost, tokenizer, cache_dir: Path):
    """The tokenized train and eval splits (built by the format plugin and the dataset transforms, or read from the
    preprocessing cache), the raw eval rows, and a report of what was done (:func:`format_data_report`)."""
    import datasets

    owner, tokenize_fn = host.tokenize_function(config)
    raw_train, raw_eval = load_raw(config.data, config.train.seed, host.data_readers(config))
    owner_version = next((p.version for p in host.plugins if p.name == owner), "?")
    transforms = ",".join(host.implementers("hfsdp_transform_dataset"))
    key = cache_key([raw_train._fingerprint, raw_eval._fingerprint if raw_eval is not None else ""],
                    tokenizer, config.data, f"{owner}=={owner_version}",
                    extra=transforms + repr(sorted((k, repr(v)) for k, v in config.plugin_config.items())))
    stats: dict[str, TokenizeStats] = {}

    def build():
        splits = {"train": raw_train, **({"eval": raw_eval} if raw_eval is not None else {})}
        tokenized = {}
        for name, split in splits.items():
            tokenized[name], stats[name] = tokenize(split, tokenize_fn, tokenizer, config.data, config.data.num_proc)
            if len(tokenized[name]) == 0:  # checked before caching: datasets cannot reload an empty saved split
                where = "data.path" if name == "train" else "the eval data"
                raise UserError(f"data: no {name} rows left after tokenization of {where} ({stats[name].summary()}); "
                                + _no_rows_fix(config.data))
        result = datasets.DatasetDict(tokenized)
        return host.chain("hfsdp_transform_dataset", "dataset", result, config=config, tokenizer=tokenizer)

    t0 = time.perf_counter()
    result, hit = load_or_build(cache_dir, key, build)
    seconds = time.perf_counter() - t0
    if len(result["train"]) == 0:
        summary = stats["train"].summary() if "train" in stats else "no rows"
        raise UserError(f"data: no training rows left after tokenization ({summary}); " + _no_rows_fix(config.data))
    report = {"train": f"{len(result['train'])} rows", "cache_hit": hit, "preprocess_s": seconds,
              "padding": padding_report(result["train"], config.train.per_device_batch_size, config.train.seed,
                                        config.train.group_by_length)}
    if "train" in stats:
        report["train"] += f" ({stats['train'].summary()})"
    if "eval" in result:
        report["eval"] = f"{len(result['eval'])} rows"
    return result["train"], result.get("eval"), raw_eval, report




def format_data_report(report: dict[str, Any]) -> str:
    return (f"data: train {report['train']}; eval {report.get('eval', 'none')}; {report['padding']}; "
            f"preprocessing {report['preprocess_s']:.2f} s{' (preprocessing cache hit)' if report['cache_hit'] else ''}")


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
                 lengths=None):
        self.num_rows = num_rows
        self.per_device_batch = per_device_batch
        self.world_size = world_size
        self.accumulation = accumulation
        self.seed = seed
        self.lengths = lengths
        self._epoch_cache: tuple[int, list[int]] | None = None

    @classmethod
    def for_run(cls, dataset, cfg: TrainConfig, world_size: int) -> "BatchPlan":
        """The plan of a run's ``train:`` section on ``world_size`` ranks."""
        return cls(len(dataset), cfg.per_device_batch_size, world_size, cfg.gradient_accumulation_steps, cfg.seed,
                   lengths=row_lengths(dataset) if cfg.group_by_length else None)

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.world_size * self.accumulation

    def steps_for_epochs(self, epochs: float) -> int:
        return max(1, math.ceil(epochs * self.num_rows / self.global_batch))

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
            if self.lengths is not None:
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


def identity(dataset) -> dict[str, Any]:
    """What a checkpoint records of the training rows it was trained on: their number and a hash of their tokens
    (every column, in order), so that a resume on other data, or the same file changed, is refused."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    digest = hashlib.sha256()
    for name in sorted(table.column_names):
        column = table[name]
        digest.update(name.encode())
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            digest.update(pc.list_value_length(column).to_numpy(zero_copy_only=False).astype("int64").tobytes())
            digest.update(pc.list_flatten(column).to_numpy(zero_copy_only=False).astype("int64").tobytes())
        else:
            digest.update(json.dumps(column.to_pylist(), default=str).encode())
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
