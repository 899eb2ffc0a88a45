"""The objectives of plugins ``orpo`` and ``simpo`` (:mod:`hfsdp.builtin.orpo`, :mod:`hfsdp.builtin.simpo`):
preference losses without a reference model, each the formula of TRL 1.16's trainer (``ORPOTrainer``,
``CPOTrainer`` with ``loss_type="simpo"``), on the per-token average log-probabilities ``c`` (chosen) and ``r``
(rejected) of the completions:

* ORPO: ``nll - beta * mean(log sigmoid(log_odds))`` with ``log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))``;
  ``nll`` is the next-token cross entropy of the chosen rows' tokens, prompt included (as TRL's);
* SimPO: ``mean(-log sigmoid(beta * (c - r) - gamma)) + nll_weight * nll`` (TRL's ``cpo_alpha``), ``nll`` over the
  chosen completions' tokens.

``nll`` is a mean over the tokens of the whole global batch (TRL: of its micro-batch, the same on one process
without accumulation): :meth:`ReferenceFree.start_step` sums the global batch's pairs and NLL tokens over the ranks,
so that 2 ranks compute what one process computes.

Metrics (TRL's names, but ``rewards/accuracy`` as DPO's): ``rewards/chosen`` and ``rewards/rejected``
(``beta * c``, ``beta * r``), ``rewards/margins``, ``rewards/accuracy``, ``logps/chosen`` and ``logps/rejected``
(``c``, ``r``: per-token averages, as TRL logs them here), ``nll_loss``; ORPO adds ``log_odds_ratio`` (the mean
``log sigmoid(log_odds)``) and ``log_odds_chosen`` (the mean ``log_odds``), as TRL names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hfsdp import IGNORE_INDEX
from hfsdp.objective import PairBatch, PreferenceObjective, target_logps


@dataclass
class NllPairBatch(PairBatch):
    """A :class:`PairBatch` with the targets of the chosen sequences' NLL term, in the logits' layout (the
    rejected sequences' unlabelled)."""

    nll_targets: torch.Tensor | None = None
    nll_tokens: int = 0  # how many of them are labelled

    def make_filler(self) -> None:
        super().make_filler()
        self.nll_targets = torch.full_like(self.nll_targets, IGNORE_INDEX)
        self.nll_tokens = 0


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (branching at ``-ln 2``, as TRL's ``log1mexp``)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_terms(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log sigmoid(log_odds), log_odds) of each pair, from the average log-probs."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return F.logsigmoid(log_odds), log_odds


def simpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """Each pair's SimPO loss from the average log-probs (TRL CPO's ``simpo`` without label smoothing)."""
    return -F.logsigmoid(beta * (chosen - rejected - gamma / beta))


class ReferenceFree(PreferenceObjective):
    """The shared part: one forward of the chosen and rejected rows gives each completion's average log-prob and
    the chosen rows' summed NLL; :meth:`pair_losses` adds the objective's own term."""

    nll_over_prompt = False  # True: the NLL term covers the chosen rows' prompt tokens too (ORPO)

    def __init__(self, section, nll_weight: float):
        super().__init__()
        self.section, self.nll_weight = section, nll_weight
        self.nll_scale = 0.0  # the global batch's pairs per NLL token (set by start_step)

    def micro_batch(self, rows, pad_id, device, select_logits) -> NllPairBatch:
        batch = super().micro_batch(rows, pad_id, device, select_logits and not self.nll_over_prompt)
        targets = batch.sequence_targets  # one sequence per row: the chosen ones first
        chosen = targets[:batch.pairs]
        if self.nll_over_prompt:  # every next token of the chosen rows but padding (no logits_to_keep)
            ids = batch.per_sequence(batch.inputs["input_ids"])[:batch.pairs]
            lengths = torch.tensor(batch.lengths[:batch.pairs], device=ids.device)
            inside = torch.arange(ids.size(1), device=ids.device)[None, :] < lengths[:, None] - 1
            chosen = torch.where(inside, ids.roll(-1, 1), IGNORE_INDEX)
        nll = torch.cat([chosen, torch.full_like(targets[batch.pairs:], IGNORE_INDEX)])
        return NllPairBatch(**vars(batch), nll_targets=batch.in_rows(nll, IGNORE_INDEX),
                            nll_tokens=int((chosen != IGNORE_INDEX).sum()))

    def start_step(self, accelerator, micro) -> None:
        from hfsdp.parallel.world import all_sum

        if self.nll_weight:
            pairs, tokens = all_sum(accelerator, [float(sum(b.num_targets for b in micro)),
                                                  float(sum(b.nll_tokens for b in micro))])
            self.nll_scale = pairs / tokens if tokens else 0.0

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Each pair's loss term and the objective's own per-pair metrics, from the average log-probs."""
        raise NotImplementedError

    def loss(self, model, batch: NllPairBatch) -> torch.Tensor:
        logits = model(**batch.inputs).logits.float()
        average = batch.per_sequence(target_logps(logits, batch.targets)).sum(1) / batch.completion_tokens.clamp(min=1)
        chosen, rejected = average[:batch.pairs], average[batch.pairs:]
        per_pair, own = self.pair_losses(chosen, rejected)
        beta = self.section.beta
        metrics = {"rewards/chosen": beta * chosen, "rewards/rejected": beta * rejected,
                   "rewards/margins": beta * (chosen - rejected), "rewards/accuracy": (chosen > rejected).float(),
                   "logps/chosen": chosen, "logps/rejected": rejected}
        loss = (per_pair * batch.weights).sum()
        if self.nll_weight:
            labelled = batch.nll_targets != IGNORE_INDEX  # the chosen sequences' NLL positions, wherever they lie
            per_position = torch.zeros(labelled.shape, dtype=logits.dtype, device=logits.device)
            per_position[labelled] = F.cross_entropy(logits[labelled], batch.nll_targets[labelled], reduction="none")
            nll = batch.per_sequence(per_position).sum(1)[:batch.pairs]
            metrics["nll_loss"] = nll * self.nll_scale  # its mean over the pairs: the global token mean
            loss = loss + self.nll_weight * self.nll_scale * nll.sum()
        self.record(batch, **metrics, **own)
        return loss


class ORPO(ReferenceFree):
    nll_over_prompt = True

    def __init__(self, section):
        super().__init__(section, nll_weight=1.0)

    def pair_losses(self, chosen, rejected):
        ratio, log_odds = orpo_terms(chosen, rejected)
        return -self.section.beta * ratio, {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}


class SimPO(ReferenceFree):
    def __init__(self, section):
        super().__init__(section, nll_weight=section.nll_weight)

    def pair_losses(self, chosen, rejected):
        return simpo_losses(chosen, rejected, self.section.beta, self.section.gamma), {}
