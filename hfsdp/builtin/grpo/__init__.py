"""Plugin ``grpo``: Group Relative Policy Optimization (online RL with reward functions) on ``prompt`` rows. Enable with
``plugins: [grpo]`` and ``data.format: prompt``. Config section ``grpo:``:
:class:`~hfsdp.builtin.grpo.schema.GrpoSection` (``hfsdp config-reference grpo``, docs/configuration.md). Rewards come
from the hook ``hfsdp_reward_functions`` (this plugin offers ``json_fields``) or ``module:function`` names. The
objective, its sampling and its loss: :mod:`hfsdp.builtin.grpo.loss` (imported when a run trains, so that ``hfsdp
validate`` needs no torch).

``train.per_device_batch_size`` counts completions, as TRL's: each micro-batch holds ``per_device_batch_size /
num_generations`` prompts with their whole groups.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Callable

from hfsdp import hookimpl
from hfsdp.builtin.grpo.schema import GrpoSection


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


def installed_rewards(enabled: list[str]) -> dict[str, tuple[str, Callable[..., Any]]]:
    """Reward name -> (plugin, function) of the enabled plugins; a name two plugins offer is a ConfigError."""
    from hfsdp.hooks.host import PluginHost

    return PluginHost(enabled).registry("hfsdp_reward_functions", "grpo.rewards", "reward", "offered")


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
    """(where it comes from, function) of one ``grpo.rewards`` name, or ValueError saying how to fix it."""
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


def reward_functions(config) -> list[tuple[str, str, Callable[..., Any], float]]:
    """(name, plugin or module, function, weight) of every ``grpo.rewards`` entry."""
    section: GrpoSection = config.section("grpo")
    offered = installed_rewards(config.plugins)
    out = []
    for spec in section.rewards:
        source, fn = resolve_reward(spec.name, config.plugins, offered)
        out.append((spec.name, source, fn, spec.weight))
    return out


@hookimpl
def hfsdp_validate_config(config):
    section: GrpoSection = config.section("grpo")
    problems = []
    if config.data.format != "prompt":
        problems.append(("data.format", f"grpo generates completions of prompts: set data.format: prompt (rows with "
                                        f"a prompt and the columns the rewards read), not '{config.data.format}'"))
    batch = config.train.per_device_batch_size
    if batch % section.num_generations:
        problems.append(("grpo.num_generations", f"{section.num_generations} does not divide "
                                                 f"train.per_device_batch_size ({batch}), which counts completions: "
                                                 "a micro-batch holds whole groups; make the batch a multiple of it"))
    if section.beta > 0 and "lora" not in config.plugins:
        problems.append(("grpo.beta", "the KL reference is the base model with the LoRA adapters disabled: add lora "
                                      "to plugins, or set beta: 0 (a frozen copy for full fine-tuning is not built yet)"))
    if config.generation_eval:
        problems.append(("generation_eval", "grpo's eval is the mean reward of completions sampled for each eval "
                                            "prompt (eval_reward): remove the generation_eval section"))
    if config.train.group_by_length:
        problems.append(("train.group_by_length", "grpo's batches are prompts with their groups: remove it"))
    if "packing" in config.plugins:
        problems.append(("plugins", "packing cannot pack grpo's rows: each completion is scored whole; remove packing"))
    try:
        offered = installed_rewards(config.plugins)
    except Exception as err:  # noqa: BLE001 (a ConfigError's problems, or a broken plugin)
        return problems + list(getattr(err, "problems", [("grpo.rewards", str(err))]))
    for i, spec in enumerate(section.rewards):
        try:
            resolve_reward(spec.name, config.plugins, offered)
        except ValueError as err:
            problems.append((f"grpo.rewards[{i}].name", str(err)))
    return problems


@hookimpl
def hfsdp_objective(config, tokenizer):
    from hfsdp.builtin.grpo.loss import GRPO

    return GRPO(config.section("grpo"), reward_functions(config), config, tokenizer)
