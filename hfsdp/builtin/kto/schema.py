"""The ``kto:`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hfsdp.config.schema import Section


class KtoSection(Section):
    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference")
    desirable_weight: float = Field(1.0, gt=0, description="weight of the desirable rows' losses (to balance "
                                                           "unequal numbers of desirable and undesirable rows)")
    undesirable_weight: float = Field(1.0, gt=0, description="weight of the undesirable rows' losses")
    reference: Literal["adapter", "precomputed"] | None = Field(
        None, description="adapter (LoRA: the base with adapters disabled) or precomputed (log-probs of each row and "
                          "of its KL row computed once before training, cached); default: adapter with lora, else "
                          "precomputed")
