"""What rollouts that act need, checked before any weight loads, torch-free: of the config (:func:`config_problems`:
the tools and environments import and have what TRL needs of them, described in a subprocess; the code sandbox works
on this host; a tool call ends before the other ranks stop waiting), of the chat template (:func:`template_problems`:
it renders tool calls and their results, and a turn of calls stays a prefix once results follow it), and of the
rows (:func:`row_problems`: conversational prompts, each naming an environment of the mapping)."""

from __future__ import annotations

import copy
import json
from typing import Any

from hfsdp.builtin.agent.runtime import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS, ToolsetError, describe
from hfsdp.builtin.agent.rollouts import ENVIRONMENT_COLUMN, limits_of
from hfsdp.builtin.agent.sandbox import sandbox_problem
from hfsdp.builtin.prompt import ROW_COLUMN
from hfsdp.errors import UserError


def _sandboxed(section) -> list[str]:
    """The section's keys that name hfsdp's code sandbox (by its short name or its path)."""
    keys = [f"tools[{i}]" for i, name in enumerate(section.tools) if name in ("python", BUILTIN_TOOLS["python"])]
    environments = section.environment if isinstance(section.environment, dict) else {None: section.environment}
    return keys + [f"environment.{key}" if key else "environment" for key, value in environments.items()
                   if value in ("python", BUILTIN_ENVIRONMENTS["python"])]


def config_problems(config, plugin: str) -> list[tuple[str, str]]:
    """What the config's tools and environments lack (see the module docstring); none for a section that does not
    act."""
    section = config.section(plugin)
    if not section.acts:
        return []
    problems = []
    if section.tool_timeout_s >= config.train.collective_timeout_s:
        problems.append((f"{plugin}.tool_timeout_s", f"{section.tool_timeout_s:g} s is not below "
                                                     f"train.collective_timeout_s ({config.train.collective_timeout_s:g}"
                                                     " s): the other ranks, waiting for this rank's tool calls, would "
                                                     "time out first; lower it or raise train.collective_timeout_s"))
    sandboxed = _sandboxed(section)
    if sandboxed and (missing := sandbox_problem()):
        problems += [(f"{plugin}.{key}", missing) for key in sandboxed]
    try:
        describe(section.tools, section.environment, limits_of(section), plugin)
    except ToolsetError as err:
        problems += err.problems
    return problems


def template_problems(config, facts, plugin: str) -> list[tuple[str, str]]:
    """What the chat template (``data.chat_template``, else the tokenizer's) lacks for rollouts that act: rendering
    a tool call and its result, and a turn of calls that stays a prefix of the conversation once results follow
    (TRL appends the results' tokens to the sampled ones)."""
    from hfsdp.builtin.agent.turns import tool_suffix_ids
    from hfsdp.builtin.chat import chat_ids
    from hfsdp.errors import RowError
    from hfsdp.model import chat_template

    section = config.section(plugin)
    if not section.acts or facts.tokenizer is None:
        return []
    tokenizer = copy.copy(facts.tokenizer)
    if config.data.chat_template:
        chat_template.use(tokenizer, config.data.chat_template)
    key = f"{plugin}.{'tools' if section.tools else 'environment'}"
    if not getattr(tokenizer, "chat_template", None):
        return [(key, "rollouts that call tools need a chat template; the tokenizer has none: set data.chat_template "
                      "(chatml_tools renders tool calls and results)")]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"name": "Ada"}}}
    messages = [{"role": "user", "content": "Who is Ada?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "lookup", "content": "a mathematician"}]
    schema = [{"type": "function", "function": {"name": "lookup", "description": "A person, by name.", "parameters": {
        "type": "object", "properties": {"name": {"type": "string", "description": "the name"}}, "required": ["name"]}}}]
    try:
        chat_ids(messages, tokenizer, schema, add_generation_prompt=True)
        tool_suffix_ids(tokenizer, messages[2:])
    except RowError as err:
        return [(key, f"rollouts that call tools: {err}")]
    except ValueError as err:
        return [(key, f"rollouts that call tools append the results' tokens to the sampled ones, but {err}: set "
                      "data.chat_template to a template that keeps earlier turns as they are (chatml_tools; a "
                      "family's NAME_training)")]
    return []


def row_problems(dataset, section, plugin: str, split: str) -> None:
    """A UserError naming the first of the ``split`` rows that cannot act: a prompt that is not a conversation
    (TRL's tools take messages), a row of an ``environment`` mapping whose ``environment`` column names none of
    it."""
    if not section.acts:
        return
    mapping = section.environment if isinstance(section.environment, dict) else None
    for i in range(len(dataset)):
        raw: dict[str, Any] = json.loads(dataset[i][ROW_COLUMN])
        if not isinstance(raw.get("prompt"), list):
            raise UserError(f"{plugin}.tools: {split} row {i} (counting from 0) has a text prompt; rollouts that call "
                            "tools take a conversation (a list of {role, content} messages), as TRL's: give the "
                            "prompts as messages")
        if mapping is not None and raw.get(ENVIRONMENT_COLUMN) not in mapping:
            where = (f"has environment={raw[ENVIRONMENT_COLUMN]!r}" if ENVIRONMENT_COLUMN in raw
                     else "has no environment column")
            raise UserError(f"{plugin}.environment is a mapping ({', '.join(mapping)}), and {split} row {i} (counting "
                            f"from 0) {where}: each row names its environment in the column '{ENVIRONMENT_COLUMN}', "
                            "one of the mapping's names")
