"""Generation eval: greedy answers to held-out prompts, exact-match accuracy against the references.

Works for the chat format (prompt = the conversation before its last assistant turn) and the instruction format.
Every rank generates the same prompts: under FSDP each forward is a collective, so ranks must stay in lockstep,
and identical inputs make identical stopping decisions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hfsdp.data.prompts import render_prompt
from hfsdp.errors import UserError


@dataclass
class GenerationResult:
    accuracy: float
    examples: list[tuple[str, str, str]]  # (prompt shown, reference, generated)


def prompts_and_references(raw_eval, data_config, tokenizer, limit: int) -> list[tuple[str, str, str]]:
    """(model input text, short prompt for display, reference answer) for the first ``limit`` eval rows."""
    rows = []
    for index, row in enumerate(raw_eval.select(range(min(limit, len(raw_eval))))):
        if data_config.format == "chat":
            from hfsdp.builtin.chat import conversation, messages_field

            messages = conversation(row[messages_field(data_config, list(row))], data_config)
            answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            if not answers:
                raise UserError(f"generation_eval: eval row {index} has no assistant turn to compare with; give every "
                                "eval conversation an assistant answer, or remove the generation_eval section")
            last = answers[-1]
            text = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
            shown = messages[last - 1]["content"] if last else ""
            rows.append((text, shown, messages[last]["content"]))
        else:
            text = render_prompt(row["instruction"], row.get("input"))
            rows.append((text, row["instruction"] + (f"\n{row['input']}" if row.get("input") else ""), row["output"]))
    return rows


def _normalise(text: str) -> str:
    return " ".join(text.split())


@contextlib.contextmanager
def generating(model):
    """The model ready for ``generate`` on its unwrapped module, in eval mode: under FSDP1 its parameters gathered
    (FSDP1 only gathers them inside its own forward, and ``generate`` calls the inner module); under FSDP2
    each forward gathers them, so every rank must generate the same batches. Afterwards back in its mode, resharded."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP

    from hfsdp.data.batches import reshard

    was_training = model.training
    model.eval()
    if isinstance(model, FSDPModule):
        # generate() may call an inner module (a peft model's base) and never the root's forward: set the root up
        # (what its first forward does) and gather the parameters it holds itself, which only its forward would.
        model._get_fsdp_state()._lazy_init()
        model.unshard()
    gather = (FSDP.summon_full_params(model, writeback=False, recurse=True)
              if isinstance(model, FSDP) else contextlib.nullcontext())
    try:
        with torch.no_grad(), gather:
            yield
    finally:
        model.train(was_training)
        reshard(model)


@torch.no_grad()
def generate_eval(model, unwrapped, tokenizer, items, max_new_tokens: int, batch_size: int = 16) -> GenerationResult:
    device = next(unwrapped.parameters()).device
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outputs: list[str] = []
    try:
        with generating(model):
            for start in range(0, len(items), batch_size):
                texts = [text for text, _, _ in items[start:start + batch_size]]
                enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                generated = unwrapped.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                    temperature=None, top_p=None, top_k=None,
                )
                new_tokens = generated[:, enc["input_ids"].shape[1]:]
                outputs += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
    hits = sum(_normalise(out) == _normalise(ref) for out, (_, _, ref) in zip(outputs, items))
    examples = [(shown, ref, out.strip()) for out, (_, shown, ref) in zip(outputs, items)]
    return GenerationResult(accuracy=hits / max(1, len(items)), examples=examples)
