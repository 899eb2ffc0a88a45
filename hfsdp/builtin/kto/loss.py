"""The KTO objective of plugin ``kto`` (:mod:`hfsdp.builtin.kto`): TRL 1.16 ``KTOTrainer``'s loss
(``loss_type="kto"``) on ``unpaired`` rows.

With ``r = log pi(y|x) - log ref(y|x)`` (summed completion log-probs) and the KL estimate ``z``, a desirable row's loss
is ``desirable_weight * (1 - sigmoid(beta (r - z)))``, an undesirable row's ``undesirable_weight * (1 - sigmoid(beta
(z - r)))``; the step's loss is the mean over the global batch's rows (hfsdp's normalisation, rows as the units).

The KL estimate is TRL's: each row has a KL row, its prompt with the completion of the row before it (the first row
of a chunk takes the chunk's last completion), the completions rotated by one within consecutive chunks of the
split in data order (:func:`with_kl_rows`); ``z`` is the mean of ``log pi - log ref`` of the KL rows of the
micro-step over all ranks, at least 0, without gradient. TRL rotates within chunks of its per-device batch and
requires sequential sampling, so that a batch's KL rows mismatch its own completions; hfsdp's chunks are the global
batch (``per_device_batch_size`` x ranks x accumulation: TRL's chunks on one process without accumulation, and the
same rows on 1 process as on 2 ranks) and its plan shuffles rows, so that a step's KL rows pair its prompts with
other completions of the data set.

Each row and its KL row go through the model in one forward (the rows, then their KL rows: a
:class:`~hfsdp.objective.PairBatch` whose second half is the KL rows), and the reference log-probs of both come from
the routes DPO uses too (:class:`~hfsdp.builtin.reference_model.routes.ReferenceRoutes`: the base with the adapters
disabled, or computed once and cached as the columns ``ref_logps`` and ``ref_KL_logps``, TRL's names).

Metrics (TRL's names and means: a reward or log-prob over the desirable, or undesirable, rows of the step):
``rewards/chosen`` and ``rewards/rejected`` (``beta * r``), ``rewards/margins`` (their difference, where the step
has both), ``logps/chosen`` and ``logps/rejected``, and ``kl`` (``z``, the mean over the step's micro-steps). A
step without desirable (or undesirable) rows logs no chosen (or rejected) metrics, as TRL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.reference_model.routes import ReferenceRoutes
from hfsdp.objective import PairBatch

if TYPE_CHECKING:
    from hfsdp.builtin.kto.schema import KtoSection

KL_IDS, KL_LABELS = "KL_input_ids", "KL_labels"  # a row's KL row: its prompt, another row's completion
REFERENCE_COLUMNS = ("ref_logps", "ref_KL_logps")  # TRL's names


@dataclass
class KtoBatch(PairBatch):
    """A :class:`PairBatch` whose rows ``pairs..2*pairs-1`` are the KL rows of rows ``0..pairs-1``;
    ``desirable``: each row's label."""

    desirable: torch.Tensor | None = None


def with_kl_rows(split, chunk: int, max_len: int):
    """``split`` with each row's KL row (:data:`KL_IDS`, :data:`KL_LABELS`): its prompt and the completion of the row
    before it within consecutive chunks of ``chunk`` rows (the first takes the chunk's last), cut to ``max_len``
    tokens (keeping the start), as TRL's ``KL_completion_ids`` and its collator."""

    def add(batch):
        starts = [next(i for i, t in enumerate(labels) if t != IGNORE_INDEX) for labels in batch["labels"]]
        ids = batch["input_ids"]
        partners = [len(ids) - 1] + list(range(len(ids) - 1))
        kl_ids, kl_labels = [], []
        for i, j in enumerate(partners):
            completion = ids[j][starts[j]:]
            kl_ids.append((ids[i][:starts[i]] + completion)[:max_len])
            kl_labels.append(([IGNORE_INDEX] * starts[i] + completion)[:max_len])
        return {KL_IDS: kl_ids, KL_LABELS: kl_labels}

    return split.map(add, batched=True, batch_size=chunk, keep_in_memory=True)


class KTO(ReferenceRoutes):
    plugin = "kto"
    reference_columns = REFERENCE_COLUMNS
    units = "rows"
    progress_metrics = ("rewards/margins", "kl")

    def __init__(self, section: KtoSection, reference: str, config, tokenizer):
        super().__init__(section, reference, config, tokenizer)
        self.accelerator = None

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        self.accelerator = accelerator
        cfg = self.config.train
        chunk = cfg.per_device_batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes
        splits = {name: with_kl_rows(split, chunk, self.config.data.max_seq_len) for name, split in splits.items()}
        return super().prepare(model, accelerator, splits, cache_dir, model_path)

    def micro_batch(self, rows, pad_id, device, select_logits) -> KtoBatch:
        matched = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
        kl = [{"input_ids": r[KL_IDS], "labels": r[KL_LABELS]} for r in rows]
        batch = self.collate(matched + kl, [[i, len(rows) + i] for i in range(len(rows))], pad_id, device,
                             select_logits)
        return KtoBatch(**vars(batch) | {"num_targets": len(rows)}, pairs=len(rows),
                        weights=torch.ones(len(rows), device=device),
                        completion_tokens=(batch.sequence_targets != IGNORE_INDEX).sum(1),
                        values={k: torch.tensor([r[k] for r in rows], dtype=torch.float32, device=device)
                                for k in REFERENCE_COLUMNS if k in rows[0]},
                        desirable=torch.tensor([bool(r["label"]) for r in rows], device=device))

    def kl_estimate(self, kl_ratios: torch.Tensor, weights: torch.Tensor) -> float:
        """The mean KL-row log-ratio of this micro-step over all ranks (collective), at least 0."""
        from hfsdp.parallel.world import all_sum

        total, rows = all_sum(self.accelerator, [float((kl_ratios.detach().float() * weights).sum()),
                                                 float(weights.sum())])
        return max(total / rows, 0.0) if rows else 0.0

    def loss(self, model, batch: KtoBatch) -> torch.Tensor:
        s: KtoSection = self.section
        if self.reference == "precomputed":
            ref, ref_kl = (batch.values[c] for c in REFERENCE_COLUMNS)
        else:  # the base's log-probs of the same micro-batch, before the policy's forward
            with torch.no_grad(), self.base_only():
                ref, ref_kl = self.completion_logps(model, batch)
        logps, kl_logps = self.completion_logps(model, batch)
        kl = self.kl_estimate(kl_logps - ref_kl, batch.weights)
        ratio = logps - ref
        desirable = batch.desirable
        per_row = torch.where(desirable, s.desirable_weight * (1 - torch.sigmoid(s.beta * (ratio - kl))),
                              s.undesirable_weight * (1 - torch.sigmoid(s.beta * (kl - ratio))))
        self.record_rows(batch, kl, rewards=s.beta * ratio, logps=logps)
        return (per_row * batch.weights).sum()

    def record_rows(self, batch: KtoBatch, kl: float, **per_row: torch.Tensor) -> None:
        """Add the rows' values, summed over the desirable (``chosen``) and the undesirable (``rejected``) rows, and
        this micro-step's KL estimate, to the metrics of this step or eval."""
        sums = self._sums
        chosen = batch.desirable.float() * batch.weights
        rejected = (~batch.desirable).float() * batch.weights
        for side, mask in (("chosen", chosen), ("rejected", rejected)):
            sums[f"rows/{side}"] = sums.get(f"rows/{side}", 0) + mask.sum()
            for name, values in per_row.items():
                key = f"{name}/{side}"
                sums[key] = sums.get(key, 0) + (values.detach().float() * mask).sum()
        if float(batch.weights.sum()):  # a filler batch (eval) has no rows and no KL estimate of its own
            sums["kl"] = sums.get("kl", 0) + kl
            sums["micro_steps"] = sums.get("micro_steps", 0) + 1

    SUMS = ("rows/chosen", "rows/rejected", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected",
            "kl", "micro_steps")  # what a step's or an eval's metrics are made of

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        from hfsdp.parallel.world import all_sum

        sums = [float(v) for v in self.step_sums().values()]
        return self.metrics_of(dict(zip(self.SUMS, all_sum(accelerator, sums))), prefix)

    def step_sums(self) -> dict[str, Any]:
        sums, self._sums = {k: self._sums.get(k, 0) for k in self.SUMS}, {}
        return sums

    def metrics_of(self, totals: dict[str, float], prefix: str = "") -> dict[str, float]:
        out: dict[str, float] = {}
        for side in ("chosen", "rejected"):
            if totals[f"rows/{side}"]:
                for name in ("rewards", "logps"):
                    out[f"{name}/{side}"] = totals[f"{name}/{side}"] / totals[f"rows/{side}"]
        if "rewards/chosen" in out and "rewards/rejected" in out:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        out["kl"] = totals["kl"] / totals["micro_steps"] if totals["micro_steps"] else math.nan
        return {f"{prefix}{name}": value for name, value in out.items()}
