"""The rewards of the online objectives' completions (:class:`Scorer`): each rank scores the completions of its own
micro-batches with the reward functions, called as TRL calls them (the rows' prompts and other columns, the
completions as texts or, after conversational prompts, as the messages they are, tool calls parsed) and checked by
:class:`~hfsdp.builtin.online.rewards.RewardCaller`, and every rank gets every score, a failure on any rank raising
on all; ``check_reward_determinism`` scores one completion again alone on every rank, which must get its value. And
the rewards' statistics (:func:`reward_stats`, with TRL's :func:`nanstd`)."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from hfsdp.builtin.chat import TOOLS_FIELD, parse_completion, tools_of
from hfsdp.builtin.online.rewards import RewardCaller
from hfsdp.builtin.prompt import ROW_COLUMN
from hfsdp.data import images
from hfsdp.errors import UserError


def nanstd(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the values that are not NaN, with Bessel's correction (TRL's ``nanstd``)."""
    kept = ~torch.isnan(tensor)
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    count = kept.sum(dim=dim, keepdim=True) if dim is not None else kept.sum()
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, math.nan))
    return (variance.squeeze(dim) if dim is not None else variance.reshape(())).sqrt()


def reward_stats(rewards: torch.Tensor, functions: list) -> dict[str, float]:
    """The mean and standard deviation of the weighted reward (``reward``; NaN where no function scored) and of each
    function's (``rewards/<name>/mean``, ``/std``) over ``rewards`` ``[completions, functions]``; none without
    ``functions``."""
    if not functions:
        return {}
    weights = torch.tensor([w for *_, w in functions], dtype=torch.float32)
    total = (rewards * weights[None]).nansum(1)
    total[torch.isnan(rewards).all(1)] = math.nan
    stats = {"reward": float(torch.nanmean(total)), "reward_std": float(nanstd(total))}
    for i, (name, *_) in enumerate(functions):
        stats[f"rewards/{name}/mean"] = float(torch.nanmean(rewards[:, i]))
        stats[f"rewards/{name}/std"] = float(nanstd(rewards[:, i]))
    return stats


def with_observation(prompt: list[dict[str, Any]] | None, observation: str | None) -> list[dict[str, Any]] | None:
    """A row's prompt as the reward functions receive it after an environment's ``reset`` returned ``observation``:
    appended to the last message's text (TRL's); unchanged without one."""
    if observation is None or not prompt:
        return prompt
    return [*prompt[:-1], {**prompt[-1], "content": (prompt[-1].get("content") or "") + observation}]


class Scorer:
    """The reward functions (``functions``: ``(name, source, function, weight)``) of objective ``name``, called on
    this rank's completions through ``caller`` and gathered over the ranks of ``accelerator``."""

    def __init__(self, name: str, functions: list, tokenizer, caller: RewardCaller, accelerator):
        self.name, self.functions, self.tokenizer = name, functions, tokenizer
        self.caller, self.accelerator = caller, accelerator

    def gathered(self, dataset, mine: dict[int, dict[str, Any]], group: int, split: str = "training",
                 probe: dict[str, Any] | None = None) -> dict[int, list]:
        """Every rank's scores of its entries (key -> ``[completion][function]`` rewards, NaN: None) of ``group``
        completions per row, on every rank; a failure on any rank raises on all. ``probe``: the first completion of
        entry 0, which every rank scores again alone (in the same gather) and which must get the value entry 0's
        owner gave it in its micro-batch (:meth:`_check_determinism`). Collective."""
        from hfsdp.parallel.world import gather_objects

        mine_scored = {k: self._score(dataset, e, group, split) for k, e in mine.items()}
        again = self._score(dataset, probe, 1, split) if probe is not None else None
        everyone = gather_objects(self.accelerator, (mine_scored, again))
        failure = next((v for part, probed in everyone for v in [*part.values(), probed] if isinstance(v, str)), None)
        if failure is not None:
            raise UserError(failure)
        scores = {k: v for part, _ in everyone for k, v in part.items()}
        if probe is not None:
            self._check_determinism(scores[0][0], [probed[0] for _, probed in everyone], probe["rows"][0], split)
        return scores

    def _inputs(self, dataset, entry: dict[str, Any], group: int) -> dict[str, list]:
        raw = [json.loads(dataset[i][ROW_COLUMN]) for i in entry["rows"] for _ in range(group)]
        prompts = [r.get("prompt") for r in raw]
        extra = {}
        if "messages" in entry:  # rollouts that act: each completion its turns and tool results, as TRL gives them
            completions = entry["messages"]
            prompts = [with_observation(p, seen) for p, seen in zip(prompts, entry["observations"])]
            extra = {"environment_rewards": entry["environment_rewards"]}
        elif isinstance(raw[0]["prompt"], list):  # conversational: each completion the message it is (tool calls...)
            ids = [dataset[i]["input_ids"] for i in entry["rows"] for _ in range(group)]
            completions = [[parse_completion(self.tokenizer, c, prompt, tools_of(r.get(TOOLS_FIELD)))]
                           for c, prompt, r in zip(entry["completion_ids"], ids, raw)]
        else:
            completions = self.tokenizer.batch_decode(entry["completion_ids"], skip_special_tokens=True)
        columns = {c: [r.get(c) for r in raw] for c in raw[0] if c != "prompt"}
        if images.IMAGES_COLUMN in dataset.column_names:  # a vision-language model's prompts: the images, as TRL's
            decoded = [[images.decode(data) for data in dataset[i][images.IMAGES_COLUMN]] for i in entry["rows"]]
            columns[images.IMAGES_COLUMN] = [row for row in decoded for _ in range(group)]
        return {"prompts": prompts, "completions": completions, "completion_ids": entry["completion_ids"], **columns,
                **extra}

    def _score(self, dataset, entry: dict[str, Any], group: int, split: str) -> list[list[float]] | str:
        """``[completion][function]`` rewards (NaN: None) of ``group`` completions per row, or the message of what
        went wrong (:class:`~hfsdp.builtin.online.rewards.RewardCaller`)."""
        return self.caller.score(self._inputs(dataset, entry, group), entry["rows"], group, split)

    def _check_determinism(self, owner: list[float], again: list[list[float]], row: int, split: str) -> None:
        """Each function's value of one completion scored in its micro-batch (``owner``) against every rank's score
        of it alone (``again``, in rank order); the first that differs stops the run, on every rank alike."""
        for f, (name, source, fn, _) in enumerate(self.functions):
            for rank, values in enumerate(again):
                a, b = owner[f], values[f]
                if a != b and not (math.isnan(a) and math.isnan(b)):
                    raise UserError(
                        f"{self.caller.where(name, source, fn)} is not a function of its inputs: the first completion "
                        f"of {split} row {row} got {a!r} in its micro-batch and {b!r} scored again alone on rank "
                        f"{rank}. One process and N ranks (and a resume) would train on other rewards; make it "
                        "deterministic (seed what it samples, do not read the rank or the batch around it), or set "
                        f"{self.name}.check_reward_determinism: false for a reward that samples on purpose")
