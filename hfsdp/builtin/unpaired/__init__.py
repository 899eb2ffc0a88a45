"""Format ``unpaired``: a prompt, one completion and whether it is desirable, for unpaired preference objectives
(``kto``; ``data.format: unpaired`` needs one enabled).

The rows are TRL's unpaired preference datasets (KTO's):

* plain text: ``prompt`` and ``completion`` strings, ``label`` ``true`` (desirable) or ``false``; the tokenizer's EOS
  text ends each completion (added where it is missing);
* conversational: ``prompt`` a list of messages, ``completion`` a list of messages (the answer), rendered with the
  chat template (messages read as the ``chat`` format reads them: tool calls, tool results and thinking,
  ``data.message_keys`` and ``data.roles``; a ``tools`` column is given to the template).

Tokenization is TRL's ``KTOTrainer``'s, as the preference format's
(:func:`hfsdp.builtin.preference.tokenize_completions`): the prompt alone (conversational: with the generation
prompt) and prompt + completion are tokenized, and the completion starts where the two first differ. Only completion
tokens carry labels. A row becomes ``input_ids``/``labels`` and ``label`` (a bool); ``data.too_long`` applies
(``truncate`` keeps the start, as TRL's collator). Where TRL drops a row whose prompt alone fills the maximum length,
hfsdp refuses it (no completion token could be trained), naming the row, as it refuses a ``label`` that is not
``true`` or ``false``.
"""

from __future__ import annotations

from typing import Any

from hfsdp import hookimpl
from hfsdp.builtin.chat import tokenized_rows
from hfsdp.builtin.preference import is_empty, rows_problems, tokenize_completions
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True
FORMAT = "unpaired"
COLUMNS = ("prompt", "completion", "label")


def tokenize_row(prompt: Any, completion: Any, label: Any, tokenizer, data_config, tools: Any = None) -> dict[str, Any]:
    """One row's token ids, labels and ``label`` (see the module docstring), or a RowError saying what is wrong."""
    if not isinstance(label, bool):
        raise RowError(f"label {label!r} is not true or false: the label column says whether the completion is "
                       "desirable (true) or undesirable (false)")
    if is_empty(completion):
        raise RowError(f"the completion is {'missing' if completion is None else 'empty'}: every row needs a "
                       "non-empty completion")
    if is_empty(prompt):
        raise RowError("the prompt is missing or empty: every row needs the prompt its completion answers")
    if isinstance(prompt, list) != isinstance(completion, list):
        raise RowError("prompt and completion mix a text and a message list: give both as texts, or both as lists "
                       "of messages")
    [sequence] = tokenize_completions(prompt, [completion], tokenizer, data_config, tools, FORMAT)
    return {**sequence, "label": label}


def tokenize_unpaired(batch, tokenizer, data_config):
    missing = [c for c in COLUMNS if c not in batch]
    if missing:
        raise UserError(f"unpaired data needs the columns prompt, completion and label (true: desirable, false: "
                        f"undesirable); missing: {', '.join(missing)}; columns: {', '.join(batch)}")
    return tokenized_rows(batch, len(batch["prompt"]), ("input_ids", "labels", "label"),
                          lambda position, tools: tokenize_row(*(batch[c][position] for c in COLUMNS), tokenizer,
                                                               data_config, tools))


def format_problems(config, plugin: str) -> list[tuple[str, str]]:
    """The problem of an unpaired objective's run whose data is not ``unpaired`` rows (none if it is)."""
    return rows_problems(config, plugin, FORMAT, COLUMNS)


@hookimpl
def hfsdp_objective_formats():
    return {FORMAT: "unpaired rows (a completion labelled desirable or not) train an unpaired preference objective: "
                    "enable one ({plugins})"}


@hookimpl
def hfsdp_dataset_formats():
    return {FORMAT: tokenize_unpaired}
