"""Packed layouts: sequences laid end to end in rows, and the way back to one sequence per row.

:func:`best_fit_decreasing` decides which items (a sequence, or the sequences that must share a row: a pair's chosen
and rejected) go in which row: the longest first, each into the fullest row it fits (a new row if none), so that
fewer rows hold them than next-fit in order; a pure function of the lengths (ties keep the items' order), so every
rank and every resume packs alike.

:func:`packed_micro_batch` makes the micro-batch of such rows: ``position_ids`` restarting at 0 for every sequence
(the model then keeps attention inside each, :func:`hfsdp.data.batches.model_inputs`), the first token of every
sequence unlabelled (it would be predicted from the sequence before it), so the labelled positions are exactly
those of the sequences one per row. Its :class:`Packing` maps any per-position value of the packed rows (a log-prob,
an entropy, a target) back to one sequence per row (:meth:`hfsdp.data.batches.MicroBatch.per_sequence`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from hfsdp import IGNORE_INDEX

# The model input of a packed micro-batch (with ``segments``): for each row, its sequences' (start, end) positions
# (what :mod:`hfsdp.model.packed_attention` runs one at a time).
SEGMENTS = "packed_segments"


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices whose lengths sum to at most ``capacity`` each (an item longer than it: a bin of its
    own), longest item first, each into the fullest bin it fits; each bin's items in their original order, the bins
    in the order they were opened."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted: the fullest bin that fits is the first >= n
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if n <= capacity and at < len(free):
            room, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (room - n, b))
        else:
            bins.append([i])
            if n < capacity:
                bisect.insort(free, (capacity - n, len(bins) - 1))
    return [sorted(b) for b in bins]


@dataclass
class Packing:
    """Where each sequence of a packed micro-batch lies: ``index`` ``[sequences, longest]`` holds, for position
    ``t`` of sequence ``s``, its flat index in the logits' layout (``[rows, positions]`` flattened), or ``slots``
    (one past the end) where the sequence has no position ``t`` or the logits skip it; ``last``: each sequence's last
    token that is not the pad token (the first if all are: where transformers' sequence-classification models pool
    a row), a flat index in the ``[rows, width]`` layout of the inputs."""

    index: torch.Tensor
    last: torch.Tensor
    slots: int

    def unpack(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """``values`` ``[rows, positions]`` (the logits' layout) as ``[sequences, longest]``, ``fill`` elsewhere."""
        flat = torch.cat([values.reshape(-1), values.new_full((1,), fill)])
        return flat[self.index]

    def pack(self, values: torch.Tensor, shape, fill: float = 0) -> torch.Tensor:
        """The inverse of :meth:`unpack`: ``values`` ``[sequences, longest]`` in the logits' layout ``shape``."""
        flat = values.new_full((self.slots + 1,), fill)
        flat[self.index.reshape(-1)] = values.reshape(-1)
        return flat[:self.slots].view(shape)


def pack_rows(sequences: list[dict[str, list[int]]], bins: list[list[int]],
              items: list[list[int]]) -> tuple[list[dict[str, list[int]]], list[tuple[int, int, int]]]:
    """The packed rows of ``sequences`` (``input_ids``, ``labels``) for ``bins`` of ``items``, and where each
    sequence went: ``(row, offset, length)``."""
    rows, places = [], [(0, 0, 0)] * len(sequences)
    for r, b in enumerate(bins):
        row: dict[str, list[int]] = {"input_ids": [], "position_ids": [], "labels": []}
        for item in b:
            for s in items[item]:
                seq = sequences[s]
                n = len(seq["input_ids"])
                places[s] = (r, len(row["input_ids"]), n)
                row["input_ids"].extend(seq["input_ids"])
                row["position_ids"].extend(range(n))
                row["labels"].extend([IGNORE_INDEX] + list(seq["labels"][1:]))
        rows.append(row)
    return rows, places


def layout_cost(widths: list[int], attention: float) -> float:
    """What a forward of rows of these widths (padding included) costs, in a token's linear cost: each position one,
    plus ``attention`` per (query, key) pair of a row (an attention that computes a row's whole square: sdpa or eager
    with a mask; 0 for one that computes each packed sequence's own, as flash attention's variable-length kernels)."""
    return sum(w + attention * w * w for w in widths)


def cheapest_rows(lengths: list[int], capacity: int | None, attention: float) -> list[list[int]]:
    """The bins of :func:`best_fit_decreasing` whose rows cost least (:func:`layout_cost`, each row as wide as the
    widest): of rows of at most ``k`` times the longest item, for every ``k`` up to one row of all (none wider than
    ``capacity``, unless an item is; None: no limit)."""
    longest, total = max(lengths), sum(lengths)
    best: tuple[float, list[list[int]]] | None = None
    for k in range(1, len(lengths) + 1):
        width = max(longest, min(k * longest, capacity or k * longest))
        bins = best_fit_decreasing(lengths, width)
        cost = layout_cost([max(sum(lengths[i] for i in b) for b in bins)] * len(bins), attention)
        if best is None or cost < best[0]:
            best = (cost, bins)
        if width >= min(total, capacity or total):  # wider rows hold the same bins: one row of all, or the limit
            break
    return best[1]


def packed_micro_batch(sequences: list[dict[str, list[int]]], items: list[list[int]], capacity: int | None,
                       pad_id: int, device, select_logits: bool, attention: float = 0.0, segments: bool = False):
    """The micro-batch of ``sequences`` (``input_ids``, ``labels``) packed in the rows that cost least
    (:func:`cheapest_rows`: at most ``capacity`` tokens, or the longest item, if longer; None: no limit), ``items``
    (lists of sequence indices) never split over rows; its ``packing`` maps the rows back to the sequences, its
    ``lengths`` are the sequences'. Where those rows would cost more than one sequence a row (:func:`layout_cost`
    with ``attention``: little padding to save, and rows twice as wide whose masked attention computes the whole
    square), the micro-batch is one sequence a row, without ``packing``: the same values either way. ``segments``:
    the inputs name each row's sequences (:data:`SEGMENTS`), for an attention that runs them one at a time."""
    from hfsdp.data.batches import micro_batch

    lengths = [sum(len(sequences[s]["input_ids"]) for s in item) for item in items]
    bins = cheapest_rows(lengths, capacity, attention)
    widest = max(len(s["input_ids"]) for s in sequences)
    row_width = max(sum(lengths[i] for i in b) for b in bins)
    if layout_cost([row_width] * len(bins), attention) > layout_cost([widest] * len(sequences), attention):
        return micro_batch(sequences, pad_id, device, select_logits)
    rows, places = pack_rows(sequences, bins, items)
    batch = micro_batch(rows, pad_id, device, select_logits)
    lasts = [next((t for t in reversed(range(len(seq["input_ids"]))) if seq["input_ids"][t] != pad_id), 0)
             for seq in sequences]
    batch.packing = packing_of(places, lasts, batch.inputs, batch.targets.shape, device)
    if segments:
        spans: list[list[tuple[int, int]]] = [[] for _ in rows]
        for r, offset, n in sorted(places):
            spans[r].append((offset, offset + n))
        batch.inputs[SEGMENTS] = spans
    batch.lengths = [n for _, _, n in places]
    return batch


def packing_of(places: list[tuple[int, int, int]], lasts: list[int], inputs: dict[str, Any], shape,
               device) -> Packing:
    """The :class:`Packing` of sequences at ``places`` (``lasts``: the position in each of its :attr:`Packing.last`
    token) in rows whose logits have ``shape`` (``[rows, kept]``: ``inputs``' ``logits_to_keep`` positions, or every
    one)."""
    rows, kept = shape
    width = inputs["input_ids"].size(1)
    keep = inputs.get("logits_to_keep")
    column = torch.arange(width)  # the logits' column of each position, -1 where not kept
    if keep is not None:
        column = torch.full((width,), -1, dtype=torch.long)
        column[keep.cpu()] = torch.arange(kept)
    slots = rows * kept
    longest = max(n for _, _, n in places)
    index = torch.full((len(places), longest), slots, dtype=torch.long)
    for s, (r, offset, n) in enumerate(places):
        cols = column[offset:offset + n]
        index[s, :n] = torch.where(cols >= 0, r * kept + cols, slots)
    last = torch.tensor([r * width + offset + t for (r, offset, _), t in zip(places, lasts)], dtype=torch.long)
    return Packing(index=index.to(device), last=last.to(device), slots=slots)
