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

On a vision-language model a conversational prompt may show images (read as the ``chat`` format reads them:
content parts, ``<image>`` placeholders, an ``images`` column): its image placeholders are expanded by the processor
and the row keeps the images (and the processor's per-token inputs), from which the objective samples and trains;
the rewards receive the images decoded, a list of PIL images per completion under ``images``, as TRL's
``GRPOTrainer`` passes a dataset's image column (the raw row's own images, where they are bytes or PIL images, are
the text ``[image]`` in its JSON).
"""

from __future__ import annotations

import json
from typing import Any

from hfsdp import hookimpl
from hfsdp.builtin.chat import chat_ids, render, tokenized_rows, tools_of, visual_conversation
from hfsdp.data import images
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True
FORMAT = "prompt"
ROW_COLUMN = "prompt_row"  # the raw row as JSON, for the reward functions


def prompt_ids(prompt: Any, tokenizer, data_config, tools: Any = None) -> list[int]:
    """The token ids of one prompt (a text, or messages rendered with the chat template, its ``tools`` and the
    generation prompt), or a RowError saying what is wrong with it."""
    return prompt_row(prompt, tokenizer, data_config, tools)["input_ids"]


def prompt_row(prompt: Any, tokenizer, data_config, tools: Any = None, row_images: Any = None) -> dict[str, list]:
    """One prompt's ``input_ids`` (:func:`prompt_ids`), or a RowError saying what is wrong with it. Messages may show
    images (read as the chat format reads them, with the row's ``row_images`` column); on a vision-language model
    the prompt's image placeholders are expanded by the processor, and the row carries its ``images`` and the
    processor's per-token inputs (:func:`hfsdp.data.images.processed`)."""
    if prompt is None or (isinstance(prompt, (str, list)) and not (prompt.strip() if isinstance(prompt, str)
                                                                    else prompt)):
        raise RowError(f"the prompt is {'missing' if prompt is None else 'empty'}: every row needs a non-empty "
                       "prompt (a text, or a list of messages)")
    if isinstance(prompt, str):
        images.no_images_beside_text(row_images)
        return {"input_ids": list(tokenizer(prompt)["input_ids"])}
    if not isinstance(prompt, list):
        raise RowError(f"the prompt is a {type(prompt).__name__}: give a text, or a list of {{role, content}} messages")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("conversational prompts need a tokenizer with a chat template; this one has none")
    chat, found = visual_conversation(prompt, row_images, tokenizer, data_config)
    tools = tools_of(tools)
    ids = chat_ids(chat, tokenizer, tools, add_generation_prompt=True)
    processor = images.processor_of(tokenizer)
    if processor is None:
        return {"input_ids": ids}
    expanded, extras = images.processed(processor, render(tokenizer, chat, tools, add_generation_prompt=True), found)
    return {"input_ids": expanded, images.IMAGES_COLUMN: found, **extras}


def _raw(value: Any) -> Any:
    """A raw row's value that JSON has no form for, as it gives it to the reward functions: an image's bytes or a
    PIL image (what a Parquet or Arrow image column holds) as the text ``[image]`` (the rewards get the decoded
    images as ``images``); anything else stays a TypeError."""
    if isinstance(value, (bytes, bytearray)) or (hasattr(value, "save") and hasattr(value, "mode")):
        return "[image]"
    raise TypeError(f"a {type(value).__name__} in the row cannot be given to the reward functions as JSON")


def tokenize_prompt(batch, tokenizer, data_config):
    if "prompt" not in batch:
        raise UserError(f"prompt data needs a column 'prompt' (a text or a list of messages); columns: "
                        f"{', '.join(batch)}")
    columns = list(batch)
    row_images = batch.get(images.IMAGES_COLUMN) or [None] * len(batch["prompt"])

    def tokenize_row(position, tools):
        row = prompt_row(batch["prompt"][position], tokenizer, data_config, tools, row_images[position])
        ids = row["input_ids"]
        if len(ids) > data_config.max_seq_len and data_config.too_long != "drop":
            raise RowError(f"the prompt has {len(ids)} tokens, over data.max_seq_len ({data_config.max_seq_len}); "
                           "cutting it would cut the generation prompt: raise data.max_seq_len, shorten the "
                           "prompt, or set data.too_long: drop")
        return {**row, "labels": ids,
                ROW_COLUMN: json.dumps({c: batch[c][position] for c in columns}, default=_raw)}

    # (a vision-language model's rows: those of the first row, with the images and the processor's inputs)
    return tokenized_rows(batch, len(batch["prompt"]), None if images.processor_of(tokenizer) else
                          ("input_ids", "labels", ROW_COLUMN), tokenize_row)


@hookimpl
def hfsdp_objective_formats():
    return {FORMAT: "prompt rows (without answers) train an objective that generates the completions: enable one "
                    "({plugins}), or use data.format: chat or instruction for supervised fine-tuning"}


@hookimpl
def hfsdp_dataset_formats():
    return {FORMAT: tokenize_prompt}
