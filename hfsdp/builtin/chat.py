"""Format ``chat``: rows with a ``messages`` list of ``{role, content}``, rendered with the tokenizer's chat template.

Only assistant turns carry loss. Each assistant span is found by rendering the conversation up to that turn
(with the generation prompt) and up to its end; this needs a template whose renderings of a conversation's
prefixes are prefixes of each other, which is checked.
"""

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.errors import UserError

ALWAYS_ON = True


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
    field = data_config.messages_field
    if field not in batch:
        raise UserError(f"data.messages_field: column '{field}' not found; columns: {', '.join(batch)}")
    ids, labels = [], []
    for messages in batch[field]:
        row_ids, row_labels = tokenize_conversation(messages, tokenizer)
        ids.append(row_ids)
        labels.append(row_labels)
    return {"input_ids": ids, "labels": labels}


@hookimpl
def hfsdp_dataset_formats():
    return {"chat": tokenize_chat}
