"""The GRPO objective of plugin ``grpo`` (:mod:`hfsdp.builtin.grpo`): sampling and rewards as every online
objective's (:class:`hfsdp.builtin.online.objective.OnlineObjective`), TRL 1.16's advantages and losses.

Each generation round (``grpo.num_iterations`` optimizer steps) takes the plan's prompts of the global batch
(``per_device_batch_size / num_generations`` prompts per micro-batch) and samples ``num_generations`` completions of
each with the KV cache (each prompt prefilled once), each rank those of its own micro-batches in one call, in
lock-step. Every token is drawn by the completion's own generator, seeded by (seed, round, prompt position,
generation index), never by rank, micro-batch or batch composition, so 1 process and N ranks sample the same
completions. Each rank scores the completions it trains on with the reward functions (TRL's calling convention,
hook ``hfsdp_reward_functions``);
the rewards are gathered, and the advantages are TRL's (:func:`advantages_of`): with ``multi_objective_aggregation:
sum_then_normalize`` the weighted sum of the rewards (None: left out) minus the group's mean, divided by the group's
(or the batch's) standard deviation plus 1e-4 (``scale_rewards``); with ``normalize_then_sum`` each function's
rewards normalised so within the group, summed with their weights, then normalised by the batch's mean and standard
deviation.

The loss of a token (:func:`token_loss`), with ``r = exp(logp - logp_old)`` (``logp_old`` the log-prob when sampled:
kept when ``num_iterations`` > 1, else ``logp`` detached, so ``r`` = 1 with its gradient; with
``importance_sampling_level: sequence`` one ``r`` per completion, the exp of its tokens' mean log-ratio) and
advantage ``A``: grpo, bnpo, dr_grpo, dapo and luspo ``-min(r' A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``
(``r'`` = ``min(r, delta)`` with ``delta``, else ``r``); cispo ``-min(r, epsilon_high) A logp`` (the factor
detached); sapo ``-4 sigmoid(t (r - 1)) / t A`` (``t`` = ``sapo_temperature_pos`` where A > 0, else ``_neg``); vespo
``-phi(w) A logp`` with ``w`` the completion's ratio (the exp of its summed log-ratio) and ``phi(w) = exp(lambda + k
log w - lambda w)`` detached (``vespo_k/lambda_pos`` where A >= 0, else ``_neg``). Then the completions that
``off_policy_mask_threshold`` drops (A < 0 and a mean KL(old || current) above it) and, with
``top_entropy_quantile`` < 1, the tokens whose entropy is under the quantile of the global batch's entropies
(:func:`high_entropy`) lose their policy term; with an engine beside the trainer (``generation.engine: workers``)
and ``generation.importance_sampling_correction`` (TRL's with vLLM), the policy term is multiplied by the
importance-sampling ratio of the trainer's log-probs when sampled to the sampler's
(:func:`hfsdp.builtin.online.correction.importance_sampling_ratio`; vespo's weight takes it in instead), and the
off-policy mask's KL is the sampler's to the current policy; plus ``beta (exp(ref - logp) - (ref - logp) - 1)``
(the k3 KL estimator, times ``r`` with ``use_bias_correction_kl``; ``ref`` the base model's log-prob, the LoRA
adapters disabled). A completion ``mask_truncated_completions`` leaves out is unlabelled (:mod:`hfsdp.builtin.online.objective`):
no token of it counts. Aggregated as TRL aggregates it (hfsdp then divides by the global batch's units, so any split
over ranks and micro-batches gives one process's gradient): ``grpo`` and ``sapo`` the mean over completions of each
one's token mean; ``bnpo`` the mean over micro-batches of their token mean; ``dr_grpo`` the token sum over
completions times ``max_new_tokens``; ``luspo`` the mean over completions of each one's token sum; ``dapo``,
``cispo`` and ``vespo`` the global token mean. Log-probs and entropies are of the logits divided by the temperature,
as TRL's.

``top_entropy_quantile``: TRL takes the quantile over the entropies of one micro-batch gathered from every rank, so
its threshold moves with the world size and the accumulation; hfsdp takes it over the whole global batch (every
micro-batch of every rank), TRL's own definition on one process without accumulation, which no split changes. That
needs the step's entropies before its first backward: :meth:`GRPO.start_step` runs a forward without gradient over
this rank's micro-batches and gathers their entropies (one more forward per step, only with the quantile < 1).

The round's completions, advantages and kept log-probs are part of every checkpoint (a registered object), so a
resume inside a round continues it bit for bit.
"""

from __future__ import annotations

import math

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.online.correction import importance_sampling_ratio, ratio_stats, round_logps
from hfsdp.builtin.online.objective import OnlineObjective
from hfsdp.builtin.online.rounds import GroupBatch, token_logps
from hfsdp.builtin.online.scoring import nanstd
from hfsdp.data.batches import MicroBatch

# TRL adds this to the standard deviation it divides the advantages by.
STD_EPSILON = 1e-4
# The loss types whose units are the global batch's tokens (the others': its completions).
TOKEN_MEAN_LOSSES = ("dapo", "cispo", "vespo")
# The loss types of the clipped ratio (PPO's objective).
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# vespo's bounds of the completion's log-ratio (TRL's: the original implementation's log(1e-8) and 20).
VESPO_LOG_MIN, VESPO_LOG_MAX = math.log(1e-8), 20.0


def _group_normalised(values: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """``values`` (NaN: none) minus their group's mean, divided by the group's or the batch's std plus 1e-4."""
    mean = torch.nanmean(values.view(-1, group), 1).repeat_interleave(group)
    std = (nanstd(values.view(-1, group), 1).repeat_interleave(group) if scale != "batch"
           else nanstd(values).expand_as(values))
    centred = values - mean
    return centred / (std + STD_EPSILON) if scale != "none" else centred


def advantages_of(rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str,
                  aggregation: str = "sum_then_normalize") -> torch.Tensor:
    """TRL's advantages of a batch's rewards ``[completions, functions]`` (NaN: no reward), groups consecutive;
    ``aggregation``: ``multi_objective_aggregation`` (see the module docstring)."""
    unscorable = torch.isnan(rewards).all(1)
    if aggregation == "normalize_then_sum":
        per_function = torch.stack([_group_normalised(column, group, "group") for column in rewards.T], 1)
        total = (per_function * weights[None]).nansum(1)
        total[unscorable] = math.nan
        advantages = (total - torch.nanmean(total)) / (nanstd(total) + STD_EPSILON)
    else:
        total = (rewards * weights[None]).nansum(1)
        total[unscorable] = math.nan
        advantages = _group_normalised(total, group, scale)
    return torch.nan_to_num(advantages, nan=0.0)


def high_entropy(entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """TRL's mask of the tokens whose entropy is at least ``threshold`` (padding never)."""
    return (entropy * mask >= threshold) & mask


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> float:
    """The entropy above which the top ``quantile`` of ``entropies`` (every token's) lies: TRL's
    ``torch.quantile(entropies, 1 - quantile)`` (linear interpolation); infinite for no token (none kept)."""
    return float(torch.quantile(entropies.float(), 1 - quantile)) if entropies.numel() else math.inf


def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, a: torch.Tensor, section,
                  is_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """vespo's gamma weight ``phi(w)`` of each completion's ratio ``w`` (``[completions, 1]``, no gradient), TRL's
    ``get_gamma_weights``; ``is_ratio``: the importance-sampling ratio to the sampler's log-probs per token, whose
    logs (clamped) join ``w``'s (over the labelled tokens: TRL sums over its padding too, where the ratio is 1 but
    for a mask mode whose [clip_min, clip_max] leaves out 1)."""
    with torch.no_grad():
        summed = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
        if is_ratio is not None:
            logs = torch.clamp(torch.log(is_ratio), VESPO_LOG_MIN, VESPO_LOG_MAX)
            summed = summed + (logs * mask).sum(-1, keepdim=True)
        log_w = torch.clamp(summed, VESPO_LOG_MIN, VESPO_LOG_MAX)
        positive = a >= 0
        k = torch.where(positive, section.vespo_k_pos, section.vespo_k_neg)
        lam = torch.where(positive, section.vespo_lambda_pos, section.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_loss(logps: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor, a: torch.Tensor,
                mask: torch.Tensor, section,
                is_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token policy term of ``section.loss_type`` (see the module docstring) and its metrics; ``ratio``
    ``[completions, tokens]`` or ``[completions, 1]`` (sequence level), ``a`` the advantages ``[completions, 1]``;
    ``is_ratio``: the importance-sampling ratio to the sampler (vespo's weight takes it in)."""
    high = section.epsilon_high if section.epsilon_high is not None else section.epsilon
    if section.loss_type == "cispo":
        capped = torch.clamp(ratio, max=high).detach()
        return -capped * a * logps, {"clip_ratio": ((ratio > high) & (a > 0)).float()}
    if section.loss_type == "sapo":
        temperature = torch.where(a > 0, section.sapo_temperature_pos, section.sapo_temperature_neg)
        return -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * a, {}
    if section.loss_type == "vespo":
        phi = vespo_weights(log_ratio, mask, a, section, is_ratio)
        return -phi * a * logps, {"vespo_phi": phi.expand_as(logps)}
    clipped = torch.clamp(ratio, 1 - section.epsilon, 1 + high)
    if section.delta is not None:
        ratio = torch.clamp(ratio, max=section.delta)
    per_token = -torch.min(ratio * a, clipped * a)
    return per_token, {"clip_ratio": (((ratio < 1 - section.epsilon) & (a < 0)) | ((ratio > 1 + high) & (a > 0)))
                       .float()}


def off_policy_keep(logps: torch.Tensor, old: torch.Tensor, a: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``get_off_policy_mask``): 1 where a completion's advantage
    is >= 0 or its mean KL(old || current) is at most ``threshold``, else 0 (``[completions, 1]``); ``old``: the
    sampler's log-probs where an engine beside the trainer sampled them (as TRL's with vLLM), else the trainer's
    when sampled."""
    kl = torch.nan_to_num(old - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((a >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def token_loss(logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, ref: torch.Tensor | None,
               mask: torch.Tensor, section, max_new_tokens: int, keep: torch.Tensor | None = None,
               sampler: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the micro-batch's summed loss in its units, per-token values for the metrics): see the module docstring.
    ``logps``, ``old``, ``ref``, ``sampler``, ``mask``: ``[completions, tokens]``; ``advantages``:
    ``[completions]``; ``keep``: the tokens whose policy term counts (``top_entropy_quantile``; None: all);
    ``sampler``: the sampler's log-probs of a round an engine beside the trainer sampled (None: inline)."""
    is_ratio = (importance_sampling_ratio(old, sampler, mask, section.generation) if section.generation.corrects
                else None)
    mask = mask.float()
    a = advantages[:, None]
    log_ratio = logps - old
    if section.importance_sampling_level == "sequence":
        log_ratio_used = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_ratio_used = log_ratio
    ratio = torch.exp(log_ratio_used)
    per_token, parts = policy_loss(logps, log_ratio, ratio, a, mask, section, is_ratio)
    if section.off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_keep(logps, sampler if sampler is not None else old, a, mask,
                                                section.off_policy_mask_threshold)
    if keep is not None:
        per_token = per_token * keep
    if is_ratio is not None and section.loss_type != "vespo":
        per_token = per_token * is_ratio
    if section.beta:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        parts["kl"] = kl.detach()
        if section.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + section.beta * kl
    masked = per_token * mask
    if section.loss_type in ("grpo", "sapo"):
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1)).sum()
    elif section.loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1) * mask.size(0)
    elif section.loss_type == "dr_grpo":
        loss = masked.sum() / max_new_tokens
    else:  # luspo (units: completions), dapo, cispo, vespo (units: tokens)
        loss = masked.sum()
    return loss, parts


class GRPO(OnlineObjective):
    name = "grpo"

    def units(self, batch: MicroBatch, completions: int) -> int:
        return batch.num_targets if self.section.loss_type in TOKEN_MEAN_LOSSES else completions

    def advantages(self, rewards: torch.Tensor, weights: torch.Tensor, group: int, entries) -> torch.Tensor:
        return advantages_of(rewards, weights, group, self.section.scale_rewards,
                             self.section.multi_objective_aggregation)

    def round_stats(self, rewards: torch.Tensor, entries) -> dict[str, float]:
        """With the correction (``generation.corrects``): the round's importance-sampling ratios
        (:func:`~hfsdp.builtin.online.correction.ratio_stats`)."""
        stats = super().round_stats(rewards, entries)
        generation = self.section.generation
        if generation.corrects:
            old, sampler, mask = round_logps(entries)
            stats.update(ratio_stats(importance_sampling_ratio(old, sampler, mask, generation), mask,
                                     generation.importance_sampling_mode))
        return stats

    def prepare(self, model, accelerator, splits, cache_dir, model_path):
        self.model = model  # the wrapped model, for the entropy pass of start_step
        return super().prepare(model, accelerator, splits, cache_dir, model_path)

    def start_step(self, accelerator, micro: list[GroupBatch]) -> None:
        """With ``top_entropy_quantile`` < 1: the global batch's entropy threshold (see the module docstring) set on
        each of this rank's micro-batches. Collective: every rank runs as many forwards, then gathers."""
        if self.section.top_entropy_quantile >= 1:
            return
        from hfsdp.data.batches import reshard
        from hfsdp.parallel.world import gather_objects

        with torch.no_grad():
            mine = [token_logps(self.model, batch, self.section.temperature)[1][batch.sequence_targets != IGNORE_INDEX].cpu()
                    for batch in micro]
        reshard(self.model)
        everyone = torch.cat([t for part in gather_objects(accelerator, mine) for t in part])
        threshold = entropy_threshold(everyone, self.section.top_entropy_quantile)
        for batch in micro:
            batch.entropy_threshold = threshold

    def loss(self, model, batch: GroupBatch) -> torch.Tensor:
        s = self.section
        logps, entropy = token_logps(model, batch, s.temperature)
        mask = batch.sequence_targets != IGNORE_INDEX
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        keep = high_entropy(entropy, mask, batch.entropy_threshold) if batch.entropy_threshold is not None else None
        loss, parts = token_loss(logps, old, batch.advantages, batch.ref_logps, mask, s, s.max_new_tokens, keep,
                                 batch.sampler_logps)
        fmask = mask.float()
        self._add("tokens", fmask.sum())
        self._add("entropy", (entropy * fmask).sum())
        if keep is not None:
            parts["entropy_kept"] = keep.float()
        for name, values in parts.items():
            self._add(name, (values * fmask).sum())
        return loss
