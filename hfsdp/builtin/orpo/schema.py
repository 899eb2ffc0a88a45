"""The ``orpo:`` section."""

from __future__ import annotations

from pydantic import Field

from hfsdp.config.schema import Section


class OrpoSection(Section):
    beta: float = Field(0.1, gt=0, description="weight of the odds-ratio term against the chosen rows' NLL (the "
                                                "paper's lambda, TRL's beta)")
