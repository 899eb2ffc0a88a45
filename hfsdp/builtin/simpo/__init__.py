"""Plugin ``simpo``: Simple Preference Optimization (Meng, Xia and Chen, 2024) on ``preference`` rows, with no
reference model: ``-log sigmoid(beta * (c - r) - gamma)`` on the completions' per-token average log-probs, TRL
1.16's ``CPOTrainer`` with ``loss_type="simpo"``; ``nll_weight`` (TRL's ``cpo_alpha``) adds the chosen
completions' NLL (CPO-SimPO). Enable with ``plugins: [simpo]`` and ``data.format: preference``. Config section
``simpo:``: :class:`~hfsdp.builtin.simpo.schema.SimpoSection`. The loss and its metrics:
:mod:`hfsdp.builtin.reference_free.loss`.
"""

from __future__ import annotations

from hfsdp import hookimpl
from hfsdp.builtin.simpo.schema import SimpoSection
from hfsdp.builtin.preference import format_problems
from hfsdp.rules.table import Rule


@hookimpl
def hfsdp_config_section():
    return "simpo", SimpoSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("simpo", "data.format"), config_problems)]


def config_problems(config, facts):
    return format_problems(config, "simpo")


@hookimpl
def hfsdp_trains_on():
    return "preference"


@hookimpl
def hfsdp_objective(config):
    from hfsdp.builtin.reference_free.loss import SimPO

    return SimPO(config.section("simpo"))
