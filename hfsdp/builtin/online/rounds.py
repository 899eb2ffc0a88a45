"""A round of the online objectives' completions and what is made of it: the buffer that keeps the round in use for
its ``num_iterations`` optimizer steps, checkpointed with the run so that a resume inside a round trains on the same
completions (:class:`RoundBuffer`); the micro-batches of its entries (:class:`GroupBatch`: prompts and completions
laid out as TRL lays them out, :func:`prompt_completion_batch`, with each completion's advantage and kept per-token
log-probs); the per-token log-probs and entropies read off them (:func:`token_logps`); and the completions log
(:func:`log_completions`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfsdp import IGNORE_INDEX
from hfsdp.builtin.prompt import ROW_COLUMN
from hfsdp.data.batches import PER_TOKEN_INPUTS, MicroBatch
from hfsdp.objective import target_logps


@dataclass
class GroupBatch(MicroBatch):
    """A micro-batch of completions (rows: prompt + completion, only the completion labelled) with each
    completion's advantage and the kept per-token log-probs (``[completions, tokens]`` at the labelled targets): the
    trainer's when sampled, the reference's and, from an engine beside the trainer, the sampler's."""

    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampler_logps: torch.Tensor | None = None
    entropy_threshold: float | None = None  # set by an objective that trains on the high-entropy tokens only


class RoundBuffer:
    """The generation round in use (every micro-batch of the global batch), checkpointed with the run so that a
    resume inside a round trains on the same completions: ``state_dict`` holds plain lists, the same on every
    rank; with the workers engine (``engine``), also the rounds sampled ahead and not trained on yet (waited for:
    :meth:`hfsdp.builtin.online.engine.GenerationWorkers.ahead`)."""

    def __init__(self):
        self.round = -1
        self.entries: list[dict[str, Any]] = []  # per global micro-batch: rows, prompts, completions, values
        self.stats: dict[str, float] = {}
        self.engine = None

    def state_dict(self) -> dict[str, Any]:
        ahead = self.engine.ahead() if self.engine is not None else {}
        return {"round": self.round, "entries": self.entries, "stats": self.stats, "ahead": ahead}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round, self.entries, self.stats = int(state["round"]), state["entries"], state["stats"]
        if self.engine is not None:
            self.engine.restore(state.get("ahead", {}))


@torch.no_grad()  # a metric: no graph through more logits-sized tensors
def entropies(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's distribution (``logits``: float32, already over the temperature)."""
    return torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)


def token_logps(model, batch: MicroBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies (of the logits over the temperature) at the batch's targets, 0 elsewhere,
    one completion per row (``batch.sequence_targets``' layout)."""
    logits = model(**batch.inputs).logits.float() / temperature
    entropy = entropies(logits)
    logps, entropy = target_logps(logits, batch.targets), entropy * (batch.targets != IGNORE_INDEX)
    return batch.per_sequence(logps), batch.per_sequence(entropy)


def labelled_of(completions: list[list[int]], ends: set[int]) -> list[bool]:
    """Whether each completion ends in one of ``ends`` (EOS or the pad token): TRL's test of a completion not cut at
    ``max_new_tokens`` (``mask_truncated_completions`` leaves the others out of the loss)."""
    return [c[-1] in ends for c in completions]


def targets_of(completion: list[int], mask: list[int] | None = None, labelled: bool | None = None) -> list[int]:
    """A completion's targets: its tokens, but IGNORE_INDEX where ``mask`` (TRL's ``tool_mask``) is 0 (a tool's
    result, which the model did not sample) and everywhere where ``labelled`` is False."""
    if labelled is False:
        return [IGNORE_INDEX] * len(completion)
    return list(completion) if mask is None else [t if m else IGNORE_INDEX for t, m in zip(completion, mask)]


def prompt_completion_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device,
                            select_logits: bool, labelled: list[bool] | None = None,
                            masks: list[list[int]] | None = None, visual: list[dict] | None = None,
                            mrope: bool = False) -> MicroBatch:
    """Rows of a prompt and its completion as TRL lays them out: the prompts left-padded and the completions
    right-padded, so every completion starts at the same position and the model computes logits at the longest
    completion's positions only (``select_logits``; a model without ``logits_to_keep``: at every position, the
    targets there unlabelled). ``position_ids`` count from each row's first real token (what ``generate`` gave the
    prompt), the attention mask hides the padding. ``labelled``: which rows' completions are targets (default
    all; the others are in the rows, unlabelled); ``masks``: each completion's tool mask (:func:`targets_of`).
    ``visual``: a vision-language model's prompt rows, whose per-token inputs the rows carry (0 on the completions
    and the padding); with ``mrope`` (Qwen's 3-D rope) no ``position_ids``: the model lays out its image positions
    from them, as ``generate`` did."""
    width, longest = max(map(len, prompts)), max(map(len, completions))
    rows = len(prompts)
    input_ids = torch.full((rows, width + longest), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, width - len(p):width + len(c)] = torch.tensor(p + c)
        attention[i, width - len(p):width + len(c)] = 1
        # position t predicts t + 1
        targets[i, width - 1:width - 1 + len(c)] = torch.tensor(
            targets_of(c, masks and masks[i], labelled and labelled[i]), dtype=torch.long)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention, "use_cache": False,
              **({} if mrope else {"position_ids": positions})}
    for key in PER_TOKEN_INPUTS:  # a vision-language processor's, on the prompt's tokens
        if visual and key in visual[0]:
            inputs[key] = torch.zeros_like(input_ids)
            for i, row in enumerate(visual):
                inputs[key][i, width - len(row[key]):width] = torch.tensor(row[key])
    if select_logits:
        keep = torch.arange(width - 1, width - 1 + longest)
        inputs["logits_to_keep"], targets = keep, targets[:, keep]
    labelled = targets != IGNORE_INDEX
    return MicroBatch(inputs={k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
                      targets=targets.to(device), lengths=[len(p) + len(c) for p, c in zip(prompts, completions)],
                      num_targets=int(labelled.sum()),
                      label_positions=labelled.reshape(-1).nonzero().flatten().to(device))


def spread(values: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """Per-completion token lists placed at the mask's positions (row-major: each row's tokens in order)."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[mask.cpu()] = torch.tensor([v for row in values for v in row], dtype=torch.float32)
    return out.to(mask.device)


def per_row(tensor: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Each row's values at the mask's positions, as lists (what :func:`spread` places back)."""
    return [row[m].tolist() for row, m in zip(tensor.detach().float().cpu(), mask.cpu())]


def log_completions(path: Path, limit: int, step: int, dataset, entries: list[dict[str, Any]], group: int, tokenizer,
                    reward_names: list[str]) -> None:
    """The round's first ``limit`` completions (``entries``, ``group`` per prompt) appended to ``path`` as JSON
    lines: the step, the row and its prompt, the completion's text and ids, its advantage and each reward (None:
    none); a rollout that acts adds its conversation (``messages``: each turn, its tool calls and their results),
    its ``tool_mask`` and what its environment's ``reset`` appended to the prompt (``observation``)."""
    lines = []
    for entry in entries:
        texts = tokenizer.batch_decode(entry["completion_ids"], skip_special_tokens=True)
        for j, text in enumerate(texts):
            if len(lines) == limit:
                break
            prompt = json.loads(dataset[entry["rows"][j // group]][ROW_COLUMN])["prompt"]
            acted = ({"messages": entry["messages"][j], "tool_mask": entry["tool_masks"][j],
                      "observation": entry["observations"][j]} if "messages" in entry else {})
            lines.append(json.dumps({"step": step + 1, "row": entry["rows"][j // group], "prompt": prompt,
                                     "completion": text, "completion_ids": entry["completion_ids"][j], **acted,
                                     "advantage": entry["advantages"][j],
                                     "rewards": {name: (None if math.isnan(v) else v) for name, v
                                                 in zip(reward_names, entry["rewards"][j])}}))
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))
