"""The reward functions of an online objective, torch-free: offered by the enabled plugins (hook
``hfsdp_reward_functions``) or named as ``module:function``, resolved with a message that says how to fix a name
(:func:`reward_functions`), what such an objective needs of the config (:func:`online_problems`), how they are called
and what is checked of each call (:class:`RewardCaller`: a time limit, the values' count, types and finiteness, the
memory a function keeps), and the reward functions hfsdp's online plugins offer (:data:`BUILTIN_REWARDS`)."""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import signal
import sys
import threading
from typing import Any, Callable, Iterator

from hfsdp.builtin.agent.checks import config_problems as acting_problems
from hfsdp.builtin.agent.contacts import contact_answer
from hfsdp.builtin.online.schema import OnlineSection
from hfsdp.builtin.chat.tool_calls import call_of, same_json


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
    base), no generation eval or grouping, reward functions that resolve, and the tools and environments of rollouts
    that act (:func:`hfsdp.builtin.agent.checks.config_problems`)."""
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
    if section.reward_timeout_s is not None and section.reward_timeout_s >= config.train.collective_timeout_s:
        problems.append((f"{plugin}.reward_timeout_s", f"{section.reward_timeout_s:g} s is not below "
                                                       f"train.collective_timeout_s ({config.train.collective_timeout_s:g}"
                                                       " s): the other ranks, waiting for this rank's rewards, would "
                                                       "time out first without naming the function; lower it or raise "
                                                       "train.collective_timeout_s"))
    problems += acting_problems(config, plugin) + engine_problems(config, plugin)
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


def engine_problems(config, plugin: str) -> list[tuple[str, str]]:
    """What the workers engine (``generation.engine: workers``) does not run: rollouts that act (their tools run
    beside the trainer's sampler, turn by turn) and a quantized base (its copy in the generation processes is a
    full-precision module)."""
    section: OnlineSection = config.section(plugin)
    if section.generation.engine != "workers":
        return []
    problems = []
    if section.acts:
        problems.append((f"{plugin}.generation.engine", "the workers engine samples single-turn completions: rollouts "
                                                        "that call tools (tools, environment) are sampled inline; set "
                                                        "generation.engine: inline"))
    if config.model.quantization is not None:
        problems.append((f"{plugin}.generation.engine", "the generation processes hold a full-precision copy of the "
                                                        "policy, not a quantized base (model.quantization): set "
                                                        "generation.engine: inline"))
    return problems


def reward_timeout_s(section: OnlineSection, collective_timeout_s: float) -> float:
    """The seconds one call of a reward function may take: ``reward_timeout_s``, by default half of
    ``train.collective_timeout_s`` (the other ranks wait for this rank's rewards in a collective: they learn of the
    timeout before theirs)."""
    return section.reward_timeout_s if section.reward_timeout_s is not None else collective_timeout_s / 2


class RewardTimeout(BaseException):
    """Raised inside a reward function by :func:`time_limit`'s alarm (a BaseException, so that the function's own
    ``except Exception`` does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`RewardTimeout` in the code inside after ``seconds`` (a real-time alarm, SIGALRM: it interrupts
    Python code and the system calls it waits in, such as a socket read or a sleep, not a C loop that never returns
    to the interpreter). Only the main thread receives signals: elsewhere there is no limit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# A reward function whose calls (after its first, which may load a model or a cache) have kept this much more of the
# process's resident memory than they found is named in a warning, once.
KEPT_MEMORY_WARNING = 256 * 2**20


def resident_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class RewardCaller:
    """Calls an online objective's reward functions (``(name, source, function, weight)``) on a micro-batch's
    completions, TRL's calling convention, and checks each call: it returns within ``timeout_s``, one number (or None:
    no reward) per completion, each finite; the memory a function's calls keep (the resident memory after a call
    minus before it, summed over the calls after the first) is named in a warning past
    :data:`KEPT_MEMORY_WARNING`. A failed check is the message that names the plugin, the function and the rows."""

    def __init__(self, plugin: str, rewards: list, timeout_s: float, rank: int):
        self.plugin, self.rewards, self.timeout_s, self.rank = plugin, rewards, timeout_s, rank
        self.calls: dict[str, int] = {}
        self.kept: dict[str, int] = {}
        self.warned: set[str] = set()

    def where(self, name: str, source: str, fn: Callable[..., Any]) -> str:
        return f"{self.plugin} reward '{name}' (from {source}: {getattr(fn, '__qualname__', fn)})"

    def score(self, kwargs: dict[str, list], rows: list[int], group: int,
              split: str = "training") -> list[list[float]] | str:
        """``[completion][function]`` rewards (NaN: None) of the ``group`` completions of each of ``rows`` (the
        functions' keyword arguments ``kwargs``), or the message of what went wrong."""
        count = len(kwargs["completions"])
        listed = ", ".join(str(i) for i in rows)
        columns = []
        for name, source, fn, _ in self.rewards:
            where = self.where(name, source, fn)
            before = resident_bytes()
            try:
                with time_limit(self.timeout_s):
                    values = fn(**kwargs)
            except RewardTimeout:
                return (f"{where} did not return within {self.timeout_s:g} s ({self.plugin}.reward_timeout_s), "
                        f"scoring the completions of {split} rows {listed} (counting from 0) on rank {self.rank}: it "
                        "was stopped there; make it return in time (a timeout on what it waits for), or raise "
                        f"{self.plugin}.reward_timeout_s")
            except Exception as err:  # noqa: BLE001 (the user's function: reported with where it failed)
                return (f"{where} raised {type(err).__name__}: {err} (scoring the completions of {split} rows "
                        f"{listed}, counting from 0)")
            self._count_kept(name, where, resident_bytes() - before)
            if not isinstance(values, (list, tuple)) or len(values) != count:
                got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
                return (f"{where} returned {got} for {count} completions ({split} rows {listed}): return a list of "
                        "one float (or None) per completion")
            for index, v in enumerate(values):
                if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
                    return (f"{where} returned {v!r} for the completion of {split} row {rows[index // group]}: "
                            "rewards are numbers (or None for no reward)")
                if v is not None and not math.isfinite(v):
                    return (f"{where} returned {v!r} for completion {index % group} of {split} row "
                            f"{rows[index // group]}: a reward is a finite number; return None where a function gives "
                            "no reward")
            columns.append([math.nan if v is None else float(v) for v in values])
        return [list(r) for r in zip(*columns)]

    def _count_kept(self, name: str, where: str, grown: int) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.calls[name] == 1:
            return  # a first call may load what the function then keeps on purpose (a model, a cache)
        self.kept[name] = self.kept.get(name, 0) + grown
        if self.kept[name] > KEPT_MEMORY_WARNING and name not in self.warned:
            self.warned.add(name)
            print(f"hfsdp: warning: rank {self.rank}: {where} has kept {self.kept[name] / 2**20:.0f} MiB more "
                  f"resident memory over its {self.calls[name] - 1} calls after the first (a list or a cache that "
                  "grows with every call?); a run of many steps may run out of memory", file=sys.stderr, flush=True)


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
    arguments}``, or a JSON text of it), its name and arguments equal as JSON values; else 0. A rollout that acted
    (its completion: the assistant's turns and the tools' results, as TRL's) is scored by the first call it made."""
    out = []
    for completion, expected in zip(completions, answer):
        messages = completion if isinstance(completion, list) else []
        asked = [m["tool_calls"] for m in messages if m.get("role") == "assistant" and m.get("tool_calls")]
        calls = [c for c in map(call_of, asked[0] if asked else []) if c is not None]
        want = call_of(json.loads(expected) if isinstance(expected, str) else expected)
        out.append(float(bool(calls) and want is not None and calls[0]["name"] == want["name"]
                         and same_json(calls[0]["arguments"], want["arguments"])))
    return out


# What the online plugins (grpo, rloo) offer through hfsdp_reward_functions.
BUILTIN_REWARDS = {"json_fields": json_fields, "tool_call": tool_call, "contact_answer": contact_answer}
