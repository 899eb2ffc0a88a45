"""Plugin ``simpo``: Simple Preference Optimization (Meng, Xia and Chen, 2024) on ``preference`` rows, with no
reference model: ``-log sigmoid(beta * (c - r) - gamma)`` on the completions' per-token average log-probs, TRL
1.16's ``CPOTrainer`` with ``loss_type="simpo"``; ``nll_weight`` (TRL's ``cpo_alpha``) adds the chosen
completions' NLL (CPO-SimPO). Enable with ``plugins: [simpo]`` and ``data.format: preference``. Config section
``simpo:``: :class:`SimpoSection`. The loss and its metrics: :mod:`hfsdp.builtin.reference_free`.
"""

from __future__ import annotations

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.builtin.preference import format_problems
from hfsdp.config.schema import Section


class SimpoSection(Section):
    beta: float = Field(2.0, gt=0, description="scale of the length-normalised log-prob margin")
    gamma: float = Field(0.5, ge=0, description="target margin (TRL's simpo_gamma)")
    nll_weight: float = Field(0.0, ge=0, description="weight of the chosen completions' NLL (TRL's cpo_alpha; 0: "
                                                     "SimPO as the paper, TRL's default 1.0: CPO-SimPO)")


@hookimpl
def hfsdp_config_section():
    return "simpo", SimpoSection


@hookimpl
def hfsdp_validate_config(config):
    return format_problems(config, "simpo")


@hookimpl
def hfsdp_objective(config):
    from hfsdp.builtin.reference_free import SimPO

    return SimPO(config.section("simpo"))
