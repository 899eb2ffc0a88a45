"""The ``rloo:`` section: the online objectives' keys (:class:`hfsdp.builtin.online.schema.OnlineSection`) and
RLOO's, each named and defaulted as TRL 1.16's ``RLOOConfig`` field of the same name (docs/guide.md has the whole
mapping), but for ``num_generations`` (hfsdp's online default, 4: TRL's 2 leaves each completion one sibling for
its baseline) and ``beta`` (see its description)."""

from __future__ import annotations

from pydantic import Field, model_validator

from hfsdp.builtin.online.schema import OnlineSection

# TRL's RLOOConfig.beta, the KL penalty's weight where a reference exists.
TRL_BETA = 0.05


class RlooSection(OnlineSection):
    beta: float | None = Field(
        None, ge=0, description="weight of the KL penalty subtracted from each completion's reward: the sum over "
                                "its tokens of log p_sampled - log p_ref (the reference: the base with the LoRA "
                                "adapters disabled). Default: TRL's 0.05 with lora, 0 without (a full fine-tune "
                                "has no reference here)")
    epsilon: float = Field(0.2, gt=0, description="clip range of the completion's probability ratio (low side)")
    epsilon_high: float | None = Field(None, gt=0, description="high side of the clip range (default epsilon)")
    normalize_advantages: bool = Field(False, description="divide the advantages by the batch's std after "
                                                          "subtracting its mean")
    reward_clip_range: tuple[float, float] | None = Field(None, description="[low, high]: each completion's "
                                                                            "weighted reward clamped to it, before "
                                                                            "the KL penalty")

    @model_validator(mode="after")
    def _clip_range_ordered(self):
        if self.reward_clip_range is not None and self.reward_clip_range[0] > self.reward_clip_range[1]:
            raise ValueError(f"reward_clip_range: low {self.reward_clip_range[0]} is above high "
                             f"{self.reward_clip_range[1]}; give [low, high]")
        return self


def resolved_beta(section: RlooSection, plugins: list[str]) -> float:
    """``beta`` as the run uses it: the section's, else TRL's 0.05 with lora and 0 without."""
    if section.beta is not None:
        return section.beta
    return TRL_BETA if "lora" in plugins else 0.0
