"""The train-inference mismatch of an engine that samples beside the trainer (``generation.engine: workers``:
:attr:`~hfsdp.builtin.online.schema.GenerationSection.beside`) and TRL 1.16's correction of it
(``vllm_importance_sampling_correction``). Such a round keeps, for each completion, the sampler's log-prob of each
labelled token (``sampler_logps``) beside the trainer's when sampled (``old_logps``, the same layout); GRPO's loss
multiplies its per-token loss by their importance-sampling ratio (:func:`importance_sampling_ratio`). The round's
metrics (:func:`mismatch_stats`, :func:`ratio_stats`, over :func:`round_logps`) are TRL's, over the whole round: TRL's
on one process (TRL's own, with several, average the processes' means), the same on any number of ranks."""

from __future__ import annotations

import math
from typing import Any

import torch

from hfsdp.builtin.online.rounds import spread


def importance_sampling_ratio(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, generation) -> torch.Tensor:
    """TRL's ratio ``exp(old - sampler)`` of each token (``[completions, tokens]``; 1 where ``mask`` is False or the
    sampler's log-prob is NaN, unscored) or, with a ``sequence_*`` ``importance_sampling_mode``, of each completion
    (``[completions, 1]``: the exp of its tokens' summed log-ratio); then clamped to [``importance_sampling_clip_min``,
    ``_max``] (``*_truncate``; neither bound: unclamped, where TRL's clamp raises) or set to 0 outside it
    (``*_mask``)."""
    log_ratio = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    mode, low, high = (generation.importance_sampling_mode, generation.importance_sampling_clip_min,
                       generation.importance_sampling_clip_max)
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high) if low is not None or high is not None else ratio
    low, high = (low if low is not None else -math.inf), (high if high is not None else math.inf)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def round_logps(entries: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, sampler, mask): the round's kept ``old_logps`` and ``sampler_logps`` as ``[completions, tokens]``
    tensors, each completion's labelled tokens from the left, and the mask of their positions."""
    old = [row for entry in entries for row in entry["old_logps"]]
    sampler = [row for entry in entries for row in entry["sampler_logps"]]
    lengths = torch.tensor([len(row) for row in old])
    mask = torch.arange(int(lengths.max()) if old else 0)[None] < lengths[:, None]
    return spread(old, mask), spread(sampler, mask), mask


def mismatch_stats(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """TRL's ``sampling/sampling_logp_difference/mean`` and ``/max``: of ``|old - sampler|`` over the masked tokens
    the sampler scored (not NaN); 0 for none."""
    delta = (old - sampler).abs()[mask]
    delta = delta[~torch.isnan(delta)]
    mean, most = (float(delta.mean()), float(delta.max())) if delta.numel() else (0.0, 0.0)
    return {"sampling/sampling_logp_difference/mean": mean, "sampling/sampling_logp_difference/max": most}


def ratio_stats(ratio: torch.Tensor, mask: torch.Tensor, mode: str) -> dict[str, float]:
    """TRL's ``sampling/importance_sampling_ratio/min``, ``/mean`` and ``/max`` of :func:`importance_sampling_ratio`:
    over every completion with a ``sequence_*`` ``mode``, else over the masked tokens; 0 for none."""
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask]
    values = (float(flat.min()), float(flat.mean()), float(flat.max())) if flat.numel() else (0.0, 0.0, 0.0)
    return {f"sampling/importance_sampling_ratio/{name}": v for name, v in zip(("min", "mean", "max"), values)}
