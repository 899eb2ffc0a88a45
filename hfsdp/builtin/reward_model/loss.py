"""The objective of plugin ``reward_model`` (:mod:`hfsdp.builtin.reward_model`): TRL 1.16 ``RewardTrainer``'s loss
on the rewards of one forward of the chosen and rejected rows (the sequence-classification model's pooled output):
``-log sigmoid(r_chosen - r_rejected - margin)`` (``margin`` 0 unless ``reward_model.margin``) plus
``center_rewards_coefficient * (r_chosen + r_rejected)^2``, summed over the pairs (hfsdp divides by the global
batch's pairs: TRL's mean on one process).

Metrics (TRL's in brackets): ``rewards/accuracy`` (``accuracy``), ``rewards/margins`` (``margin``: the mean of
``r_chosen - r_rejected``, the margin column not subtracted), ``rewards/mean`` (``mean_reward``), ``rewards/min``
and ``rewards/max`` (``min_reward``, ``max_reward``: over every chosen and rejected reward of the step, all ranks),
and ``rewards/chosen``, ``rewards/rejected`` (the means of each side, which TRL does not log).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hfsdp.builtin.preference import MARGIN
from hfsdp.errors import UserError
from hfsdp.objective import PairBatch, PreferenceObjective


def pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
                center_rewards_coefficient: float | None) -> torch.Tensor:
    """Each pair's loss from its rewards (TRL's ``RewardTrainer.compute_loss`` before its mean)."""
    losses = -F.logsigmoid(chosen - rejected - (margin if margin is not None else 0.0))
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected) ** 2
    return losses


def extremes(accelerator, low: float, high: float) -> tuple[float, float]:
    """(min, max) over the ranks (collective)."""
    if accelerator.num_processes == 1:
        return low, high
    t = torch.tensor([-low, high], dtype=torch.float64, device=accelerator.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return -float(t[0]), float(t[1])


def reward_head(unwrapped) -> torch.nn.Module:
    """The sequence-classification model's head (``score``; under peft its ``modules_to_save`` wrapper): its output
    is a reward at every position, of which transformers' pooling keeps each row's last."""
    heads = sorted((name.count("."), name, module) for name, module in unwrapped.named_modules()
                   if name.rsplit(".", 1)[-1] == "score")
    if not heads:
        raise UserError("reward_model with packing: the model has no `score` head to read each packed sequence's "
                        "reward from; remove packing from plugins")
    return heads[0][2]


class RewardModel(PreferenceObjective):
    def __init__(self, section):
        super().__init__()
        self.section = section
        self._low, self._high = math.inf, -math.inf
        self.head = None  # packed micro-batches: the head whose per-position rewards hold each sequence's

    def rewards(self, model, batch: PairBatch) -> torch.Tensor:
        """Each sequence's reward: the model's pooled output (its last token's), or for a packed micro-batch the
        head's output at each sequence's last token."""
        if batch.packing is None:
            return model(**batch.inputs).logits.squeeze(-1).float()
        seen: list[torch.Tensor] = []
        handle = self.head.register_forward_hook(lambda module, args, output: seen.append(output))
        try:
            model(**batch.inputs)
        finally:
            handle.remove()
        return seen[-1].float().reshape(-1)[batch.packing.last]

    def micro_batch(self, rows, pad_id, device, select_logits) -> PairBatch:
        return super().micro_batch(rows, pad_id, device, select_logits=False)  # one reward per row, no token logits

    def check_margin(self, dataset, split: str) -> None:
        if self.section.margin and MARGIN not in dataset.column_names:
            raise UserError(f"reward_model.margin: true, but the {split} rows have no margin column (a number per "
                            f"row); add it to the data or set reward_model.margin: false")

    def batch_plan(self, dataset, train_config, world_size, mixture):
        self.check_margin(dataset, "training")  # before any weight loads
        return super().batch_plan(dataset, train_config, world_size, mixture)

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        if self.layout.pack_len is not None:
            self.head = reward_head(accelerator.unwrap_model(model))
        if "eval" in splits:
            self.check_margin(splits["eval"], "eval")
        return splits

    def loss(self, model, batch: PairBatch) -> torch.Tensor:
        rewards = self.rewards(model, batch)
        chosen, rejected = rewards[:batch.pairs], rewards[batch.pairs:]
        margin = batch.values[MARGIN] if self.section.margin else None
        losses = pair_losses(chosen, rejected, margin, self.section.center_rewards_coefficient)
        self.record(batch, **{"rewards/chosen": chosen, "rewards/rejected": rejected,
                              "rewards/margins": chosen - rejected, "rewards/accuracy": (chosen > rejected).float(),
                              "rewards/mean": (chosen + rejected) / 2})
        real, kept = torch.cat([batch.weights, batch.weights]) > 0, rewards.detach()  # no host sync here
        self._low = torch.minimum(torch.as_tensor(self._low), torch.where(real, kept, math.inf).min().cpu())
        self._high = torch.maximum(torch.as_tensor(self._high), torch.where(real, kept, -math.inf).max().cpu())
        return (losses * batch.weights).sum()

    def step_sums(self) -> None:
        return None  # its extremes are a maximum over the ranks, not a sum: take_metrics reduces them with the means

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        metrics = super().take_metrics(accelerator, prefix)
        low, high = extremes(accelerator, float(self._low), float(self._high))
        self._low, self._high = math.inf, -math.inf
        metrics[f"{prefix}rewards/min"] = low if math.isfinite(low) else math.nan
        metrics[f"{prefix}rewards/max"] = high if math.isfinite(high) else math.nan
        return metrics
