"""Format ``preference``: a prompt with a chosen and a rejected completion, for preference objectives (``dpo``, or a
plugin's own; ``data.format: preference`` needs one enabled).

The rows' shapes are TRL's preference datasets', read without configuration:

* plain text: ``prompt``, ``chosen``, ``rejected`` strings; the tokenizer's EOS text ends each completion (added
  where it is missing);
* conversational: ``prompt`` a list of messages, ``chosen`` and ``rejected`` lists of messages (the answers), rendered
  with the chat template (messages read as the ``chat`` format reads them: tool calls, tool results and thinking,
  ``data.message_keys`` and ``data.roles``; a ``tools`` column is given to the template);
* implicit prompt: no ``prompt`` column; ``chosen`` and ``rejected`` are whole conversations (or texts), and their
  shared beginning is the prompt (TRL's ``extract_prompt``).

Tokenization is TRL's ``DPOTrainer``'s: the prompt alone (conversational: with the generation prompt), prompt +
chosen and prompt + rejected are tokenized, and each completion starts where the tokenized prompt and the tokenized
prompt + completion first differ. Only completion tokens carry labels. A row becomes ``input_ids``/``labels`` (prompt
+ chosen) and ``rejected_input_ids``/``rejected_labels``; ``data.too_long`` applies to each (``truncate`` keeps the
start, as TRL's ``keep_start``; ``drop`` drops the pair). Where TRL drops a pair whose prompt alone fills the maximum
length, hfsdp refuses it (no completion token could be trained), naming the row.

A ``margin`` column (TRL's reward-modelling datasets: how much the chosen completion is preferred), where the rows
have one, is kept as a number per row (``reward_model.margin`` reads it); a row whose margin is not a finite number
is refused, naming the row.
"""

from __future__ import annotations

import math
from typing import Any

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.builtin.chat import TOOLS_FIELD, chat_ids, conversation, tools_of
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True
FORMAT = "preference"
COLUMNS = ("prompt", "chosen", "rejected")


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value))


def split_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of an implicit-prompt row: the shared beginning of both (TRL's
    ``extract_prompt``: messages, or characters, a space before the divergence staying with the completions)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx and chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(prompt: Any, chosen: Any, rejected: Any, tokenizer, data_config, tools: Any = None) -> dict[str, Any]:
    """One row's token ids and labels (see the module docstring), or a RowError saying what is wrong with it."""
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if _is_empty(value):
            raise RowError(f"the {name} completion is {'missing' if value is None else 'empty'}: every row needs a "
                           "non-empty chosen and rejected completion")
    if chosen == rejected:
        raise RowError("chosen and rejected are the same: a pair must prefer one completion over another")
    conversational = isinstance(chosen, list)
    if isinstance(rejected, list) != conversational or (prompt is not None and isinstance(prompt, list) != conversational):
        raise RowError("prompt, chosen and rejected mix texts and message lists: give all three as texts, or all as "
                       "lists of messages")
    if prompt is None:
        prompt, chosen, rejected = split_prompt(chosen, rejected)
    if conversational:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("conversational preference data needs a tokenizer with a chat template; this one has none")
        prompt, chosen, rejected = (conversation(m, data_config) if m else [] for m in (prompt, chosen, rejected))
        tools = tools_of(tools)
        prompt_ids = chat_ids(prompt, tokenizer, tools, add_generation_prompt=True) if prompt else []
        chosen_ids, rejected_ids = chat_ids(prompt + chosen, tokenizer, tools), chat_ids(prompt + rejected, tokenizer, tools)
    else:
        eos = tokenizer.eos_token or ""
        chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = tokenizer(prompt)["input_ids"] if prompt else []
        chosen_ids, rejected_ids = tokenizer(prompt + chosen)["input_ids"], tokenizer(prompt + rejected)["input_ids"]
    start = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
    if start >= data_config.max_seq_len:
        raise RowError(f"the prompt has {start} tokens and fills data.max_seq_len ({data_config.max_seq_len}): no "
                       "completion token would be trained; raise data.max_seq_len or shorten the prompt")
    return {"input_ids": chosen_ids, "labels": [IGNORE_INDEX] * start + chosen_ids[start:],
            "rejected_input_ids": rejected_ids, "rejected_labels": [IGNORE_INDEX] * start + rejected_ids[start:]}


MARGIN = "margin"


def margin_of(value: Any) -> float:
    """A row's ``margin`` as a float, or a RowError saying why it is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowError(f"margin {value!r} is not a number: the margin column holds how much the chosen completion "
                       "is preferred, a finite number (e.g. 0.5)")
    return float(value)


def tokenize_preference(batch, tokenizer, data_config):
    missing = [c for c in ("chosen", "rejected") if c not in batch]
    if missing:
        raise UserError(f"preference data needs the columns chosen and rejected (and prompt, unless chosen and "
                        f"rejected share it); missing: {', '.join(missing)}; columns: {', '.join(batch)}")
    prompts = batch.get("prompt") or [None] * len(batch["chosen"])
    out: dict[str, list] = {"input_ids": [], "labels": [], "rejected_input_ids": [], "rejected_labels": []}
    margins = batch.get(MARGIN)
    if margins is not None:
        out[MARGIN] = []
    for position, (prompt, chosen, rejected) in enumerate(zip(prompts, batch["chosen"], batch["rejected"])):
        try:
            row = tokenize_pair(prompt, chosen, rejected, tokenizer, data_config,
                                batch[TOOLS_FIELD][position] if TOOLS_FIELD in batch else None)
            if margins is not None:
                row[MARGIN] = margin_of(margins[position])
        except RowError as err:
            err.position = position
            raise
        for key, value in row.items():
            out[key].append(value)
    return out


def format_problems(config, plugin: str) -> list[tuple[str, str]]:
    """The problem of a preference objective's run whose data is not ``preference`` rows (none if it is)."""
    if config.data.format == FORMAT:
        return []
    return [("data.format", f"{plugin} trains on preference rows (prompt, chosen, rejected), not "
                            f"'{config.data.format}': set data.format: {FORMAT}")]


@hookimpl
def hfsdp_dataset_formats():
    return {FORMAT: tokenize_preference}
