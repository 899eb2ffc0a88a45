"""Plugin ``orpo``: Odds Ratio Preference Optimization (Hong, Lee and Thorne, 2024) on ``preference`` rows, with no
reference model: the chosen rows' NLL minus ``beta`` times the mean log-sigmoid of the odds ratio, TRL 1.16's
``ORPOTrainer``'s loss. Enable with ``plugins: [orpo]`` and ``data.format: preference``. Config section ``orpo:``:
:class:`OrpoSection`. The loss and its metrics: :mod:`hfsdp.builtin.reference_free` (imported when a run trains).
"""

from __future__ import annotations

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.builtin.preference import format_problems
from hfsdp.config.schema import Section


class OrpoSection(Section):
    beta: float = Field(0.1, gt=0, description="weight of the odds-ratio term against the chosen rows' NLL (the "
                                                "paper's lambda, TRL's beta)")


@hookimpl
def hfsdp_config_section():
    return "orpo", OrpoSection


@hookimpl
def hfsdp_validate_config(config):
    return format_problems(config, "orpo")


@hookimpl
def hfsdp_objective(config):
    from hfsdp.builtin.reference_free import ORPO

    return ORPO(config.section("orpo"))
