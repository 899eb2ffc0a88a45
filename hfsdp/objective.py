"""Training objectives: :class:`TokenCrossEntropy` (the default), or what a plugin's ``hfsdp_objective`` returns.

The loop (``hfsdp.run.loop``) stays one loop: each micro-batch comes from :meth:`Objective.micro_batch`, its loss from
:meth:`Objective.loss` (summed over the micro-batch's ``num_targets`` units), and hfsdp divides it by the units of the
whole global batch, as it does for tokens, so a step on N ranks computes the gradient of one process. After the
model is sharded, hfsdp gives the objective its micro-batches' layout (:meth:`Objective.lay_out`: a
:class:`MicroBatchLayout`, packed or split over a sequence-parallel group), then :meth:`Objective.prepare` runs once
(before training, the eval at start and a resume's restore); :meth:`Objective.take_metrics` turns what the loss calls
recorded into metrics, after every step and every eval.

:class:`PreferenceObjective` is the shared part of pairwise preference losses (DPO in ``hfsdp.builtin.dpo.loss``; a
third-party ORPO or SimPO): rows of the built-in ``preference`` format become one micro-batch of the chosen rows
followed by the rejected rows (one forward, so the FSDP collectives stay in lock-step), ``num_targets`` is the number
of pairs, and :meth:`PreferenceObjective.completion_logps` gives each row's summed completion log-probability.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hfsdp import IGNORE_INDEX, REJECTED_PREFIX
from hfsdp.data.batches import PER_TOKEN_INPUTS, BatchPlan, MicroBatch, micro_batch, micro_batches
from hfsdp.data.images import IMAGES_COLUMN
from hfsdp.data.layout import packed_micro_batch
from hfsdp.errors import ConfigError
from hfsdp.model.token_loss import token_loss_sum



@dataclass(frozen=True)
class FrozenModel:
    """A model an objective runs beside the trained one, frozen (no gradients, no optimizer state), as ``hfsdp plan``
    counts it (:meth:`Objective.frozen_models`): its name (as the config gives it), its transformers config, the
    dtype it is loaded in, whether FSDP2 shards it over the ranks of a run that has several (else each rank holds it
    whole), and whether its logits over the micro-batch stay alive through the trained model's forward and
    backward."""

    name: str
    model_config: Any
    dtype: str
    sharded_by_fsdp2: bool = True
    keeps_logits: bool = True


@dataclass(frozen=True)
class Sampling:
    """What an objective that samples its own completions generates in a step, as ``hfsdp plan`` counts it
    (:meth:`Objective.sampling`): completions of at most ``new_tokens`` tokens after prompts of at most
    ``data.max_seq_len`` tokens, all at once with the KV cache, then trained on as rows of both lengths;
    ``whole_global_batch``: every rank generates every completion of the global batch (in lock-step, as FSDP's
    forwards need), else only those of its own micro-batches."""

    new_tokens: int
    whole_global_batch: bool = True


@dataclass(frozen=True)
class MicroBatchLayout:
    """How an objective lays out its micro-batches (:meth:`Objective.collate`), given to it once by hfsdp
    (:meth:`Objective.lay_out`). ``pack_len``: None, one sequence per row; else packed rows of at most that many
    tokens (0: no limit; hook ``hfsdp_pack_micro_batches``), laid out by what the model's attention costs per
    (query, key) pair of a row in a token's linear cost (``pack_attention``, ``layout_cost``; 0 where it attends
    each packed sequence on its own), the inputs naming each row's sequences for it where ``pack_segments``
    (``hfsdp.model.packed_attention``). ``sequence_split``: with ``parallel.sp_size > 1`` (next-token training
    only), this rank's share of every row's positions (:class:`hfsdp.parallel.sequence.SequenceSplit`). ``images``:
    for a vision-language model, what makes a micro-batch's pixel inputs from its rows' images
    (:class:`hfsdp.data.images.PixelInputs`)."""

    pack_len: int | None = None
    pack_attention: float = 0.0
    pack_segments: bool = False
    sequence_split: Any = None
    images: Any = None


class Objective:
    """A training objective. Subclasses implement :meth:`loss`; the other methods have working defaults."""

    #: metric names :meth:`take_metrics` reports that the progress bar shows (by their last path part).
    progress_metrics: tuple[str, ...] = ()
    #: sequences :meth:`micro_batch` forwards per dataset row (``hfsdp plan`` traces a micro-batch that many times
    #: larger; a loss other than :class:`TokenCrossEntropy` is planned with the full logits, as it computes them).
    sequences_per_row: int = 1
    #: its loss reads per-sequence values through ``MicroBatch.per_sequence`` (or sums over tokens only), so its
    #: micro-batches may be packed (hook ``hfsdp_pack_micro_batches``); :meth:`micro_batch` then packs them.
    packs_micro_batches: bool = False
    #: how its micro-batches are laid out (packed, split over a sequence-parallel group): given once by hfsdp,
    #: before :meth:`prepare` (:meth:`lay_out`); by default one sequence per row, whole.
    layout: MicroBatchLayout = MicroBatchLayout()

    def lay_out(self, layout: MicroBatchLayout) -> None:
        """Lay out its micro-batches as ``layout`` says (:meth:`collate` reads it): hfsdp calls it once, after the
        model is sharded and before :meth:`prepare`."""
        self.layout = layout

    # The layout's fields, read-only, as objectives written before MicroBatchLayout read them.
    pack_len = property(lambda self: self.layout.pack_len)
    pack_attention = property(lambda self: self.layout.pack_attention)
    pack_segments = property(lambda self: self.layout.pack_segments)
    sequence_split = property(lambda self: self.layout.sequence_split)

    def frozen_models(self) -> list[FrozenModel]:
        """The frozen models it runs beside the trained one (e.g. a teacher), from their configs only (no weights
        load): ``hfsdp plan`` adds their bytes on each rank to every row's peak."""
        return []

    def sampling(self) -> Sampling | None:
        """What it generates each step (an online objective, e.g. GRPO), for ``hfsdp plan``: the KV cache of that
        generation joins every row's peak, and the micro-batch is traced with the completions' length added; the
        default is none."""
        return None

    def micro_batch(self, rows: list[dict[str, Any]], pad_id: int, device, select_logits: bool) -> MicroBatch:
        """The micro-batch of these dataset rows (laid out as :attr:`layout` says); its ``num_targets`` is what
        :meth:`loss` sums over."""
        return self.collate(rows, [[i] for i in range(len(rows))], pad_id, device, select_logits)

    def collate(self, sequences: list[dict[str, list[int]]], items: list[list[int]], pad_id: int, device,
                select_logits: bool) -> MicroBatch:
        """The micro-batch of ``sequences`` (``input_ids``, ``labels``): one per row, or, with the layout's
        ``pack_len``, laid end to end in packed rows (``items``: the sequences that share a row, e.g. a pair's two);
        with its ``sequence_split``, collated on the CPU, then this rank's share of its positions moved to
        ``device``."""
        layout = self.layout
        split = layout.sequence_split
        made_on = "cpu" if split is not None else device
        if layout.pack_len is None:
            batch = micro_batch(sequences, pad_id, made_on, select_logits)
        else:
            batch = packed_micro_batch(sequences, items, layout.pack_len or None, pad_id, made_on, select_logits,
                                       layout.pack_attention, layout.pack_segments)
        if layout.images is not None:  # (never packed nor split: hfsdp.rules.vision)
            from accelerate.utils import send_to_device

            batch.inputs.update(send_to_device(layout.images(sequences), device, non_blocking=True))
        return batch if split is None else split.apply(batch, device)

    def check_rows(self, splits: dict[str, Any]) -> None:
        """Before any weight loads, every rank: raise a :class:`~hfsdp.errors.UserError` naming the first row of the
        tokenized ``splits`` (``train``, maybe ``eval``) that this objective cannot use (by default none)."""

    def batch_plan(self, dataset, train_config, world_size: int, mixture) -> BatchPlan:
        """Which rows each optimizer step trains on (a pure function of seed and step; its ``steps_for_epochs`` is
        the run's length)."""
        return BatchPlan.for_run(dataset, train_config, world_size, mixture)

    def step_batches(self, model, dataset, plan: BatchPlan, step: int, rank: int, pad_id: int, device,
                     select_logits: bool) -> list[MicroBatch]:
        """This rank's micro-batches of optimizer step ``step`` (by default :meth:`micro_batch` of the plan's rows;
        an objective that generates its samples, as GRPO, makes them here). Collective: every rank calls it for every
        step."""
        return micro_batches(dataset, plan, step, rank, pad_id, device, select_logits, self.micro_batch)

    def prepare(self, model, accelerator, splits: dict[str, Any], cache_dir, model_path: str) -> dict[str, Any]:
        """Once, every rank, after sharding and before training: return the splits (``train``, maybe ``eval``), e.g.
        with columns added. Collective: every rank must run the same forwards."""
        return splits

    def evaluate(self, model, dataset, accelerator, pad_id: int, select_logits: bool) -> dict[str, float] | None:
        """An eval of its own on the eval split (collective; e.g. GRPO's mean reward of generated completions), or
        None for hfsdp's: the mean of :meth:`loss` over the split's batches, with :meth:`eval_metrics`."""
        return None

    def start_step(self, accelerator, micro: list[MicroBatch]) -> None:
        """Before the forwards of a training step (``micro``: this rank's micro-batches of the global batch) and of
        each eval micro-batch: e.g. to sum over the ranks a count that :meth:`loss` normalises a term by (a token
        mean over the global batch). Collective when it communicates: every rank calls it at the same points."""

    def loss(self, model, batch: MicroBatch) -> torch.Tensor:
        """The micro-batch's summed loss (a 0-dim tensor with its graph); record metrics here, on the device."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss(model, batch)")

    def __call__(self, model, batch: MicroBatch) -> torch.Tensor:  # the loop's ``run.loss(model, batch)``
        return self.loss(model, batch)

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        """The metrics recorded since the last call, over all ranks (collective), each name with ``prefix``."""
        return {}

    def step_sums(self) -> dict[str, Any] | None:
        """This rank's sums that a training step's metrics are made of (numbers or 0-dim tensors, the same names on
        every rank), taken (recorded afresh after), for the step's own all-reduce to carry: the gradient norm's, so
        the metrics cost no collective of their own. The step then calls :meth:`metrics_of` with their totals over
        all ranks instead of :meth:`take_metrics`. None (the default): the step calls :meth:`take_metrics`, which
        reduces them itself. Evals always call :meth:`take_metrics`."""
        return None

    def metrics_of(self, totals: dict[str, float]) -> dict[str, float]:
        """A training step's metrics from the totals over all ranks of what :meth:`step_sums` returned."""
        return {}

    def eval_metrics(self, loss: float, targets: int) -> dict[str, float]:
        """An eval's metrics from its mean loss over ``targets`` units (before :meth:`take_metrics`'s)."""
        return {"eval_loss": loss}


# The steps whose micro-batches :func:`micro_batch_padding` measures.
PADDING_STEPS = 32


def micro_batch_padding(objective: Objective, dataset, plan: BatchPlan, steps: int, pad_id: int,
                        select_logits: bool) -> str:
    """The share of padding in rank 0's micro-batches of the first steps (at most :data:`PADDING_STEPS`), each made
    one sequence per row and packed as the objective's layout packs them (whole rows: no sequence split), by copies
    of it: what packing saves on these rows, said at start."""
    steps, pack_len = min(steps, PADDING_STEPS), objective.layout.pack_len
    shares, packed = [], 0
    for layout in (MicroBatchLayout(), replace(objective.layout, sequence_split=None)):
        measured = copy.copy(objective)
        measured.lay_out(layout)
        tokens = positions = 0
        for step in range(steps):
            for m in range(plan.accumulation):
                batch = measured.micro_batch([dataset[i] for i in plan.rows(step, m, 0)], pad_id,
                                             torch.device("cpu"), select_logits)
                tokens, positions = tokens + batch.tokens, positions + batch.inputs["input_ids"].numel()
                packed += batch.packing is not None
        shares.append(1 - tokens / max(positions, 1))
    total = steps * plan.accumulation
    others = ", the others cheaper one sequence a row" if packed < total else ""
    return (f"padding {shares[0]:.1%} -> {shares[1]:.1%} of positions ({packed} of {total} micro-batches packed in "
            f"{rows_said(pack_len)}{others}; rank 0's first {steps} steps)")


def rows_said(pack_len: int) -> str:
    """The packed rows a ``pack_len`` asks for, in words."""
    return (f"the cheapest rows of up to {pack_len} tokens (or their longest item)" if pack_len
            else "the cheapest rows")


class TokenCrossEntropy(Objective):
    """The default objective: the summed next-token cross entropy of the labelled tokens, computed by ``loss_sum``
    (``hfsdp.model.token_loss``: the chunked loss, or the plain one from the full logits). Its eval adds the perplexity."""

    packs_micro_batches = True  # a sum over labelled tokens, wherever they lie

    def __init__(self, loss_sum=token_loss_sum):
        self.loss_sum = loss_sum

    def loss(self, model, batch: MicroBatch) -> torch.Tensor:
        return self.loss_sum(model, batch)

    def eval_metrics(self, loss: float, targets: int) -> dict[str, float]:
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(targets)}


def target_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of its target in float32 (0 where labelled ``IGNORE_INDEX``): the target's
    logit minus the logits' logsumexp, one row at a time, as TRL's ``selective_log_softmax`` (its transients one
    row's logits, not the batch's). On a CPU that is 16 times closer to a float64 computation than ``log_softmax``
    (whose float32 sum over a 49,152-token vocabulary is about 8e-7 off: 1e-5 on a log-prob), and it keeps no
    log-softmax for backward."""
    logits = logits.float()
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    normaliser = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return (picked - normaliser) * (targets != IGNORE_INDEX)


def adapters_disabled(unwrapped):
    """The reference's context for a model with adapters (peft's ``disable_adapter``: the base model), else none."""
    disable = getattr(unwrapped, "disable_adapter", None)
    return disable() if disable is not None else contextlib.nullcontext()


def means_of(totals: dict[str, float], unit: str, prefix: str = "") -> dict[str, float]:
    """Each of ``totals`` (summed over all ranks) divided by the total count ``totals[unit]`` (NaN where no rank
    counted any): a metric per unit (a pair, a token) whatever the ranks' shares."""
    count = totals.get(unit, 0)
    return {f"{prefix}{name}": total / count if count else math.nan for name, total in totals.items() if name != unit}


def means_over_ranks(accelerator, sums: dict[str, Any], unit: str, prefix: str = "") -> dict[str, float]:
    """:func:`means_of` the ``sums`` of this rank (of a step or an eval) summed over all ranks. Collective: every
    rank calls it with the same keys."""
    from hfsdp.parallel.world import all_sum

    names = [unit, *(k for k in sums if k != unit)]
    return means_of(dict(zip(names, all_sum(accelerator, [float(sums.get(k, 0)) for k in names]))), unit, prefix)


def one_plugin(host, hook: str, doing: str, **kwargs) -> tuple[str, Any] | None:
    """(plugin, result) of the one enabled plugin that returns something from ``hook``, or None; a ConfigError
    naming them where two do (``doing``: what they do, in the message)."""
    returned = host.call(hook, **kwargs)
    if len(returned) > 1:
        raise ConfigError([("plugins", f"two plugins {doing}: {', '.join(name for name, _ in returned)}; enable "
                                       "one of them")])
    return returned[0] if returned else None


def objective_of(host, config, tokenizer, cache_dir=None) -> Objective | None:
    """The objective an enabled plugin returns from ``hfsdp_objective``, or None (next-token cross entropy)."""
    returned = one_plugin(host, "hfsdp_objective", "replace the training objective", config=config,
                          tokenizer=tokenizer, cache_dir=cache_dir)
    if returned is None:
        return None
    plugin, objective = returned
    if not isinstance(objective, Objective):
        raise ConfigError([(f"plugins.{plugin}", "hfsdp_objective must return an hfsdp.objective.Objective or None, "
                                                 f"got {type(objective).__name__}")])
    return objective


def micro_batch_packing(host, config, objective: Objective) -> int | None:
    """The most tokens of a packed row when an enabled plugin packs micro-batches (``hfsdp_pack_micro_batches``),
    or None; a ConfigError (before any weight loads) when two do, or when ``objective`` cannot read packed ones."""
    returned = one_plugin(host, "hfsdp_pack_micro_batches", "pack micro-batches", config=config)
    if returned is None:
        return None
    plugin, pack_len = returned
    if not objective.packs_micro_batches:
        raise ConfigError([("plugins", f"{plugin} packs micro-batches, but the objective {type(objective).__name__} "
                                       "reads one sequence per row (its packs_micro_batches is False): remove "
                                       f"{plugin} from plugins")])
    return int(pack_len)


def _sequence(row: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The chosen (``prefix`` empty) or the rejected sequence of a ``preference`` row: its tokens, labels and a
    vision-language processor's per-token inputs, with the row's images (the prompt's, which both share)."""
    sequence = {k: row[prefix + k] for k in ("input_ids", "labels", *PER_TOKEN_INPUTS) if prefix + k in row}
    if IMAGES_COLUMN in row:
        sequence[IMAGES_COLUMN] = row[IMAGES_COLUMN]
    return sequence


@dataclass
class PairBatch(MicroBatch):
    """A micro-batch of preference pairs: rows ``0..pairs-1`` are the chosen sequences, ``pairs..2*pairs-1`` the
    rejected ones of the same pairs. ``num_targets`` is ``pairs`` (0 for a filler batch)."""

    pairs: int = 0
    weights: torch.Tensor | None = None  # 1 for each pair, 0 in a filler batch (eval: the ranks' batch counts agree)
    completion_tokens: torch.Tensor | None = None  # labelled tokens of each of the 2*pairs rows
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # the rows' per-pair numbers (e.g. reference logps)

    def make_filler(self) -> None:
        super().make_filler()
        self.weights = torch.zeros_like(self.weights)


class PreferenceObjective(Objective):
    """Pairwise preference losses over ``preference`` rows; subclasses implement :meth:`loss` with
    :meth:`completion_logps` and :meth:`record`."""

    progress_metrics = ("rewards/margins", "rewards/accuracy")
    sequences_per_row = 2  # the chosen and the rejected completion
    packs_micro_batches = True  # the log-probs through completion_logps, a pair's two sequences in one packed row

    def __init__(self):
        self._sums: dict[str, torch.Tensor] = {}

    def micro_batch(self, rows, pad_id, device, select_logits) -> PairBatch:
        chosen, rejected = ([_sequence(r, prefix) for r in rows] for prefix in ("", REJECTED_PREFIX))
        batch = self.collate(chosen + rejected, [[i, len(rows) + i] for i in range(len(rows))], pad_id, device,
                             select_logits)
        numbers = [k for k, v in rows[0].items() if isinstance(v, float)]
        return PairBatch(**vars(batch) | {"num_targets": len(rows)}, pairs=len(rows),
                         weights=torch.ones(len(rows), device=device),
                         completion_tokens=(batch.sequence_targets != IGNORE_INDEX).sum(1),
                         values={k: torch.tensor([r[k] for r in rows], dtype=torch.float32, device=device)
                                 for k in numbers})

    @staticmethod
    def completion_logps(model, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected): each pair's summed log-probability of its completion tokens, in float32."""
        logps = batch.per_sequence(target_logps(model(**batch.inputs).logits, batch.targets)).sum(1)
        return logps[:batch.pairs], logps[batch.pairs:]

    def record(self, batch: PairBatch, **per_pair: torch.Tensor) -> None:
        """Add these per-pair values (detached, summed over the batch's pairs) to the metrics of this step or eval."""
        self._sums["pairs"] = self._sums.get("pairs", 0) + batch.weights.sum()
        for name, values in per_pair.items():
            self._sums[name] = self._sums.get(name, 0) + (values.detach().float() * batch.weights).sum()

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        metrics, self._sums = means_over_ranks(accelerator, self._sums, "pairs", prefix), {}
        return metrics

    def step_sums(self) -> dict[str, Any]:
        sums, self._sums = self._sums, {}
        return sums

    def metrics_of(self, totals: dict[str, float]) -> dict[str, float]:
        return means_of(totals, "pairs")
