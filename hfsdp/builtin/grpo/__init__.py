"""Plugin ``grpo``: Group Relative Policy Optimization (online RL with reward functions) on ``prompt`` rows. Enable with
``plugins: [grpo]`` and ``data.format: prompt``. Config section ``grpo:``:
:class:`~hfsdp.builtin.grpo.schema.GrpoSection` (``hfsdp config-reference grpo``, docs/configuration.md). Rewards come
from the hook ``hfsdp_reward_functions`` (this plugin offers ``json_fields``, ``tool_call`` and ``contact_answer``, as
``rloo`` does) or ``module:function`` names, resolved as every online objective's (:mod:`hfsdp.builtin.online.rewards`). The
objective, its advantages and its loss: :mod:`hfsdp.builtin.grpo.loss`, on the online objectives' base class
(:mod:`hfsdp.builtin.online.objective`; both imported when a run trains, so that ``hfsdp validate`` needs no torch).

``train.per_device_batch_size`` counts completions, as TRL's: each micro-batch holds ``per_device_batch_size /
num_generations`` prompts with their whole groups.
"""

from __future__ import annotations

from hfsdp import hookimpl
from hfsdp.builtin.grpo.schema import GrpoSection
from hfsdp.builtin.agent.checks import template_problems
from hfsdp.builtin.online.rewards import BUILTIN_REWARDS, online_problems, reward_functions
from hfsdp.rules.table import Rule


@hookimpl
def hfsdp_config_section():
    return "grpo", GrpoSection


@hookimpl
def hfsdp_reward_functions():
    return dict(BUILTIN_REWARDS)


@hookimpl
def hfsdp_rules():
    return [Rule("config", ("grpo", "data.format"), config_problems),
            Rule("model", ("grpo.tools", "grpo.environment", "data.chat_template"),
                 lambda c, f: template_problems(c, f, "grpo"))]


def config_problems(config, facts):
    return online_problems(config, "grpo")


@hookimpl
def hfsdp_trains_on():
    return "prompt"


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.grpo.loss import GRPO

    return GRPO(config.section("grpo"), reward_functions(config, "grpo"), config, tokenizer)
