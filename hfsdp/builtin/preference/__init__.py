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

from hfsdp import IGNORE_INDEX, REJECTED_PREFIX, hookimpl
from hfsdp.builtin.chat import chat_ids, conversation, render, tokenized_rows, tools_of, visual_conversation
from hfsdp.data import images
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True
FORMAT = "preference"
COLUMNS = ("prompt", "chosen", "rejected")


def is_empty(value: Any) -> bool:
    """A missing value, an empty or blank text, or an empty list of messages."""
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


def tokenize_completions(prompt: Any, completions: list[Any], tokenizer, data_config, tools: Any, what: str,
                         row_images: Any = None, visual: bool = False) -> list[dict[str, list]]:
    """Each completion after ``prompt`` as a sequence (``input_ids``, ``labels``), as TRL's ``DPOTrainer`` and
    ``KTOTrainer`` tokenize them (the preference and the unpaired formats): the prompt alone (messages: with the
    generation prompt) and each prompt + completion are tokenized, the completions start where the tokenized prompt
    and a tokenized prompt + completion first differ (the earliest of them), and only their tokens carry labels.
    Texts end with the tokenizer's EOS text (added where it is missing); lists of messages are rendered with the chat
    template and the row's ``tools``. A RowError when the prompt alone fills ``data.max_seq_len``; ``what`` names
    the rows in the UserError of a tokenizer without a chat template.

    ``visual`` (the preference format): the prompt's messages may show images (read as the chat format reads them,
    with the row's ``row_images`` column: :func:`hfsdp.builtin.chat.visual_conversation`), which every completion
    shares; on a vision-language model each sequence then has its image placeholders expanded by the processor,
    none of their tokens labelled, and carries the images and the processor's per-token inputs
    (:func:`hfsdp.data.images.expand`), as TRL's ``DataCollatorForVisionPreference`` makes them."""
    found: list[bytes] = []
    if isinstance(completions[0], list):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"conversational {what} data needs a tokenizer with a chat template; this one has none")
        if visual:
            if not prompt and not is_empty(row_images):
                raise RowError("has images and no prompt to show them in: give the images in the prompt's messages")
            prompt, found = visual_conversation(prompt, row_images, tokenizer, data_config) if prompt else ([], [])
            completions = [_completion(c, tokenizer, data_config) for c in completions]
        else:
            prompt, *completions = (conversation(m, data_config) if m else [] for m in (prompt, *completions))
        tools = tools_of(tools)
        prompt_ids = chat_ids(prompt, tokenizer, tools, add_generation_prompt=True) if prompt else []
        ids = [chat_ids(prompt + c, tokenizer, tools) for c in completions]
    else:
        images.no_images_beside_text(row_images)
        eos = tokenizer.eos_token or ""
        completions = [c if c.endswith(eos) else c + eos for c in completions]
        prompt_ids = tokenizer(prompt)["input_ids"] if prompt else []
        ids = [tokenizer(prompt + c)["input_ids"] for c in completions]
    start = min(_common_prefix(prompt_ids, i) for i in ids)
    if start >= data_config.max_seq_len:
        raise RowError(f"the prompt has {start} tokens and fills data.max_seq_len ({data_config.max_seq_len}): no "
                       "completion token would be trained; raise data.max_seq_len or shorten the prompt")
    sequences = [{"input_ids": i, "labels": [IGNORE_INDEX] * start + i[start:]} for i in ids]
    processor = images.processor_of(tokenizer)
    if not visual or processor is None or not isinstance(completions[0], list):
        return sequences
    return [images.expand(processor, render(tokenizer, prompt + c, tools), found, s["input_ids"], s["labels"])
            for s, c in zip(sequences, completions)]


def _completion(messages: Any, tokenizer, data_config) -> list[dict]:
    """A completion's messages, or a RowError where they show an image (a completion's images would be trained as
    its text)."""
    chat, found = visual_conversation(messages, None, tokenizer, data_config)
    if found:
        raise RowError(f"a completion shows {len(found)} image(s): images go in the prompt, which the chosen and "
                       "the rejected completion share")
    return chat


def tokenize_pair(prompt: Any, chosen: Any, rejected: Any, tokenizer, data_config, tools: Any = None,
                  row_images: Any = None) -> dict[str, Any]:
    """One row's token ids and labels (see the module docstring), or a RowError saying what is wrong with it."""
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if is_empty(value):
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
    chosen_row, rejected_row = tokenize_completions(prompt, [chosen, rejected], tokenizer, data_config, tools, FORMAT,
                                                    row_images, visual=True)
    # the images are the prompt's, one column for both; the rejected sequence's other columns under its prefix
    return {**chosen_row, **{REJECTED_PREFIX + k: v for k, v in rejected_row.items() if k != images.IMAGES_COLUMN}}


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
    margins = batch.get(MARGIN)

    row_images = batch.get(images.IMAGES_COLUMN) or [None] * len(batch["chosen"])

    def tokenize_row(position, tools):
        row = tokenize_pair(prompts[position], batch["chosen"][position], batch["rejected"][position], tokenizer,
                            data_config, tools, row_images[position])
        if margins is not None:
            row[MARGIN] = margin_of(margins[position])
        return row

    columns = ("input_ids", "labels", f"{REJECTED_PREFIX}input_ids", f"{REJECTED_PREFIX}labels")
    if margins is not None:
        columns += (MARGIN,)
    # (a vision-language model's rows: those of the first row, with the images and the processor's inputs)
    return tokenized_rows(batch, len(batch["chosen"]), None if images.processor_of(tokenizer) else columns,
                          tokenize_row)


def rows_problems(config, plugin: str, format_name: str, columns: tuple[str, ...]) -> list[tuple[str, str]]:
    """The problem of a run of ``plugin``'s objective whose data is not ``format_name`` rows (none if it is)."""
    if config.data.format == format_name:
        return []
    return [("data.format", f"{plugin} trains on {format_name} rows ({', '.join(columns)}), not "
                            f"'{config.data.format}': set data.format: {format_name}")]


def format_problems(config, plugin: str) -> list[tuple[str, str]]:
    """The problem of a preference objective's run whose data is not ``preference`` rows (none if it is)."""
    return rows_problems(config, plugin, FORMAT, COLUMNS)


@hookimpl
def hfsdp_objective_formats():
    return {FORMAT: "preference rows train a preference objective: enable one ({plugins}), or use data.format: chat "
                    "or instruction for supervised fine-tuning"}


@hookimpl
def hfsdp_dataset_formats():
    return {FORMAT: tokenize_preference}
