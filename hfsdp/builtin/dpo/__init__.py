"""Plugin ``dpo``: Direct Preference Optimization (and IPO, hinge) on ``preference`` rows. Enable with
``plugins: [dpo]`` and ``data.format: preference``. Config section ``dpo:``: :class:`DpoSection` (``hfsdp
config-reference dpo``, docs/configuration.md). The loss, its reference routes and its metrics:
:mod:`hfsdp.builtin.dpo.loss` (imported when a run trains, so that ``hfsdp validate`` and ``hfsdp plugins`` need
no torch).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.builtin.preference import format_problems
from hfsdp.config.schema import Section


class DpoSection(Section):
    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference (IPO: tau)")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="sigmoid (DPO), ipo or hinge")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="sigmoid: assumed share of flipped preferences")
    reference: Literal["adapter", "precomputed"] | None = Field(
        None, description="adapter (LoRA: the base with adapters disabled) or precomputed (log-probs computed once "
                          "before training, cached); default: adapter with lora, else precomputed")


@hookimpl
def hfsdp_config_section():
    return "dpo", DpoSection


def reference_route(config, plugin: str = "dpo") -> str:
    """The reference route of ``plugin``'s section (its ``reference``; DPO's, KTO's): adapter with lora, else
    precomputed, unless the section names one."""
    return config.section(plugin).reference or ("adapter" if "lora" in config.plugins else "precomputed")


def reference_problems(config, plugin: str = "dpo") -> list[tuple[str, str]]:
    """The adapter route without lora (``plugin``'s section's ``reference``)."""
    if config.section(plugin).reference == "adapter" and "lora" not in config.plugins:
        return [(f"{plugin}.reference", "adapter: the reference is the base model with the LoRA adapters disabled, "
                                        "but lora is not enabled; add lora to plugins, or use reference: precomputed "
                                        "(full fine-tuning)")]
    return []


@hookimpl
def hfsdp_validate_config(config):
    section: DpoSection = config.section("dpo")
    problems = format_problems(config, "dpo") + reference_problems(config)
    if section.label_smoothing and section.loss_type != "sigmoid":
        problems.append(("dpo.label_smoothing", f"applies to loss_type sigmoid only, not {section.loss_type}"))
    return problems


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.dpo.loss import DPO

    return DPO(config.section("dpo"), reference_route(config), config, tokenizer)
