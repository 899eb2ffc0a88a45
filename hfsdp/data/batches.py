"""Batches: which rows each optimizer step trains on, and the tensors the model gets of them.

Batching is a pure function of (seed, step): the global batch of optimizer step ``s`` is a fixed slice of a stream of
seeded per-epoch permutations (of a mixture of sources, :class:`Mixture`), and each rank takes its share
(:class:`BatchPlan`). Resuming at step ``s`` therefore neither replays nor skips a sample, and a run on N ranks sees
exactly the global batches of a single-process run. :func:`micro_batch` collates rows into what the model gets
(:func:`model_inputs`; packed rows keep attention inside each sample, which :func:`check_packed_attention` proves on
the sharded model at start-up).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX
from hfsdp.config.schema import DataConfig, TrainConfig
from hfsdp.errors import UserError


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
            # (an images column: each image's bytes)
            for part in (pc.list_value_length, pc.list_flatten):
                for batch in table.select_columns([name]).iter(batch_size=IDENTITY_CHUNK):
                    values = part(batch[name])
                    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
                        for value in values.to_pylist():
                            digest.update(value)
                    else:
                        digest.update(values.to_numpy(zero_copy_only=False).astype("int64").tobytes())
        else:
            digest.update(json.dumps(table[name].to_pylist(), default=str).encode())
    return {"train_rows": len(dataset), "train_fingerprint": digest.hexdigest()[:16]}


def is_packed(columns) -> bool:
    """Rows (a dataset's ``column_names``, a row, a batch) with ``position_ids`` are packed rows: several samples
    each, positions restarting at 0 where a sample begins. That is the contract of ``hfsdp_transform_dataset``
    (the packing plugin keeps it; any plugin may): hfsdp then keeps attention inside each sample
    (:func:`model_inputs`) and proves the model does before step 1 (:func:`check_packed_attention`)."""
    return "position_ids" in columns


# Per-token model inputs a row may carry besides its tokens (Gemma 3's processor marks its image tokens in
# token_type_ids; Qwen3-VL's in mm_token_type_ids).
PER_TOKEN_INPUTS = ("token_type_ids", "mm_token_type_ids")


def collate(rows: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch; padding has label -100 and attention mask 0."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long) if is_packed(rows[0]) else None
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
    for key in PER_TOKEN_INPUTS:  # a vision-language processor's (hfsdp.data.images.expand), padded with 0
        if key in rows[0]:
            batch[key] = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                batch[key][i, :len(r[key])] = torch.tensor(r[key])
    return batch


def left_padded(rows: list[tuple[list[int], dict[str, list]]], pad_id: int, width: int | None = None) -> dict[str, Any]:
    """Prompts (their token ids, and a dict of a vision-language processor's per-token inputs of each, as
    :func:`hfsdp.data.images.processed` gives them or a tokenized row holds them; empty for a text) padded on the
    left to ``width`` (default the longest) for generation: ``input_ids``, ``attention_mask`` and those inputs
    (padded with 0), as tensors."""
    width = width or max(len(ids) for ids, _ in rows)
    out: dict[str, list] = {"input_ids": [], "attention_mask": []}
    for ids, extras in rows:
        pad = width - len(ids)
        out["input_ids"].append([pad_id] * pad + ids)
        out["attention_mask"].append([0] * pad + [1] * len(ids))
        for key in PER_TOKEN_INPUTS:
            if key in extras:
                out.setdefault(key, []).append([0] * pad + list(extras[key]))
    return {key: torch.tensor(value) for key, value in out.items()}


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
    if is_packed(inputs):
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
    # No forward or backward: its gradient is 0 (an online objective's micro-step without signal), decided alike on
    # every rank for the same micro-step, as FSDP's collectives need.
    skip: bool = False
    # Sequences laid end to end in its rows (``hfsdp.data.layout``): where each lies; None: one sequence per row.
    packing: Any = None

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def per_sequence(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """Per-position ``values`` in the logits' layout (``[rows, positions]``, as ``targets``) with one sequence
        per row: a packed micro-batch's unpacked (each sequence from column 0, ``fill`` after it), others as they
        are. A loss that reads per-sequence values (a completion's log-prob) reads them through this."""
        return values if self.packing is None else self.packing.unpack(values, fill)

    def in_rows(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """The inverse of :meth:`per_sequence`: values with one sequence per row in the logits' layout."""
        return values if self.packing is None else self.packing.pack(values, self.targets.shape, fill)

    @property
    def sequence_targets(self) -> torch.Tensor:
        """``targets`` with one sequence per row (:meth:`per_sequence`)."""
        return self.per_sequence(self.targets, IGNORE_INDEX)

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


#: The attribute under which a transform that packs samples (``hfsdp_transform_dataset``; the packing plugin) may
#: leave on the train split it returns how many rows next-fit in order would have needed: the data report keeps it
#: (``meta["next_fit_rows"]``, cached with the rows) and :func:`padding_report` shows it beside the rows it made.
NEXT_FIT_ROWS = "hfsdp_next_fit_rows"


def padding_report(dataset, batch_size: int, seed: int, grouped: bool = False, next_fit: int | None = None) -> str:
    """Padding of the training micro-batches; for packed rows (with ``position_ids``) also before packing, and how
    many rows ``next_fit`` in order would have needed, if known."""
    import numpy as np
    import pyarrow.compute as pc

    rows = row_lengths(dataset)
    after = padding_fraction(rows, batch_size, seed, grouped)
    if not is_packed(dataset.column_names):
        return f"padding {after:.1%}" + (" (grouped by length)" if grouped else "")
    table = dataset.with_format("arrow")
    flat = pc.list_flatten(table["position_ids"]).to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(flat == 0)
    samples = np.diff(np.append(starts, flat.size))
    before = padding_fraction(samples, batch_size, seed)
    compared = f"; next-fit: {next_fit}" if next_fit is not None else ""
    return f"padding {before:.1%} -> {after:.1%} ({samples.size} samples packed into {rows.size} rows{compared})"


def eval_batches(num_rows: int, per_device_batch: int, world_size: int, rank: int) -> list[list[int] | None]:
    """This rank's eval batches. Every rank gets the same number (FSDP collectives need all ranks in step);
    ``None`` marks a filler batch that carries no loss."""
    mine = list(range(rank, num_rows, world_size))
    per_rank = math.ceil(math.ceil(num_rows / world_size) / per_device_batch)
    batches: list[list[int] | None] = [mine[i * per_device_batch:(i + 1) * per_device_batch] for i in range(per_rank)]
    return [b if b else None for b in batches]
