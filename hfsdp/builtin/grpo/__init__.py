"""Plugin ``grpo``: Group Relative Policy Optimization (online RL with reward functions) on ``prompt`` rows. Enable with
``plugins: [grpo]`` and ``data.format: prompt``. Config section ``grpo:``:
:class:`~hfsdp.builtin.grpo.schema.GrpoSection` (``hfsdp config-reference grpo``, docs/configuration.md). Rewards come
from the hook ``hfsdp_reward_functions`` (this plugin offers ``json_fields`` and ``tool_call``) or
``module:function`` names, resolved as every online objective's (:mod:`hfsdp.builtin.online.rewards`). The
objective, its advantages and its loss: :mod:`hfsdp.builtin.grpo.loss`, on the online objectives' sampler
(:mod:`hfsdp.builtin.online.sampler`; both imported when a run trains, so that ``hfsdp validate`` needs no torch).

``train.per_device_batch_size`` counts completions, as TRL's: each micro-batch holds ``per_device_batch_size /
num_generations`` prompts with their whole groups.
"""

from __future__ import annotations

import json

from hfsdp import hookimpl
from hfsdp.builtin.grpo.schema import GrpoSection
from hfsdp.builtin.online.rewards import online_problems, reward_functions
from hfsdp.builtin.tool_calls import call_of, same_json


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


def tool_call(completions: list, answer: list, **kwargs) -> list[float]:
    """1 where the completion's first tool call (the message's ``tool_calls``, as the chat template's response format
    parses them: :func:`hfsdp.builtin.chat.parse_completion`) is the expected one (the ``answer`` column: ``{name,
    arguments}``, or a JSON text of it), its name and arguments equal as JSON values; else 0."""
    out = []
    for completion, expected in zip(completions, answer):
        message = completion[-1] if isinstance(completion, list) else {}
        calls = [c for c in map(call_of, message.get("tool_calls") or []) if c is not None]
        want = call_of(json.loads(expected) if isinstance(expected, str) else expected)
        out.append(float(bool(calls) and want is not None and calls[0]["name"] == want["name"]
                         and same_json(calls[0]["arguments"], want["arguments"])))
    return out


@hookimpl
def hfsdp_reward_functions():
    return {"json_fields": json_fields, "tool_call": tool_call}


@hookimpl
def hfsdp_validate_config(config):
    return online_problems(config, "grpo")


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.grpo.loss import GRPO

    return GRPO(config.section("grpo"), reward_functions(config, "grpo"), config, tokenizer)
