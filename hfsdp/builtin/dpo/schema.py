"""The ``dpo:`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hfsdp.config.schema import Section


class DpoSection(Section):
    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference (IPO: tau)")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="sigmoid (DPO), ipo or hinge")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="sigmoid: assumed share of flipped preferences")
    reference: Literal["adapter", "precomputed"] | None = Field(
        None, description="adapter (LoRA: the base with adapters disabled) or precomputed (log-probs computed once "
                          "before training, cached); default: adapter with lora, else precomputed")
