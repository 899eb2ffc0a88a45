"""Sequence parallelism (``parallel.sp_size``), DeepSpeed-Ulysses with torch's own collectives, and its ring
(``parallel.cp_size``, :mod:`hfsdp.parallel.ring`): the ranks of a sequence-parallel group (``sp`` consecutive ranks)
and of a ring train on the same rows, each on its share of every row's positions (:meth:`SequenceSplit.apply`: the
embeddings, norms, MLPs and the loss see the local positions only); around attention, an all-to-all trades a
group's split for a split of the heads (:func:`split_sdpa`), so that each rank attends over the group's positions
with ``heads/sp`` of the heads, then trades back; with a ring, those positions attend around it, over every other
group's keys and values. FSDP (1 or 2) shards the weights over every rank.

What keeps it exact: the targets are shifted over the whole row before it is split (position t predicts token t+1
even where t+1 is on the next rank), the position ids are the row's own (RoPE, and packed rows' restarts), packed
sequences attend each on its own over the whole row (their spans in row coordinates, from the packer or from where
the position ids restart), and the loss's counts are the global batch's. Rows are right-padded, so a causal kernel
over the whole row computes what the padding mask would for every real position; the padding added to make a row's
width a multiple of ``sp`` is unlabelled and attended by no real position.

Only forwards whose inputs carry a split (:data:`SPLIT`: training and eval batches) exchange anything: generation,
the start-up probes and any other forward run sdpa on this rank's own rows, as without sequence parallelism.
gloo has the all-to-all (``all_to_all_single`` and its autograd form), so CPU ranks rehearse it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX
from hfsdp.data.layout import SEGMENTS
from hfsdp.model.packed_attention import read_spans, sequence_sdpa, span_aware_mask
from hfsdp.parallel.ring import Ring, ring_attention

NAME = "hfsdp_split"
# The model input of a split micro-batch: its :class:`Exchange` (the group, and the rows' packed sequences).
SPLIT = "sequence_split"


@dataclass(frozen=True)
class Exchange:
    """What attention needs of a split micro-batch: the sequence-parallel group and its size (1: no Ulysses
    exchange), for packed rows each row's sequences as (start, end) positions of the whole row (None: one sequence a
    row), and the ring the positions the group holds attend around (:mod:`hfsdp.parallel.ring`; None: no ring)."""

    group: Any
    size: int
    segments: list[list[tuple[int, int]]] | None = None
    ring: Ring | None = None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk i of ``x``'s first dimension to rank i of ``group``, chunk i of the result from rank i (autograd: the
    backward is the reverse exchange)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def sequence_to_heads(x: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """``[rows, heads, local positions, dim]`` -> ``[rows, heads/sp, all positions, dim]``: this rank's share of the
    heads (the sp-th part, in order) over the whole rows."""
    rows, heads, local, dim = x.shape
    sp = exchange.size
    x = x.reshape(rows, sp, heads // sp, local, dim).transpose(0, 1)  # [head group, rows, heads/sp, local, dim]
    x = _all_to_all(x, exchange.group)  # [position chunk, rows, heads/sp, local, dim]
    return x.permute(1, 2, 0, 3, 4).reshape(rows, heads // sp, sp * local, dim)


def heads_to_sequence(x: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """The inverse for attention's output: ``[rows, all positions, heads/sp, dim]`` -> ``[rows, local positions,
    heads, dim]``."""
    rows, width, heads, dim = x.shape
    sp = exchange.size
    x = x.reshape(rows, sp, width // sp, heads, dim).transpose(0, 1)  # [position chunk, rows, local, heads/sp, dim]
    x = _all_to_all(x, exchange.group)  # [head group, rows, local, heads/sp, dim]
    return x.permute(1, 2, 0, 3, 4).reshape(rows, width // sp, sp * heads, dim)


def split_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' sdpa over whole rows for a split micro-batch (its inputs carry :data:`SPLIT`): with a
    sequence-parallel group, queries, keys and values exchanged to a split of the heads over the group's positions;
    causal attention over them (each packed sequence on its own), around the ring where there is one
    (:func:`hfsdp.parallel.ring.ring_attention`); the output exchanged back to the split of the positions. Without
    :data:`SPLIT`, sdpa on this rank's rows (:func:`hfsdp.model.packed_attention.sequence_sdpa`, which is
    transformers' own without packed segments)."""
    exchange = kwargs.pop(SPLIT, None)
    if exchange is None:
        return sequence_sdpa(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    kwargs.pop(SEGMENTS, None)  # the packer's spans are the exchange's
    ulysses = exchange.size > 1
    q, k, v = ((sequence_to_heads(t, exchange) for t in (query, key, value)) if ulysses else (query, key, value))
    # the mask transformers built is the local positions'; right-padded rows need none over the whole row (causal)
    if exchange.ring is not None:
        out = ring_attention(module, q, k, v, exchange.ring, exchange.segments, **kwargs)
    else:
        out, _ = sequence_sdpa(module, q, k, v, None, **kwargs,
                               **({SEGMENTS: exchange.segments} if exchange.segments is not None else {}))
    return (heads_to_sequence(out, exchange) if ulysses else out), None


def register() -> None:
    """Make :data:`NAME` an attention implementation transformers knows (its masks sdpa's, none for a split
    micro-batch, whose attention reads the rows' spans: :func:`hfsdp.model.packed_attention.span_aware_mask`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, split_sdpa)
    AttentionMaskInterface.register(NAME, span_aware_mask)


def use_split_attention(model) -> None:
    """Switch ``model`` (its attention sdpa, or hfsdp's packed sdpa: the rules refuse other kernels) to
    :data:`NAME`."""
    register()
    model.set_attn_implementation(NAME)
    read_spans(model, (SPLIT, SEGMENTS))


def segments_of(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each row's sequences as (start, end) positions, from where its position ids restart at 0 (packed rows)."""
    out = []
    for row in position_ids.tolist():
        starts = [t for t, p in enumerate(row) if p == 0] or [0]
        out.append(list(zip(starts, starts[1:] + [len(row)])))
    return out


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's share of every row: the ``rank``-th of ``size`` equal parts of its positions; ``group``: its
    sequence-parallel group of ``sp`` ranks (None with ``sp`` 1), which hold consecutive parts; ``ring``: the ring its
    group's parts attend around (None: no ring)."""

    size: int
    rank: int
    group: Any
    sp: int = 1
    ring: Ring | None = None

    @classmethod
    def of(cls, world, mesh) -> "SequenceSplit":
        """The split of ``world`` (a :class:`hfsdp.layout.degrees.World` that splits rows: ``cp x sp > 1``) over the
        ``cp`` and ``sp`` dimensions of the run's device mesh (:func:`hfsdp.parallel.mesh.device_mesh`)."""
        dims = world.dims
        ring = Ring(mesh["cp"].get_group(), dims.cp, dims.cp_rank(world.rank)) if dims.cp > 1 else None
        return cls(size=dims.token_split, rank=dims.token_share(world.rank),
                   group=mesh["sp"].get_group() if dims.sp > 1 else None, sp=dims.sp, ring=ring)

    def apply(self, batch, device):
        """The micro-batch ``batch`` (collated on the CPU, one row per sequence or packed rows, every logit kept)
        split to this rank's positions and moved to ``device``: the inputs, targets and label positions of its part
        (rows padded to a multiple of ``size`` positions first), the row's position ids, and the :class:`Exchange`
        attention needs. Its ``num_targets`` are its own part's labelled positions (they sum to the row's over the
        group); its ``lengths`` stay the rows' (the step counts tokens once per group)."""
        inputs = dict(batch.inputs)
        if "logits_to_keep" in inputs:
            raise ValueError("a sequence-parallel micro-batch keeps every logit (made with select_logits=False)")
        ids = inputs["input_ids"]
        rows, width = ids.shape
        padded = math.ceil(width / self.size) * self.size
        local = padded // self.size
        lo, hi = self.rank * local, (self.rank + 1) * local
        positions = inputs.get("position_ids")
        segments = inputs.pop(SEGMENTS, None)
        if positions is not None and segments is None:
            segments = segments_of(positions)
        # the padding's positions go on counting (no real position attends to them)
        if positions is None:
            positions = torch.arange(padded).expand(rows, padded)
        elif padded > width:
            positions = torch.cat([positions, torch.arange(width, padded).expand(rows, padded - width)], dim=1)

        def part(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
            return F.pad(t, (0, padded - t.size(1)), value=fill)[:, lo:hi].contiguous()

        inputs.pop("attention_mask", None)  # right padding: the causal kernel over the whole row (module docstring)
        inputs["input_ids"] = part(ids)
        inputs["position_ids"] = part(positions)
        inputs[SPLIT] = Exchange(self.group, self.sp, segments, self.ring)
        targets = part(batch.targets, fill=IGNORE_INDEX)
        labelled = targets.reshape(-1) != IGNORE_INDEX

        def move(value):
            return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value

        # ``packing`` maps whole rows back to their sequences, which a split row is not: the objectives that split
        # sum over tokens only (hfsdp.rules.parallel refuses the others)
        return replace(batch, inputs={k: move(v) for k, v in inputs.items()}, targets=move(targets),
                       num_targets=int(labelled.sum()), label_positions=move(labelled.nonzero().flatten()),
                       packing=None)
