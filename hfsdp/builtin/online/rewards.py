"""The reward functions of an online objective, torch-free: offered by the enabled plugins (hook
``hfsdp_reward_functions``) or named as ``module:function``, resolved with a message that says how to fix a name
(:func:`reward_functions`), what such an objective needs of the config (:func:`online_problems`), and the reward
functions hfsdp's online plugins offer (:data:`BUILTIN_REWARDS`)."""

from __future__ import annotations

import importlib
import json
from typing import Any, Callable

from hfsdp.builtin.online.schema import OnlineSection
from hfsdp.builtin.tool_calls import call_of, same_json


def installed_rewards(enabled: list[str], plugin: str) -> dict[str, tuple[str, Callable[..., Any]]]:
    """Reward name -> (plugin, function) of the enabled plugins; a name two plugins offer is a ConfigError at
    ``{plugin}.rewards``."""
    from hfsdp.hooks.host import PluginHost

    return PluginHost(enabled).registry("hfsdp_reward_functions", f"{plugin}.rewards", "reward", "offered")


def _offered_by_disabled(name: str, enabled: list[str]) -> str | None:
    """The installed, not enabled plugin that offers reward ``name`` (to say "enable it"), or None."""
    from hfsdp.hooks.host import discover

    for plugin, ep in sorted(discover().items()):
        if plugin in enabled:
            continue
        try:
            offer = getattr(ep.load(), "hfsdp_reward_functions", None)
            if callable(offer) and hasattr(offer, "hfsdp_impl") and name in (offer() or {}):
                return plugin
        except Exception:  # noqa: BLE001 (a broken plugin is reported when it is enabled)
            continue
    return None


def resolve_reward(name: str, enabled: list[str], offered: dict) -> tuple[str, Callable[..., Any]]:
    """(where it comes from, function) of one ``rewards`` name, or ValueError saying how to fix it."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ImportError as err:
            raise ValueError(f"'{name}': cannot import module '{module}' ({err}); check the name and that it is "
                             "installed or on PYTHONPATH") from None
        except AttributeError:
            raise ValueError(f"'{name}': module '{module}' has no function '{attr}'") from None
        if not callable(fn):
            raise ValueError(f"'{name}' is a {type(fn).__name__}, not a function")
        return module, fn
    if name in offered:
        return offered[name]
    plugin = _offered_by_disabled(name, enabled)
    if plugin is not None:
        raise ValueError(f"'{name}' is offered by plugin '{plugin}', which is not enabled: add {plugin} to plugins")
    known = ", ".join(sorted(offered)) or "none"
    raise ValueError(f"unknown reward '{name}' (offered by the enabled plugins: {known}); name one of them, or a "
                     "function as module:function")


def reward_functions(config, plugin: str) -> list[tuple[str, str, Callable[..., Any], float]]:
    """(name, plugin or module, function, weight) of every ``rewards`` entry of ``plugin``'s section."""
    section: OnlineSection = config.section(plugin)
    offered = installed_rewards(config.plugins, plugin)
    out = []
    for spec in section.rewards:
        source, fn = resolve_reward(spec.name, config.plugins, offered)
        out.append((spec.name, source, fn, spec.weight))
    return out


def online_problems(config, plugin: str, kl_reference: bool = True) -> list[tuple[str, str]]:
    """What an online objective (``plugin``'s section, an :class:`OnlineSection`) needs of the config: prompt rows,
    whole groups per micro-batch, lora for the KL reference (``kl_reference``: its ``beta`` weighs a KL to the
    base), no generation eval or grouping, and reward functions that resolve."""
    section: OnlineSection = config.section(plugin)
    problems = []
    if config.data.format != "prompt":
        problems.append(("data.format", f"{plugin} generates completions of prompts: set data.format: prompt (rows with "
                                        f"a prompt and the columns the rewards read), not '{config.data.format}'"))
    batch = config.train.per_device_batch_size
    if batch % section.num_generations:
        problems.append((f"{plugin}.num_generations", f"{section.num_generations} does not divide "
                                                 f"train.per_device_batch_size ({batch}), which counts completions: "
                                                 "a micro-batch holds whole groups; make the batch a multiple of it"))
    if kl_reference and (section.beta or 0) > 0 and "lora" not in config.plugins:  # (None: the objective's default)
        problems.append((f"{plugin}.beta", "the KL reference is the base model with the LoRA adapters disabled: add lora "
                                      "to plugins, or set beta: 0 (a frozen copy for full fine-tuning is not built yet)"))
    if config.generation_eval:
        problems.append(("generation_eval", f"{plugin}'s eval is the mean reward of completions sampled for each eval "
                                            "prompt (eval_reward): remove the generation_eval section"))
    if config.train.group_by_length:
        problems.append(("train.group_by_length", f"{plugin}'s batches are prompts with their groups: remove it"))
    try:
        offered = installed_rewards(config.plugins, plugin)
    except Exception as err:  # noqa: BLE001 (a ConfigError's problems, or a broken plugin)
        return problems + list(getattr(err, "problems", [(f"{plugin}.rewards", str(err))]))
    for i, spec in enumerate(section.rewards):
        try:
            resolve_reward(spec.name, config.plugins, offered)
        except ValueError as err:
            problems.append((f"{plugin}.rewards[{i}].name", str(err)))
    return problems


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


# What the online plugins (grpo, rloo) offer through hfsdp_reward_functions.
BUILTIN_REWARDS = {"json_fields": json_fields, "tool_call": tool_call}
