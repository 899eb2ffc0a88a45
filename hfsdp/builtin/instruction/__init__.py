"""Format ``instruction``: Alpaca-style rows with ``instruction``, optional ``input``, and ``output`` columns.

The prompt uses the Alpaca template (training rows and generation eval's prompts alike); only the response (and the
EOS token after it) carries loss.
"""

from hfsdp import IGNORE_INDEX, hookimpl
from hfsdp.errors import RowError, UserError

ALWAYS_ON = True
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


def render_prompt(instruction: str, input_text: str | None) -> str:
    if input_text:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT.format(instruction=instruction)


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


def generation_prompt(row, data_config, tokenizer) -> tuple[str, str, str]:
    """Generation eval of an instruction row: the Alpaca prompt, the instruction (and input) shown, the output."""
    if row.get("output") is None:
        raise RowError("has no output to compare with; give every eval row an output, or remove the "
                       "generation_eval section")
    shown = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
    return render_prompt(row["instruction"], row.get("input")), shown, row["output"]


@hookimpl
def hfsdp_dataset_formats():
    return {"instruction": tokenize_instruction}


@hookimpl
def hfsdp_generation_prompts():
    return {"instruction": generation_prompt}
