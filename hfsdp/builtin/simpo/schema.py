"""The ``simpo:`` section."""

from __future__ import annotations

from pydantic import Field

from hfsdp.config.schema import Section


class SimpoSection(Section):
    beta: float = Field(2.0, gt=0, description="scale of the length-normalised log-prob margin")
    gamma: float = Field(0.5, ge=0, description="target margin (TRL's simpo_gamma)")
    nll_weight: float = Field(0.0, ge=0, description="weight of the chosen completions' NLL (TRL's cpo_alpha; 0: "
                                                     "SimPO as the paper, TRL's default 1.0: CPO-SimPO)")
