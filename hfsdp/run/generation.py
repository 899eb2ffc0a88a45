"""Generation eval: greedy answers to held-out prompts, exact-match accuracy against the references.

The format's plugin splits each eval row into a prompt and its reference answer (hook ``hfsdp_generation_prompts``:
the built-in chat and instruction formats register theirs), and may give the row its own ``score(generated) -> bool``
in place of the whitespace-normalised comparison (chat does for a tool-calling turn: the first tool call's name and
arguments, compared as JSON values).
Every rank generates the same prompts: under FSDP each forward is a collective, so ranks must stay in lockstep,
and identical inputs make identical stopping decisions.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from hfsdp.errors import RowError, UserError


@dataclass
class GenerationResult:
    accuracy: float
    examples: list[tuple[str, str, str]]  # (prompt shown, reference, generated)
    compared: str | None = None  # what the rows' own scores compare (see GenerationItem.compared); None: the text


class GenerationItem(NamedTuple):
    """One eval row split for generation (hook ``hfsdp_generation_prompts``): the text the model continues, the
    prompt shown, the reference and, where the split gave them, the row's own ``score(generated) -> bool`` and the
    prompt's images (encoded bytes, for a vision-language model)."""

    text: str
    shown: str
    reference: str
    score: Callable[[str], bool] | None = None
    images: tuple[bytes, ...] = ()

    def hit(self, generated: str) -> bool:
        """Whether ``generated`` is right: the row's score, else whitespace-normalised equality with the reference."""
        return bool(self.score(generated)) if self.score is not None else _normalise(generated) == _normalise(
            self.reference)

    @property
    def compared(self) -> str | None:
        """What the row's score compares, as its ``compared`` attribute says (e.g. "the first tool call (name and
        arguments)"); None for the plain text comparison."""
        return None if self.score is None else getattr(self.score, "compared", "the row's own score")


def prompts_and_references(raw_eval, data_config, tokenizer, limit: int, split) -> list[GenerationItem]:
    """The first ``limit`` eval rows, each split by ``split`` (the format plugin's, hook ``hfsdp_generation_prompts``)
    into (model input text, short prompt for display, reference answer[, score])."""
    rows = []
    for index, row in enumerate(raw_eval.select(range(min(limit, len(raw_eval))))):
        try:
            parts = tuple(split(row, data_config, tokenizer))
        except RowError as err:
            raise UserError(f"generation_eval: eval row {index} {err}") from None
        if len(parts) not in (3, 4, 5) or (len(parts) >= 4 and parts[3] is not None and not callable(parts[3])) or (
                len(parts) == 5 and not all(isinstance(image, bytes) for image in parts[4])):
            raise UserError(f"generation_eval: the split of eval row {index} returned {len(parts)} values; a split "
                            "returns (prompt, shown, reference), (prompt, shown, reference, score) or (prompt, "
                            "shown, reference, score, images), score a callable score(generated) -> bool or None, "
                            "images a list of encoded images (bytes)")
        text, shown, reference, *rest = parts
        rows.append(GenerationItem(text, shown, str(reference), rest[0] if rest else None,
                                   tuple(rest[1]) if len(rest) > 1 else ()))
    return rows


def compared(items: list[GenerationItem]) -> str | None:
    """What generation eval compares where rows bring their own scores (the summary says it): their ``compared``,
    and on how many rows when not on all; None when every row is compared as text."""
    kinds = Counter(item.compared for item in items if item.compared is not None)
    if not kinds:
        return None
    described = ", ".join(kind if count == len(items) else f"{kind} on {count} of {len(items)} rows"
                          for kind, count in kinds.items())
    return described if sum(kinds.values()) == len(items) else described + ", the text on the others"


def _normalise(text: str) -> str:
    return " ".join(text.split())


@contextlib.contextmanager
def generating(model, whole: bool = True):
    """The model ready for generating on its unwrapped module (``generate``, or the online objectives' sampler's own
    forwards with the KV cache), in eval mode, its parameters gathered: under FSDP1 all of them (FSDP1 only gathers
    them inside its own forward, and ``generate`` calls the inner module); under FSDP2 with ``whole``
    (``fsdp.gather_for_generation``) every unit's, once, kept gathered through every decode step;
    without it each forward gathers each unit again (so every rank must generate the same batches). Afterwards back
    in its mode, resharded."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel as FSDP

    from hfsdp.data.batches import reshard

    was_training = model.training
    model.eval()
    kept: list = []  # FSDP2's parameter groups kept gathered, with what they reshard to after a forward
    if isinstance(model, FSDPModule):
        # generate() may call an inner module (a peft model's base) and never the root's forward: set the root up
        # (what its first forward does) and gather the parameters it holds itself, which only its forward would.
        model._get_fsdp_state()._lazy_init()
        model.unshard()
        if whole:  # every unit gathered now and not resharded after its forwards (reshard_after_forward False)
            pending = []  # the all-gathers issued together, then waited for
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    for group in unit._get_fsdp_state()._fsdp_param_groups:
                        kept.append((group, group.post_forward_mesh_info))
                        group.post_forward_mesh_info = None
                    pending.append(unit.unshard(async_op=True))
            for handle in pending:
                if handle is not None:
                    handle.wait()
    gather = (FSDP.summon_full_params(model, writeback=False, recurse=True)
              if isinstance(model, FSDP) else contextlib.nullcontext())
    try:
        with torch.no_grad(), gather:
            yield
    finally:
        for group, after_forward in kept:
            group.post_forward_mesh_info = after_forward
        model.train(was_training)
        reshard(model)


@torch.no_grad()
def generate_eval(model, unwrapped, tokenizer, items, max_new_tokens: int, batch_size: int = 16,
                  gather: bool = True) -> GenerationResult:
    device = next(unwrapped.parameters()).device
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outputs: list[str] = []
    try:
        with generating(model, gather):
            for start in range(0, len(items), batch_size):
                batch = items[start:start + batch_size]
                if any(item.images for item in batch):
                    enc = _with_images(batch, tokenizer, unwrapped).to(device)
                else:
                    enc = tokenizer([item.text for item in batch], return_tensors="pt", padding=True,
                                    add_special_tokens=False).to(device)
                generated = unwrapped.generate(
                    **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                    temperature=None, top_p=None, top_k=None,
                )
                new_tokens = generated[:, enc["input_ids"].shape[1]:]
                outputs += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
    hits = sum(item.hit(out) for out, item in zip(outputs, items))
    # a row scored its own way (a tool call, written over lines) is shown on one line
    examples = [(item.shown, item.reference, out.strip() if item.score is None else _normalise(out))
                for out, item in zip(outputs, items)]
    return GenerationResult(accuracy=hits / max(1, len(items)), examples=examples, compared=compared(items))


def _with_images(batch: list[GenerationItem], tokenizer, model):
    """A batch of prompts with images as a vision-language model generates from them: each prompt's image
    placeholders expanded by the processor (as training expands them), padded on the left, with the images' pixel
    inputs (:class:`hfsdp.data.images.PixelInputs`, the keys the model's forward takes)."""
    from transformers import BatchEncoding

    from hfsdp.data import images
    from hfsdp.data.batches import left_padded
    from hfsdp.model.loading import forward_arguments

    processor = images.processor_of(tokenizer)
    tensors = left_padded([images.processed(processor, item.text, list(item.images)) for item in batch],
                          tokenizer.pad_token_id)
    pixels = images.PixelInputs(processor, forward_arguments(model))(
        [{images.IMAGES_COLUMN: list(item.images)} for item in batch])
    return BatchEncoding({**tensors, **pixels})
