"""The DPO objective of plugin ``dpo`` (:mod:`hfsdp.builtin.dpo`).

The loss of a pair, with ``d = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))`` (summed
completion log-probs): sigmoid ``-(1-e) log sigmoid(beta d) - e log sigmoid(-beta d)``; hinge ``relu(1 - beta d)``;
ipo ``(d' - 1/(2 beta))^2`` with each log-ratio divided by its completion's tokens (as TRL). The step's loss is the
mean over the global batch's pairs (hfsdp's normalisation, with pairs as the units), whatever the split over ranks
and micro-batches. Chosen and rejected sequences go through the model in one forward.

The reference is never a second copy of the model:

* ``adapter`` (LoRA): the base model, by running the same micro-batch with the adapters disabled (peft's
  ``disable_adapter``) without gradients, just before the policy's forward;
* ``precomputed`` (full fine-tuning; also with LoRA): every row's reference log-probs are computed once after the
  model is sharded, before training and before a resume restores a checkpoint (so from the base weights; with LoRA
  with the adapters disabled), and cached under the cache folder, keyed by the model files' contents, the tokenized
  rows and the model settings; every epoch (and every later run on the same data and model) reads them back.

Metrics (each step, in ``metrics.jsonl``, the trackers and, the margin and accuracy, the progress bar; on the eval
split prefixed ``eval_``): ``rewards/chosen`` and ``rewards/rejected`` (``beta`` times the log-ratio),
``rewards/margins``, ``rewards/accuracy`` (share of pairs whose chosen reward is higher), ``logps/chosen``,
``logps/rejected``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hfsdp.builtin.reference_model.routes import REFERENCE_COLUMNS, ReferenceRoutes
from hfsdp.objective import PairBatch

if TYPE_CHECKING:
    from hfsdp.builtin.dpo.schema import DpoSection

class DPO(ReferenceRoutes):

    def loss(self, model, batch: PairBatch) -> torch.Tensor:
        s: DpoSection = self.section
        if self.reference == "precomputed":
            ref_chosen, ref_rejected = (batch.values[c] for c in REFERENCE_COLUMNS)
        else:  # the base's log-probs of the same micro-batch, before the policy's forward
            with torch.no_grad(), self.base_only():
                ref_chosen, ref_rejected = self.completion_logps(model, batch)
        chosen, rejected = self.completion_logps(model, batch)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        if s.loss_type == "sigmoid":
            per_pair = (-(1 - s.label_smoothing) * F.logsigmoid(s.beta * delta)
                        - s.label_smoothing * F.logsigmoid(-s.beta * delta))
        elif s.loss_type == "hinge":
            per_pair = torch.relu(1 - s.beta * delta)
        else:  # ipo, with each log-ratio per completion token (as TRL)
            tokens = batch.completion_tokens.clamp(min=1).float()
            per_pair = (chosen_ratio / tokens[:batch.pairs] - rejected_ratio / tokens[batch.pairs:]
                        - 1 / (2 * s.beta)) ** 2
        chosen_reward, rejected_reward = s.beta * chosen_ratio, s.beta * rejected_ratio
        self.record(batch, **{"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
                              "rewards/margins": chosen_reward - rejected_reward,
                              "rewards/accuracy": (chosen_reward > rejected_reward).float(),
                              "logps/chosen": chosen, "logps/rejected": rejected})
        return (per_pair * batch.weights).sum()
