"""Format ``chat``: rows with a list of messages, rendered with the tokenizer's chat template.

Rows come in two common shapes, both read without configuration: ``messages`` lists of ``{role, content}``
(OpenAI / transformers) and ShareGPT's ``conversations`` lists of ``{from, value}`` with the roles ``human``,
``gpt`` and ``system``. Other shapes are named by ``data.messages_field``, ``data.message_keys`` and ``data.roles``
(axolotl's ``message_property_mappings``/``roles``, LLaMA-Factory's ``role_tag``/``content_tag``/``user_tag``...).
:func:`conversation` turns one row's messages into ``{role, content}`` dicts, or says what is wrong with the row
and which key fixes it.

Only assistant turns carry loss, every one of a multi-turn conversation. Each assistant span is found by rendering
the conversation up to that turn (with the generation prompt) and up to its end; this needs a template whose
renderings of a conversation's prefixes are prefixes of each other, which is checked.
"""

from __future__ import annotations

from typing import Any

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True

# (messages column, role key, content key) of the shapes recognised without configuration, in the order tried.
MESSAGES_FIELDS = ("messages", "conversations")
MESSAGE_KEYS = (("role", "content"), ("from", "value"))
# The rows' role names -> the chat template's; data.roles adds to these.
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}


def messages_field(data_config, columns) -> str:
    """The column holding the messages: ``data.messages_field``, else the first of MESSAGES_FIELDS present."""
    if data_config.messages_field:
        if data_config.messages_field not in columns:
            raise UserError(f"data.messages_field: column '{data_config.messages_field}' not found; columns: "
                            f"{', '.join(columns)}")
        return data_config.messages_field
    found = next((f for f in MESSAGES_FIELDS if f in columns), None)
    if found is None:
        raise UserError(f"chat data needs a column of messages ({' or '.join(MESSAGES_FIELDS)}); columns: "
                        f"{', '.join(columns)}. Name yours with data.messages_field")
    return found


def conversation(messages: Any, data_config) -> list[dict[str, str]]:
    """One row's messages as ``{role, content}`` dicts in the template's role names, or a RowError naming the
    message at fault and the config key that fixes it."""
    if not isinstance(messages, list) or not messages:
        raise RowError(f"the messages are {type(messages).__name__ if messages is not None else 'missing'}"
                       f"{' (empty)' if messages == [] else ''}, not a list of messages: give every row a list of "
                       "{role, content} (or ShareGPT {from, value}) messages")
    keys = data_config.message_keys
    roles = {**ROLES, **(data_config.roles or {})}
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"message {i} is a {type(message).__name__}, not a mapping with a role and a text")
        # Rows read through Arrow carry every key any message of the file has, as None where a message lacks it.
        present = sorted(k for k, v in message.items() if v is not None)
        if keys is not None:
            role_key, content_key = keys.role, keys.content
        else:
            role_key, content_key = next(((r, c) for r, c in MESSAGE_KEYS if r in present and c in present),
                                         (None, None))
        if role_key not in present or content_key not in present:
            given = f"data.message_keys {{role: {keys.role}, content: {keys.content}}}" if keys else \
                " or ".join(f"{r}/{c}" for r, c in MESSAGE_KEYS)
            raise RowError(f"message {i} has the keys {present}, not {given}: set data.message_keys: "
                           "{role: KEY, content: KEY} to the keys of its role and text")
        role, content = message[role_key], message[content_key]
        if role not in roles:
            raise RowError(f"message {i} has the role {role!r}, which is none of {', '.join(roles)}: map it with "
                           f"data.roles: {{{role}: ROLE}}, ROLE being system, user or assistant")
        if not isinstance(content, str):
            raise RowError(f"message {i}'s {content_key} is a {type(content).__name__}, not a text")
        out.append({"role": roles[role], "content": content})
    return out


def _render(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def tokenize_conversation(messages, tokenizer):
    """Token ids and labels of one conversation; labels are -100 outside assistant turns."""
    text = _render(tokenizer, messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    labels = [IGNORE_INDEX] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not text.startswith(before) or not text.startswith(through):
            raise UserError("the chat template does not render conversation prefixes as prefixes; "
                             "use the instruction format or a template without look-ahead")
        start = len(tokenizer(before, add_special_tokens=False)["input_ids"])
        end = len(tokenizer(through, add_special_tokens=False)["input_ids"])
        labels[start:end] = ids[start:end]
    return ids, labels


def tokenize_chat(batch, tokenizer, data_config):
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("chat data needs a tokenizer with a chat template; this tokenizer has none "
                         "(use data.format: instruction, or a chat model's tokenizer)")
    field = messages_field(data_config, list(batch))
    ids, labels = [], []
    for position, messages in enumerate(batch[field]):
        try:
            chat = conversation(messages, data_config)
        except RowError as err:
            err.position = position
            raise
        row_ids, row_labels = tokenize_conversation(chat, tokenizer)
        ids.append(row_ids)
        labels.append(row_labels)
    return {"input_ids": ids, "labels": labels}


def generation_prompt(row, data_config, tokenizer) -> tuple[str, str, str]:
    """Generation eval of a conversation: the conversation before its last assistant turn (chat template, generation
    prompt), the turn before that answer shown, and the answer."""
    messages = conversation(row[messages_field(data_config, list(row))], data_config)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        raise RowError("has no assistant turn to compare with; give every eval conversation an assistant answer, or "
                       "remove the generation_eval section")
    last = answers[-1]
    text = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
    return text, messages[last - 1]["content"] if last else "", messages[last]["content"]


@hookimpl
def hfsdp_dataset_formats():
    return {"chat": tokenize_chat}


@hookimpl
def hfsdp_generation_prompts():
    return {"chat": generation_prompt}
