"""The GRPO objective of plugin ``grpo`` (:mod:`hfsdp.builtin.grpo`): sampling and rewards as every online
objective's (:class:`hfsdp.builtin.online.sampler.OnlineObjective`), TRL 1.16's advantages and losses.

Each generation round (``grpo.num_iterations`` optimizer steps) takes the plan's prompts of the global batch
(``per_device_batch_size / num_generations`` prompts per micro-batch) and samples ``num_generations`` completions of
each with the KV cache (``generate``), each rank those of its own micro-batches in one call, in lock-step. Every
token is drawn by the completion's own generator, seeded by (seed, round, prompt position, generation index), never
by rank, micro-batch or batch composition, so 1 process and N ranks sample the same completions. Each rank scores
the completions it trains on with the reward functions (TRL's calling convention, hook ``hfsdp_reward_functions``);
the rewards are gathered, and the advantages are TRL's: the weighted sum of the rewards (None: left out) minus the
group's mean, divided by the group's (or the batch's) standard deviation plus 1e-4 (``scale_rewards``).

The loss of a token, with ``r = exp(logp - logp_old)`` (``logp_old`` the log-prob when sampled: kept when
``num_iterations`` > 1, else ``logp`` detached, so ``r`` = 1 with its gradient) and advantage ``A``:
``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``, plus ``beta (exp(ref - logp) - (ref - logp) - 1)`` (the k3
KL estimator; ``ref`` the base model's log-prob, the LoRA adapters disabled). Aggregated as TRL aggregates it
(hfsdp then divides by the global batch's units, so any split over ranks and micro-batches gives one process's
gradient): ``grpo`` the mean over completions of each one's token mean; ``bnpo`` the mean over micro-batches of
their token mean; ``dr_grpo`` the token sum over completions times ``max_new_tokens``; ``dapo`` the global token
mean. Log-probs and entropies are of the logits divided by the temperature, as TRL's.

The round's completions, advantages and kept log-probs are part of every checkpoint (a registered object), so a
resume inside a round continues it bit for bit.
"""

from __future__ import annotations

import math

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.online.sampler import GroupBatch, OnlineObjective, nanstd, token_logps
from hfsdp.data.batches import MicroBatch

# TRL adds this to the standard deviation it divides the advantages by.
STD_EPSILON = 1e-4


def advantages_of(rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """TRL's advantages of a batch's rewards ``[completions, functions]`` (NaN: no reward), groups consecutive."""
    unscorable = torch.isnan(rewards).all(1)
    total = (rewards * weights[None]).nansum(1)
    total[unscorable] = math.nan
    mean = torch.nanmean(total.view(-1, group), 1).repeat_interleave(group)
    std = (nanstd(total.view(-1, group), 1).repeat_interleave(group) if scale != "batch"
           else nanstd(total).expand_as(total))
    advantages = total - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def token_loss(logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, ref: torch.Tensor | None,
               mask: torch.Tensor, section, max_new_tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the micro-batch's summed loss in its units, per-token values for the metrics): see the module docstring.
    ``logps``, ``old``, ``ref``, ``mask``: ``[completions, tokens]``; ``advantages``: ``[completions]``."""
    mask = mask.float()
    ratio = torch.exp(logps - old)
    high = section.epsilon_high if section.epsilon_high is not None else section.epsilon
    a = advantages[:, None]
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - section.epsilon, 1 + high) * a)
    parts = {"clip_ratio": (((ratio < 1 - section.epsilon) & (a < 0)) | ((ratio > 1 + high) & (a > 0))).float()}
    if section.beta:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token = per_token + section.beta * kl
        parts["kl"] = kl.detach()
    masked = per_token * mask
    if section.loss_type == "grpo":
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1)).sum()
    elif section.loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1) * mask.size(0)
    elif section.loss_type == "dr_grpo":
        loss = masked.sum() / max_new_tokens
    else:  # dapo: units are tokens
        loss = masked.sum()
    return loss, parts


class GRPO(OnlineObjective):
    name = "grpo"

    def units(self, batch: MicroBatch, completions: int) -> int:
        return batch.num_targets if self.section.loss_type == "dapo" else completions

    def advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group: int) -> torch.Tensor:
        return advantages_of(rewards, weights, group, self.section.scale_rewards)

    def loss(self, model, batch: GroupBatch) -> torch.Tensor:
        s = self.section
        logps, entropy = token_logps(model, batch, s.temperature)
        mask = batch.targets != IGNORE_INDEX
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        loss, parts = token_loss(logps, old, batch.advantages, batch.ref_logps, mask, s, s.max_new_tokens)
        fmask = mask.float()
        self._add("tokens", fmask.sum())
        self._add("entropy", (entropy * fmask).sum())
        for name, values in parts.items():
            self._add(name, (values * fmask).sum())
        return loss
