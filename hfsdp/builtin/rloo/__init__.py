"""Plugin ``rloo``: REINFORCE leave-one-out (TRL 1.16's ``RLOOTrainer``), online RL with reward functions on ``prompt``
rows. Enable with ``plugins: [rloo]`` and ``data.format: prompt``. Config section ``rloo:``:
:class:`~hfsdp.builtin.rloo.schema.RlooSection` (``hfsdp config-reference rloo``, docs/configuration.md). Rewards
come from the hook ``hfsdp_reward_functions`` (this plugin offers ``json_fields``, ``tool_call`` and
``contact_answer``, as ``grpo`` does) or ``module:function`` names, called as TRL calls them. The objective, its
advantages and its loss: :mod:`hfsdp.builtin.rloo.loss`, on the online objectives' base class
(:mod:`hfsdp.builtin.online.objective`; both imported when a run trains, so that ``hfsdp validate`` needs no torch).

``train.per_device_batch_size`` counts completions, as TRL's: each micro-batch holds ``per_device_batch_size /
num_generations`` prompts with their whole groups.
"""

from __future__ import annotations

from hfsdp import hookimpl
from hfsdp.builtin.agent.checks import template_problems
from hfsdp.builtin.online.rewards import BUILTIN_REWARDS, online_problems, reward_functions
from hfsdp.builtin.rloo.schema import RlooSection, resolved_beta
from hfsdp.rules.table import Rule


@hookimpl
def hfsdp_config_section():
    return "rloo", RlooSection


@hookimpl
def hfsdp_reward_functions():
    return dict(BUILTIN_REWARDS)


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("rloo", "data.format"), config_problems),
            Rule("model", ("rloo.tools", "rloo.environment", "data.chat_template"),
                 lambda c, f: template_problems(c, f, "rloo"))]


def config_problems(config, facts):
    return online_problems(config, "rloo")


@hookimpl
def hfsdp_trains_on():
    return "prompt"


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.rloo.loss import RLOO

    section = config.section("rloo")
    section = section.model_copy(update={"beta": resolved_beta(section, config.plugins)})
    return RLOO(section, reward_functions(config, "rloo"), config, tokenizer)
