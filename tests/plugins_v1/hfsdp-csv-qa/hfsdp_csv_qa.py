"""hfsdp plugin ``csv_qa``: dataset format ``qa``.

Rows with a ``question`` and an ``answer`` column (a CSV file, or JSONL/Parquet with those columns) and an optional
``system`` column. Each row is rendered as a chat with the tokenizer's chat template (system?, user: question,
assistant: answer); only the answer carries loss. Tokenizers without a chat template get a plain
``Question: ...\\nAnswer: ...`` layout, again with loss on the answer (and EOS) only.

Use it with::

    plugins: [csv_qa]
    data:
      format: qa
      path: faq.csv
"""

from hfsdp import hookimpl
from hfsdp.builtin.chat import tokenize_conversation
from hfsdp.errors import UserError

__version__ = "0.1.0"
IGNORE_INDEX = -100


def _plain(question: str, answer: str, tokenizer) -> tuple[list[int], list[int]]:
    prompt = tokenizer(f"Question: {question}\nAnswer: ", add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    reply = tokenizer(answer, add_special_tokens=False)["input_ids"] + eos
    return prompt + reply, [IGNORE_INDEX] * len(prompt) + reply


def tokenize_qa(batch, tokenizer, data_config):
    missing = [c for c in ("question", "answer") if c not in batch]
    if missing:
        raise UserError(f"qa data needs columns question and answer (optional: system); missing {missing}; "
                        f"columns: {', '.join(batch)}")
    systems = batch.get("system") or [None] * len(batch["question"])
    out = {"input_ids": [], "labels": []}
    for question, answer, system in zip(batch["question"], batch["answer"], systems):
        question, answer = str(question), str(answer)
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
