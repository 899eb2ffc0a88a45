"""An online objective's rollouts that act (:class:`Agent`): the section's ``tools`` and ``environment`` described
once (their schemas, which are coroutines, which environment classes own a reward: in a subprocess, never imported
by the trainer), a worker process per rollout on each rank (:class:`hfsdp.builtin.agent.runtime.ToolWorkers`), and
a round's rollouts as TRL's ``GRPOTrainer`` makes them with ``tools=`` and ``environment_factory=``: each rollout's
environment reset with its row (``reset(**row)``; a mapping's rows name theirs in the ``environment`` column, which
``reset`` does not receive), the text it returns appended to the prompt's last message, the prompt rendered with
the tools' schemas, the turns taken (:func:`hfsdp.builtin.agent.turns.act`) and the environments' ``get_reward``
read after the last turn: one more reward per environment class that defines it, named after the class, weight 1
(:class:`EnvironmentReward`)."""

from __future__ import annotations

import ast
import json
from typing import Any, Callable

from hfsdp.builtin.agent.runtime import Limits, RolloutError, ToolWorkers, describe
from hfsdp.builtin.agent.turns import act
from hfsdp.builtin.chat import chat_ids, conversation
from hfsdp.builtin.prompt import ROW_COLUMN
from hfsdp.errors import RowError, UserError

ENVIRONMENT_COLUMN = "environment"  # a row's environment, where ``environment`` is a mapping (TRL's column)


class EnvironmentReward:
    """The reward column of environment class ``name``: each rollout's ``get_reward()`` where its environment is of
    that class (exactly, as TRL), None elsewhere; read from the ``environment_rewards`` the rollouts carry
    (``(class name, value)`` each)."""

    def __init__(self, name: str):
        self.name = name
        self.__qualname__ = f"{name}.get_reward"

    def __call__(self, environment_rewards: list, **kwargs) -> list[float | None]:
        return [value if owner == self.name else None for owner, value in environment_rewards]


def limits_of(section) -> Limits:
    return Limits(section.tool_timeout_s, section.tool_memory_mb, section.tool_cpu_s)


class Agent:
    """The tools and environments of objective ``name``'s ``section`` (an
    :class:`~hfsdp.builtin.online.schema.OnlineSection` that acts) on rank ``rank``."""

    def __init__(self, section, name: str, tokenizer, data_config, rank: int):
        self.section, self.name, self.tokenizer, self.data_config = section, name, tokenizer, data_config
        self.toolset = describe(section.tools, section.environment, limits_of(section), name)
        self.workers = ToolWorkers(self.toolset, limits_of(section), name, rank)

    def reward_functions(self) -> list[tuple[str, str, Callable[..., Any], float]]:
        """The environment classes' rewards, as the objective's reward functions are listed: ``(name, source,
        function, weight)``, one per class that defines ``get_reward``, in the mapping's order."""
        owners = dict.fromkeys(owner for owner in self.toolset.rewarded.values() if owner is not None)
        source = {self.toolset.rewarded[env]: path for env, path in self.toolset.environments.items()}
        return [(owner, source[owner].partition(":")[0], EnvironmentReward(owner), 1.0) for owner in owners]

    def roll_out(self, dataset, rows: list[int], seeds: Callable[[int, int], int], sample, gather, budget: int,
                 context: int) -> dict[str, list]:
        """This rank's rollouts of dataset ``rows`` (one per rollout, in order; ``seeds(i, turn)``: rollout ``i``'s
        seed of that turn), as per-rollout lists: ``prompt_ids``, ``completion_ids``, ``tool_masks``, ``messages``
        (the completion's turns and tool results), ``observations`` (what ``reset`` appended), ``environment_rewards``
        and ``tool_stats``. ``sample`` and ``gather`` as :func:`~hfsdp.builtin.agent.turns.act` takes them; a reset,
        a prompt or a ``get_reward`` that fails on any rank stops every rank with its message. Collective."""
        raws = [json.loads(dataset[row][ROW_COLUMN]) for row in rows]
        failure, prompts, environments, observations = None, [], [], []
        try:
            environments = [self._environment_of(raw) for raw in raws]
            observations = self.workers.open([(env, self._reset_arguments(raw)) for env, raw in zip(environments,
                                                                                                   raws)])
            prompts = [self._prompt_ids(raw, env, seen) for raw, env, seen in zip(raws, environments, observations)]
        except (RolloutError, RowError, UserError) as err:
            failure = str(err)
        self._agree(gather, failure)
        rollouts = act(sample, gather, prompts, [self.toolset.schemas[env] or None for env in environments],
                       [self.toolset.asynchronous[env] for env in environments], seeds, self.workers, self.tokenizer,
                       budget, context, self.section.max_tool_calling_iterations)
        rewards, failure = [None] * len(rollouts), None
        if any(self.toolset.rewarded.values()):
            try:
                rewards = self.workers.rewards()
            except RolloutError as err:
                failure = str(err)
        self._agree(gather, failure)
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "tool_masks": [r.tool_mask for r in rollouts],
            "messages": [r.messages for r in rollouts],
            "observations": observations,
            "environment_rewards": [[self.toolset.rewarded[env], value] for env, value in zip(environments, rewards)],
            "tool_stats": [{"calls": r.calls, "failures": r.failures, "turns": r.turns, "rolled_back": r.rolled_back,
                            "answered_from_result": int(answered_from_result(r.messages)),
                            **{f"failed_{kind}": n for kind, n in r.failure_kinds.items()}} for r in rollouts],
        }

    @staticmethod
    def _agree(gather, failure: str | None) -> None:
        """Raise on every rank the first rank's failure, if any rank has one (collective)."""
        failures = [f for f in gather(failure) if f is not None]
        if failures:
            raise UserError(failures[0])

    def _environment_of(self, raw: dict[str, Any]) -> str | None:
        """The name of the row's environment: the ``environment`` column where ``environment`` is a mapping (a
        name of it: checks.row_problems)."""
        return raw[ENVIRONMENT_COLUMN] if isinstance(self.section.environment, dict) else None

    def _reset_arguments(self, raw: dict[str, Any]) -> dict[str, Any]:
        """What ``reset`` receives: the row's columns (TRL's: every one, less ``environment`` for a mapping)."""
        if isinstance(self.section.environment, dict):
            return {k: v for k, v in raw.items() if k != ENVIRONMENT_COLUMN}
        return raw

    def _prompt_ids(self, raw: dict[str, Any], environment: str | None, observation: str | None) -> list[int]:
        """The row's prompt with the environment's ``observation`` after its last message's text, rendered with the
        tools' schemas and the generation prompt."""
        messages = conversation(raw["prompt"], self.data_config)  # a conversation: checks.row_problems
        if observation is not None:
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
        return chat_ids(messages, self.tokenizer, self.toolset.schemas[environment] or None,
                        add_generation_prompt=True)

    def close(self) -> None:
        self.workers.close()


def _leaves(value: Any) -> list[str]:
    """The scalar values inside a JSON value, as text (strings as they are, numbers and booleans as JSON writes
    them)."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    if value is None:
        return []
    return [value if isinstance(value, str) else json.dumps(value)]


def _result_value(content: str) -> Any:
    """A tool result's value: its JSON, else the Python literal it writes (``str(result)``, TRL's error text
    ``str({"error": ...})``), else the text itself."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(content)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return content


def answered_from_result(messages: list[dict[str, Any]]) -> bool:
    """Whether a rollout (its completion's messages) called a tool, read a result that is not an error, and then
    answered from it: its last message an assistant turn without calls whose text holds a value of a result (a JSON
    result's scalar values, else its whole text) that none of the calls' arguments holds (the name looked up, echoed
    back, is not an answer)."""
    if not messages or messages[-1].get("role") != "assistant" or messages[-1].get("tool_calls"):
        return False
    answer = messages[-1].get("content") or ""
    asked = {leaf for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or ()
             for leaf in _leaves((call.get("function") or {}).get("arguments"))}
    for message in messages[:-1]:
        if message.get("role") != "tool":
            continue
        result = _result_value(message.get("content") or "")
        if isinstance(result, dict) and set(result) == {"error"}:  # a failed call (TRL's str({"error": ...}))
            continue
        if any(leaf and leaf not in asked and leaf in answer for leaf in _leaves(result)):
            return True
    return False


def tool_stats(entries: list[dict[str, Any]]) -> dict[str, float]:
    """A round's tool metrics (the same on every rank): TRL's ``tools/call_frequency`` (calls per rollout) and
    ``tools/failure_frequency`` (failed calls per call), the turns per rollout, the share of rollouts that answered
    from a tool's result (``tools/answered_from_result``: :func:`answered_from_result`), the results rolled back as
    too long, and the failures by kind (``tools/failed_timeout``, ``_crashed``, ...)."""
    stats = [s for entry in entries for s in entry.get("tool_stats", ())]
    if not stats:
        return {}
    total = {key: sum(s.get(key, 0) for s in stats) for key in dict.fromkeys(k for s in stats for k in s)}
    calls, failures = total.pop("calls"), total.pop("failures")
    return {"tools/call_frequency": calls / len(stats),
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/turns": total.pop("turns") / len(stats),
            "tools/answered_from_result": total.pop("answered_from_result", 0) / len(stats),
            **{f"tools/{k}": float(v) for k, v in total.items()}}
