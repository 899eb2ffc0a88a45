"""Plugin ``grpo``: Group Relative Policy Optimization (online RL with reward functions) on ``prompt`` rows. Enable with
``plugins: [grpo]`` and ``data.format: prompt``. Config section ``grpo:``:
:class:`~hfsdp.builtin.grpo.schema.GrpoSection` (``hfsdp config-reference grpo``, docs/configuration.md). Rewards come
from the hook ``hfsdp_reward_functions`` (this plugin offers ``json_fields``) or ``module:function`` names, resolved
as every online objective's (:mod:`hfsdp.builtin.online.rewards`). The objective, its advantages and its loss:
:mod:`hfsdp.builtin.grpo.loss`, on the online objectives' sampler (:mod:`hfsdp.builtin.online.sampler`; both imported
when a run trains, so that ``hfsdp validate`` needs no torch).

``train.per_device_batch_size`` counts completions, as TRL's: each micro-batch holds ``per_device_batch_size /
num_generations`` prompts with their whole groups.
"""

from __future__ import annotations

import json

from hfsdp import hookimpl
from hfsdp.builtin.grpo.schema import GrpoSection
from hfsdp.builtin.online.rewards import online_problems, reward_functions


@hookimpl
def hfsdp_config_section():
    return "grpo", GrpoSection


def _json_object(text: str) -> dict | None:
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        value = json.loads(text[start:end + 1])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def json_fields(completions: list, answer: list, **kwargs) -> list[float]:
    """The share of the expected JSON fields (the ``answer`` column: a JSON object) that the completion's JSON object
    gets right; 0 when it holds none."""
    out = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        got, want = _json_object(text), json.loads(expected) if isinstance(expected, str) else expected
        out.append(0.0 if got is None or not want else sum(got.get(k) == v for k, v in want.items()) / len(want))
    return out


@hookimpl
def hfsdp_reward_functions():
    return {"json_fields": json_fields}


@hookimpl
def hfsdp_validate_config(config):
    return online_problems(config, "grpo")


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.grpo.loss import GRPO

    return GRPO(config.section("grpo"), reward_functions(config, "grpo"), config, tokenizer)
