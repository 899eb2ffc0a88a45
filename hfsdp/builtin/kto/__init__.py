"""Plugin ``kto``: Kahneman-Tversky Optimization (Ethayarajh et al., 2024) on ``unpaired`` rows (a completion
labelled desirable or not), TRL 1.16's ``KTOTrainer``'s loss (``loss_type="kto"``). Enable with ``plugins: [kto]``
and ``data.format: unpaired``. Config section ``kto:``: :class:`KtoSection` (``hfsdp config-reference kto``,
docs/configuration.md). The reference routes are DPO's (``adapter`` with LoRA, else ``precomputed`` and cached). The
loss, its KL estimate and its metrics: :mod:`hfsdp.builtin.kto.loss` (imported when a run trains, so that ``hfsdp
validate`` and ``hfsdp plugins`` need no torch).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hfsdp import hookimpl
from hfsdp.builtin.dpo import reference_problems, reference_route
from hfsdp.builtin.unpaired import format_problems
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


@hookimpl
def hfsdp_config_section():
    return "kto", KtoSection


@hookimpl
def hfsdp_validate_config(config):
    problems = format_problems(config, "kto") + reference_problems(config, "kto")
    train = config.train
    if train.per_device_batch_size * train.gradient_accumulation_steps < 2:
        problems.append(("train.per_device_batch_size", "kto estimates its KL term from each row's prompt with "
                                                        "another row's completion of the same step: give each step "
                                                        "at least 2 rows per rank (per_device_batch_size x "
                                                        "gradient_accumulation_steps >= 2), as TRL's KTOTrainer"))
    return problems


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.kto.loss import KTO

    return KTO(config.section("kto"), reference_route(config, "kto"), config, tokenizer)
