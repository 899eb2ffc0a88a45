"""Format ``prompt``: prompts without answers, for objectives that generate the completions themselves (``grpo``;
``data.format: prompt`` needs one enabled).

A row has a ``prompt`` (a text, or a list of messages read as the ``chat`` format reads them: ``data.message_keys``
and ``data.roles`` apply; a ``tools`` column is given to the chat template) and any other columns, which the reward
functions receive as they are (TRL's ``GRPOTrainer`` datasets, read unchanged). A text prompt is tokenized as it is;
a conversational one with the chat template and the generation prompt, and the rewards then receive each completion
as the assistant message it is (its tool calls parsed where the template's response format is known:
:func:`hfsdp.builtin.chat.parse_completion`). A row becomes ``input_ids`` (the prompt's tokens), ``labels``
(the same tokens: nothing trains on them, they only keep the row through the length policy) and ``prompt_row``
(the raw row as JSON, what the rewards are given). ``data.max_seq_len`` bounds the prompt; ``data.too_long:
truncate`` would cut its end (where the generation prompt is), so a prompt that is too long is refused, naming the
row, unless ``too_long`` is ``drop``.
"""

from __future__ import annotations

import json
from typing import Any

from hfsdp import hookimpl
from hfsdp.builtin.chat import chat_ids, conversation, tokenized_rows, tools_of
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True
FORMAT = "prompt"
ROW_COLUMN = "prompt_row"  # the raw row as JSON, for the reward functions


def prompt_ids(prompt: Any, tokenizer, data_config, tools: Any = None) -> list[int]:
    """The token ids of one prompt (a text, or messages rendered with the chat template, its ``tools`` and the
    generation prompt), or a RowError saying what is wrong with it."""
    if prompt is None or (isinstance(prompt, (str, list)) and not (prompt.strip() if isinstance(prompt, str)
                                                                    else prompt)):
        raise RowError(f"the prompt is {'missing' if prompt is None else 'empty'}: every row needs a non-empty "
                       "prompt (a text, or a list of messages)")
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if not isinstance(prompt, list):
        raise RowError(f"the prompt is a {type(prompt).__name__}: give a text, or a list of {{role, content}} messages")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("conversational prompts need a tokenizer with a chat template; this one has none")
    return chat_ids(conversation(prompt, data_config), tokenizer, tools_of(tools), add_generation_prompt=True)


def tokenize_prompt(batch, tokenizer, data_config):
    if "prompt" not in batch:
        raise UserError(f"prompt data needs a column 'prompt' (a text or a list of messages); columns: "
                        f"{', '.join(batch)}")
    columns = list(batch)

    def tokenize_row(position, tools):
        ids = prompt_ids(batch["prompt"][position], tokenizer, data_config, tools)
        if len(ids) > data_config.max_seq_len and data_config.too_long != "drop":
            raise RowError(f"the prompt has {len(ids)} tokens, over data.max_seq_len ({data_config.max_seq_len}); "
                           "cutting it would cut the generation prompt: raise data.max_seq_len, shorten the "
                           "prompt, or set data.too_long: drop")
        return {"input_ids": ids, "labels": ids, ROW_COLUMN: json.dumps({c: batch[c][position] for c in columns})}

    return tokenized_rows(batch, len(batch["prompt"]), ("input_ids", "labels", ROW_COLUMN), tokenize_row)


@hookimpl
def hfsdp_objective_formats():
    return {FORMAT: "prompt rows (without answers) train an objective that generates the completions: enable one "
                    "({plugins}), or use data.format: chat or instruction for supervised fine-tuning"}


@hookimpl
def hfsdp_dataset_formats():
    return {FORMAT: tokenize_prompt}
