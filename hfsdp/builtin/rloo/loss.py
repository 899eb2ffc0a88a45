"""The RLOO objective of plugin ``rloo`` (:mod:`hfsdp.builtin.rloo`): REINFORCE leave-one-out as TRL 1.16's
``RLOOTrainer``, on the online objectives' sampler (:class:`hfsdp.builtin.online.objective.OnlineObjective`: the same
seeded completions on any world size, the rewards, the rounds of ``num_iterations`` steps, the checkpointed buffer).

Rewards (:func:`rloo_advantages`): each completion's weighted reward (None from every function: unscorable),
clamped to ``reward_clip_range``, minus ``beta`` times its KL to the reference, the sum over its tokens of
``logp_sampled - logp_ref`` (the first-order estimate of the RLOO paper, applied to the reward, not to the loss as
GRPO's). A completion's advantage is its reward minus the mean reward of the other scorable completions of its
prompt (the leave-one-out baseline); with ``normalize_advantages`` the advantages are then standardised over the
batch (std plus 1e-4). Unscorable completions, and those with no scorable sibling, get 0.

The loss of a completion (:func:`sequence_loss`) is PPO's clipped objective at the sequence level:
``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)`` with ``r = exp(logp - logp_old)``, ``logp`` the sum of its
tokens' log-probs (of the logits over the temperature) and ``logp_old`` that sum when it was sampled (kept with
``num_iterations`` > 1, ``beta`` > 0 or an engine beside the trainer, else ``logp`` detached: ``r`` = 1 with its
gradient). The mean over the global batch's completions (hfsdp sums each micro-batch's and divides by the global
count: TRL's per-micro-batch mean divided by the accumulation, for any split over ranks and micro-batches). A
completion that ``mask_truncated_completions`` leaves out has no tokens: its ``r`` is 1 without gradient and it
still counts in the mean, as in TRL. No importance-sampling correction of the sampler's log-probs: TRL's RLOO has
none (its vLLM returns no log-probs); an engine beside the trainer still reports the mismatch (the round's
``sampling/sampling_logp_difference``).
"""

from __future__ import annotations

import math

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.online.objective import OnlineObjective
from hfsdp.builtin.online.rounds import GroupBatch, token_logps
from hfsdp.builtin.online.scoring import nanstd
from hfsdp.objective import means_of

# TRL adds this to the standard deviation it divides normalised advantages by.
STD_EPSILON = 1e-4
# The metrics that are a share of completions (TRL's clip_ratio/low_mean, high_mean, region_mean).
PER_COMPLETION = ("clip_ratio", "clip_ratio/low", "clip_ratio/high")


def rloo_advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int, normalize: bool = False,
                    clip_range: tuple[float, float] | None = None, kl: torch.Tensor | None = None,
                    beta: float = 0.0) -> torch.Tensor:
    """TRL's RLOO advantages of a batch's rewards ``[completions, functions]`` (NaN: no reward), groups
    consecutive; ``kl``: each completion's summed log-ratio to the reference (with ``beta`` > 0)."""
    total = (rewards * weights[None]).nansum(1)
    total[torch.isnan(rewards).all(1)] = math.nan
    if clip_range is not None:
        total = total.clamp(min=clip_range[0], max=clip_range[1])
    if beta:
        total = total - beta * kl
    grouped = total.view(-1, group)
    scorable = (~torch.isnan(grouped)).sum(1, keepdim=True)
    baselines = (torch.nansum(grouped, 1, keepdim=True) - grouped) / (scorable - 1)
    advantages = total - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def sequence_kl(entries: list[dict]) -> torch.Tensor:
    """Each completion's sum over its tokens of the kept ``old_logps - ref_logps``, in the round's order."""
    return torch.stack([(torch.tensor(old, dtype=torch.float32) - torch.tensor(ref, dtype=torch.float32)).sum()
                        for entry in entries for old, ref in zip(entry["old_logps"], entry["ref_logps"])])


def sequence_loss(logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, epsilon: float,
                  epsilon_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the summed loss of the completions, per-completion clip indicators): ``logps``, ``old``: each completion's
    summed log-probs ``[completions]``; see the module docstring."""
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low = ((ratio < 1 - epsilon) & (advantages < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
    return loss.sum(), {"clip_ratio/low": low, "clip_ratio/high": high, "clip_ratio": torch.maximum(low, high)}


class RLOO(OnlineObjective):
    name = "rloo"

    def keeps_old_logps(self) -> bool:
        """The log-probs when sampled are kept as every online objective keeps them, and for the KL penalty."""
        return super().keeps_old_logps() or bool(self.section.beta)

    def without_signal(self, slots) -> bool:
        """Every advantage 0: the loss is 0 whatever the log-probs (the KL is in the rewards, not the loss)."""
        return all(a == 0 for slot in slots for a in slot["advantages"])

    def advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group: int, entries) -> torch.Tensor:
        s = self.section
        return rloo_advantages(rewards, weights, group, s.normalize_advantages, s.reward_clip_range,
                               sequence_kl(entries) if s.beta else None, s.beta)

    def round_stats(self, rewards: torch.Tensor, entries) -> dict[str, float]:
        """With ``beta``: the round's mean per-token KL to the reference when sampled (TRL's ``kl``)."""
        stats = super().round_stats(rewards, entries)
        if self.section.beta:
            tokens = sum(len(row) for entry in entries for row in entry["old_logps"])
            stats["kl"] = float(sequence_kl(entries).double().sum()) / max(tokens, 1)
        return stats

    def loss(self, model, batch: GroupBatch) -> torch.Tensor:
        s = self.section
        logps, entropy = token_logps(model, batch, s.temperature)
        mask = (batch.sequence_targets != IGNORE_INDEX).float()
        summed = (logps * mask).sum(1)
        old = (batch.old_logps * mask).sum(1) if batch.old_logps is not None else summed.detach()
        high = s.epsilon_high if s.epsilon_high is not None else s.epsilon
        loss, clipped = sequence_loss(summed, old, batch.advantages, s.epsilon, high)
        self._add("tokens", mask.sum())
        self._add("entropy", (entropy * mask).sum())
        self._add("completions", torch.tensor(float(summed.numel())))
        for name, values in clipped.items():
            self._add(name, values.sum())
        return loss

    def metrics_of(self, totals: dict[str, float]) -> dict[str, float]:
        """Token means (entropy) and completion shares (the clip ratios), with the round's statistics."""
        totals = dict(totals)
        shares = {k: totals.pop(k) for k in (*PER_COMPLETION, "completions") if k in totals}
        return {**super().metrics_of(totals), **means_of(shares, "completions")}

    def take_metrics(self, accelerator, prefix: str = "") -> dict[str, float]:
        from hfsdp.parallel.world import all_sum

        sums = self.step_sums()
        totals = dict(zip(sums, all_sum(accelerator, [float(v) for v in sums.values()])))
        return {f"{prefix}{k}": v for k, v in self.metrics_of(totals).items()}
