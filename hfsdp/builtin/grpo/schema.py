"""The ``grpo:`` section: the online objectives' keys (:class:`hfsdp.builtin.online.schema.OnlineSection`) and
GRPO's loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hfsdp.builtin.online.schema import OnlineSection


class GrpoSection(OnlineSection):
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo", description="TRL's definitions: grpo (each completion's token mean), bnpo (the micro-batch's token "
                            "mean), dr_grpo (tokens over max_new_tokens), dapo (the global batch's token mean)")
    epsilon: float = Field(0.2, gt=0, description="clip range of the probability ratio (low side)")
    epsilon_high: float | None = Field(None, gt=0, description="high side of the clip range (default epsilon; "
                                                               "DAPO: 0.28)")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's reward std, the whole batch's, or not at all")
