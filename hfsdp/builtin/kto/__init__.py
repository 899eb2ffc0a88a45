"""Plugin ``kto``: Kahneman-Tversky Optimization (Ethayarajh et al., 2024) on ``unpaired`` rows (a completion labelled
desirable or not), TRL 1.16's ``KTOTrainer``'s loss (``loss_type="kto"``). Enable with ``plugins: [kto]`` and
``data.format: unpaired``. Config section ``kto:``: :class:`~hfsdp.builtin.kto.schema.KtoSection` (``hfsdp
config-reference kto``, docs/configuration.md). The reference routes are DPO's (``adapter`` with LoRA, else
``precomputed`` and cached). The loss, its KL estimate and its metrics: :mod:`hfsdp.builtin.kto.loss` (imported when a
run trains, so that ``hfsdp validate`` and ``hfsdp plugins`` need no torch).
"""

from __future__ import annotations

from hfsdp import hookimpl
from hfsdp.builtin.kto.schema import KtoSection
from hfsdp.builtin.reference_model import reference_problems, reference_route
from hfsdp.builtin.unpaired import format_problems
from hfsdp.rules.table import Rule


@hookimpl
def hfsdp_config_section():
    return "kto", KtoSection


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("kto", "data.format", "train.per_device_batch_size"), config_problems)]


def config_problems(config, facts):
    problems = format_problems(config, "kto") + reference_problems(config, "kto")
    train = config.train
    if train.per_device_batch_size * train.gradient_accumulation_steps < 2:
        problems.append(("train.per_device_batch_size", "kto estimates its KL term from each row's prompt with "
                                                        "another row's completion of the same step: give each step "
                                                        "at least 2 rows per rank (per_device_batch_size x "
                                                        "gradient_accumulation_steps >= 2), as TRL's KTOTrainer"))
    return problems


@hookimpl
def hfsdp_trains_on():
    return "unpaired"


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.kto.loss import KTO

    return KTO(config.section("kto"), reference_route(config, "kto"), config, tokenizer)
