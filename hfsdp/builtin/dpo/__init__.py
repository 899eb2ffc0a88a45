"""Plugin ``dpo``: Direct Preference Optimization (and IPO, hinge) on ``preference`` rows. Enable with ``plugins: [dpo]``
and ``data.format: preference``. Config section ``dpo:``: :class:`~hfsdp.builtin.dpo.schema.DpoSection` (``hfsdp
config-reference dpo``, docs/configuration.md). The loss, its reference routes and its metrics:
:mod:`hfsdp.builtin.dpo.loss` (imported when a run trains, so that ``hfsdp validate`` and ``hfsdp plugins`` need no
torch).
"""

from __future__ import annotations

from hfsdp import hookimpl
from hfsdp.builtin.dpo.schema import DpoSection
from hfsdp.builtin.preference import format_problems
from hfsdp.builtin.reference_model import reference_problems, reference_route
from hfsdp.rules.table import Rule


@hookimpl
def hfsdp_config_section():
    return "dpo", DpoSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("dpo", "data.format"), config_problems)]


def config_problems(config, facts):
    section: DpoSection = config.section("dpo")
    problems = format_problems(config, "dpo") + reference_problems(config)
    if section.label_smoothing and section.loss_type != "sigmoid":
        problems.append(("dpo.label_smoothing", f"applies to loss_type sigmoid only, not {section.loss_type}"))
    return problems


@hookimpl
def hfsdp_trains_on():
    return "preference"


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.dpo.loss import DPO

    return DPO(config.section("dpo"), reference_route(config), config, tokenizer)
