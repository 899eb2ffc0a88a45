"""Plugin ``orpo``: Odds Ratio Preference Optimization (Hong, Lee and Thorne, 2024) on ``preference`` rows, with no
reference model: the chosen rows' NLL minus ``beta`` times the mean log-sigmoid of the odds ratio, TRL 1.16's
``ORPOTrainer``'s loss. Enable with ``plugins: [orpo]`` and ``data.format: preference``. Config section ``orpo:``:
:class:`~hfsdp.builtin.orpo.schema.OrpoSection`. The loss and its metrics: :mod:`hfsdp.builtin.reference_free.loss`
(imported when a run trains).
"""

from __future__ import annotations

from hfsdp import hookimpl
from hfsdp.builtin.orpo.schema import OrpoSection
from hfsdp.builtin.preference import format_problems
from hfsdp.rules.table import Rule


@hookimpl
def hfsdp_config_section():
    return "orpo", OrpoSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("orpo", "data.format"), config_problems)]


def config_problems(config, facts):
    return format_problems(config, "orpo")


@hookimpl
def hfsdp_trains_on():
    return "preference"


@hookimpl
def hfsdp_objective(config):
    from hfsdp.builtin.reference_free.loss import ORPO

    return ORPO(config.section("orpo"))
