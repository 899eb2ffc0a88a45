"""Format ``text``: plain text rows (a ``.txt`` file split at blank lines, or a JSONL/CSV/Parquet text column).

Every token is trained on; each row ends with the tokenizer's EOS token.
"""

from hfsdp import hookimpl
from hfsdp.errors import UserError

ALWAYS_ON = True


def tokenize_text(batch, tokenizer, data_config):
    if data_config.text_field not in batch:
        raise UserError(f"data.text_field: column '{data_config.text_field}' not found; columns: {', '.join(batch)}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] + eos for text in batch[data_config.text_field]]
    return {"input_ids": ids, "labels": [list(row) for row in ids]}


@hookimpl
def hfsdp_dataset_formats():
    return {"text": tokenize_text}
