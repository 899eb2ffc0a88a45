"""Format ``instruction``: Alpaca-style rows with ``instruction``, optional ``input``, and ``output`` columns.

The prompt uses the Alpaca template; only the response (and the EOS token after it) carries loss.
"""

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.data.prompts import render_prompt
from hfsdp.errors import UserError

ALWAYS_ON = True


def tokenize_instruction(batch, tokenizer, data_config):
    missing = [c for c in ("instruction", "output") if c not in batch]
    if missing:
        raise UserError(f"instruction data needs columns instruction, output (and optional input); missing: {missing}")
    inputs = batch.get("input") or [None] * len(batch["instruction"])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids, labels = [], []
    for instruction, input_text, output in zip(batch["instruction"], inputs, batch["output"]):
        prompt = tokenizer(render_prompt(instruction, input_text), add_special_tokens=False)["input_ids"]
        answer = tokenizer(output, add_special_tokens=False)["input_ids"] + eos
        ids.append(prompt + answer)
        labels.append([IGNORE_INDEX] * len(prompt) + answer)
    return {"input_ids": ids, "labels": labels}


@hookimpl
def hfsdp_dataset_formats():
    return {"instruction": tokenize_instruction}
