"""Format ``unpaired``: a prompt, one completion and whether it is desirable, for unpaired preference objectives
(``kto``; ``data.format: unpaired`` needs one enabled).

The rows are TRL's unpaired preference datasets (KTO's):

* plain text: ``prompt`` and ``completion`` strings, ``label`` ``true`` (desirable) or ``false``; the tokenizer's EOS
  text ends each completion (added where it is missing);
* conversational: ``prompt`` a list of messages, ``completion`` a list of messages (the answer), rendered with the
  chat template (messages read as the ``chat`` format reads them: tool calls, tool results and thinking,
  ``data.message_keys`` and ``data.roles``; a ``tools`` column is given to the template).

Tokenization is TRL's ``KTOTrainer``'s: the prompt alone (conversational: with the generation prompt) and prompt +
completion are tokenized, and the completion starts where the two first differ. Only completion tokens carry labels.
A row becomes ``input_ids``/``labels`` and ``label`` (a bool); ``data.too_long`` applies (``truncate`` keeps the
start, as TRL's collator). Where TRL drops a row whose prompt alone fills the maximum length, hfsdp refuses it (no
completion token could be trained), naming the row, as it refuses a ``label`` that is not ``true`` or ``false``.
"""

from __future__ import annotations

from typing import Any

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.builtin.chat import TOOLS_FIELD, chat_ids, conversation, tools_of
from hfsdp.builtin.preference import _common_prefix, _is_empty
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True
FORMAT = "unpaired"
COLUMNS = ("prompt", "completion", "label")


def tokenize_row(prompt: Any, completion: Any, label: Any, tokenizer, data_config, tools: Any = None) -> dict[str, Any]:
    """One row's token ids, labels and ``label`` (see the module docstring), or a RowError saying what is wrong."""
    if not isinstance(label, bool):
        raise RowError(f"label {label!r} is not true or false: the label column says whether the completion is "
                       "desirable (true) or undesirable (false)")
    if _is_empty(completion):
        raise RowError(f"the completion is {'missing' if completion is None else 'empty'}: every row needs a "
                       "non-empty completion")
    if _is_empty(prompt):
        raise RowError("the prompt is missing or empty: every row needs the prompt its completion answers")
    conversational = isinstance(completion, list)
    if isinstance(prompt, list) != conversational:
        raise RowError("prompt and completion mix a text and a message list: give both as texts, or both as lists "
                       "of messages")
    if conversational:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("conversational unpaired data needs a tokenizer with a chat template; this one has none")
        prompt, completion, tools = conversation(prompt, data_config), conversation(completion, data_config), tools_of(tools)
        prompt_ids = chat_ids(prompt, tokenizer, tools, add_generation_prompt=True)
        full_ids = chat_ids(prompt + completion, tokenizer, tools)
    else:
        eos = tokenizer.eos_token or ""
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids, full_ids = tokenizer(prompt)["input_ids"], tokenizer(prompt + completion)["input_ids"]
    start = _common_prefix(prompt_ids, full_ids)
    if start >= data_config.max_seq_len:
        raise RowError(f"the prompt has {start} tokens and fills data.max_seq_len ({data_config.max_seq_len}): no "
                       "completion token would be trained; raise data.max_seq_len or shorten the prompt")
    return {"input_ids": full_ids, "labels": [IGNORE_INDEX] * start + full_ids[start:], "label": label}


def tokenize_unpaired(batch, tokenizer, data_config):
    missing = [c for c in COLUMNS if c not in batch]
    if missing:
        raise UserError(f"unpaired data needs the columns prompt, completion and label (true: desirable, false: "
                        f"undesirable); missing: {', '.join(missing)}; columns: {', '.join(batch)}")
    out: dict[str, list] = {"input_ids": [], "labels": [], "label": []}
    for position, values in enumerate(zip(*(batch[c] for c in COLUMNS))):
        try:
            row = tokenize_row(*values, tokenizer, data_config,
                               batch[TOOLS_FIELD][position] if TOOLS_FIELD in batch else None)
        except RowError as err:
            err.position = position
            raise
        for key, value in row.items():
            out[key].append(value)
    return out


def format_problems(config, plugin: str) -> list[tuple[str, str]]:
    """The problem of an unpaired objective's run whose data is not ``unpaired`` rows (none if it is)."""
    if config.data.format == FORMAT:
        return []
    return [("data.format", f"{plugin} trains on unpaired rows (prompt, completion, label), not "
                            f"'{config.data.format}': set data.format: {FORMAT}")]


@hookimpl
def hfsdp_dataset_formats():
    return {FORMAT: tokenize_unpaired}
