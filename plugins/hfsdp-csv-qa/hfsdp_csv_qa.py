"""hfsdp plugin ``csv_qa``: dataset format ``qa``, and a reader for tab-separated ``.tsv`` files.

Rows with a ``question`` and an ``answer`` column (a CSV file, a ``.tsv`` file read by this plugin, or JSONL/Parquet
with those columns) and an optional ``system`` column. Each row is rendered as a chat with the tokenizer's chat
template (system?, user: question, assistant: answer); only the answer carries loss. Tokenizers without a chat
template get a plain ``Question: ...\\nAnswer: ...`` layout, again with loss on the answer (and EOS) only.

Use it with::

    plugins: [csv_qa]
    data:
      format: qa
      path: faq.tsv        # or faq.csv
    csv_qa:
      system: null         # a system prompt for rows without a `system` column
"""

import csv

from pydantic import BaseModel, ConfigDict, Field

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.builtin.chat import tokenize_conversation
from hfsdp.errors import UserError

__version__ = "0.2.0"


class CsvQaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    system: str | None = Field(None, description="system prompt for rows without a `system` column")


@hookimpl
def hfsdp_config_section():
    return "csv_qa", CsvQaConfig


def read_tsv(path, split, data_config):
    """The rows of a tab-separated file whose first line names the columns."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows:
        raise UserError(f"data: {path} has a header but no rows")
    return rows


@hookimpl
def hfsdp_data_readers():
    return {".tsv": read_tsv}


def _plain(question: str, answer: str, tokenizer) -> tuple[list[int], list[int]]:
    prompt = tokenizer(f"Question: {question}\nAnswer: ", add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    reply = tokenizer(answer, add_special_tokens=False)["input_ids"] + eos
    return prompt + reply, [IGNORE_INDEX] * len(prompt) + reply


def tokenize_qa(batch, tokenizer, data_config, section=None):
    missing = [c for c in ("question", "answer") if c not in batch]
    if missing:
        raise UserError(f"qa data needs columns question and answer (optional: system); missing {missing}; "
                        f"columns: {', '.join(batch)}")
    default_system = section.system if section is not None else None
    systems = batch.get("system") or [None] * len(batch["question"])
    out = {"input_ids": [], "labels": []}
    for question, answer, system in zip(batch["question"], batch["answer"], systems):
        question, answer, system = str(question), str(answer), system or default_system
        if getattr(tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            ids, labels = tokenize_conversation(messages, tokenizer)
        else:
            ids, labels = _plain(question, answer, tokenizer)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


@hookimpl
def hfsdp_dataset_formats():
    return {"qa": tokenize_qa}
